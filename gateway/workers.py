"""`python -m gateway.serve --workers N`: N gateway processes on one host behind one port (docs/deploy.md).

Each worker binds the public port with SO_REUSEPORT, so the kernel spreads new connections over the workers,
and a port of its own (the public port + 1 + its index), which its resume tokens name (its `gateway_url`): a
resume the kernel hands to another worker is redirected to that port. The parent starts the Triton server
unless it was given endpoints, then starts the workers with that list, starts again one that dies (after a
second), and stops them all when it is stopped. Their metrics are one exposition: the parent makes a private
directory for prometheus_client's multiprocess mode, names it to the workers, marks a dead worker's live gauges
gone, and removes it when it stops (gateway/metrics.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.multiprocess import mark_process_dead

from .metrics import MULTIPROC_ENV
from .settings import env_name

log = logging.getLogger("gateway.workers")
RESTART_S = 1.0


def listening(host: str, port: int, shared: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def sockets(host: str, port: int, own_port: int) -> list[socket.socket]:
    """A worker's sockets: the public port, shared with the other workers, and its own."""
    return [listening(host, port, shared=True), listening(host, own_port, shared=False)]


def worker_url(public_url: str, host: str, own_port: int) -> str:
    """Where clients reach one worker: the public URL's scheme and host (this host's address when none is
    configured) at the worker's own port."""
    if public_url:
        parts = urlsplit(public_url)
        return urlunsplit((parts.scheme, f"{parts.hostname}:{own_port}", parts.path, "", ""))
    address = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()
    return f"ws://{address}:{own_port}"


def strip(argv: list[str], *flags: str) -> list[str]:
    """`argv` without these flags and their values (`--flag value` or `--flag=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not any(arg.startswith(f"{flag}=") for flag in flags):
            out.append(arg)
    return out


def run(argv: list[str], host: str, port: int, workers: int, triton_url: str, public: str) -> int:
    """Start the workers and keep them running until this process is stopped; `public`: where clients reach
    the gateway (its `gateway_url` setting; empty: its host and port)."""
    base = strip(argv, "--workers", "--triton-url", "--worker-port")
    # Private to this run, whatever the environment names: a directory left by another run would be summed in.
    metrics_dir = tempfile.mkdtemp(prefix="minicpmo-metrics-")

    def start(i: int) -> subprocess.Popen[bytes]:
        own = port + 1 + i
        env = {**os.environ, env_name("gateway_url"): worker_url(public, host, own), MULTIPROC_ENV: metrics_dir}
        return subprocess.Popen([sys.executable, "-m", "gateway.serve", *base, "--triton-url", triton_url,
                                 "--worker-port", str(own)], env=env)

    procs = [start(i) for i in range(workers)]
    print(f"{workers} gateway workers on port {port} (each also on {port + 1}..{port + workers})", flush=True)
    try:
        while True:
            time.sleep(RESTART_S)
            for i, proc in enumerate(procs):
                if proc.poll() is not None:
                    log.error("gateway worker %d (pid %d) exited with code %s: starting it again", i, proc.pid,
                              proc.returncode)
                    mark_process_dead(proc.pid, metrics_dir)  # its gauges leave the sums; its counts stay
                    procs[i] = start(i)
    finally:
        for proc in procs:  # each tells its sessions server_shutdown and ends their Triton sequences
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(metrics_dir, ignore_errors=True)

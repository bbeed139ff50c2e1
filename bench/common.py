"""What the benchmarks share: espeak-ng speech, percentiles, and a Triton + gateway stack on free ports."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(ROOT))

from gateway.audio import read_wav  # noqa: E402 (after the sys.path line: run as a file)
from gateway.triton import TritonServer, free_port  # noqa: E402 (after the sys.path line: run as a file)

TEXTS = [
    "Good morning. Could you please tell me what the weather will be like tomorrow in Paris? "
    "I am planning a long walk along the river and I need to know what to bring.",
    "One two three four five six seven eight nine ten. Eleven twelve thirteen fourteen fifteen sixteen.",
    "I would like to book a table for two people tonight, somewhere quiet, with a view of the sea.",
    "Please remind me to call my sister tomorrow afternoon, and to buy bread on the way home.",
]


def gateway_process(triton_url: str, port: int, max_sessions: int, log: Path,
                    env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`gateway.serve` in front of `triton_url` on `port`, its output in `log`; `env` added to its environment."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "gateway.serve", "--triton-url", triton_url, "--port", str(port),
                                 "--max-sessions", str(max_sessions)], cwd=ROOT, env={**os.environ, **(env or {})},
                                stdout=out, stderr=subprocess.STDOUT)


def wait_ready(port: int, timeout_s: float = 60.0) -> None:
    """Until the gateway on `port` answers /ready with 200 (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)


def cpu_s(pid: int) -> float:
    """A process's CPU time so far, user and system (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def make_speech(folder: Path, seconds: int) -> list[np.ndarray]:
    """Each text spoken by espeak-ng, looped to exactly `seconds` of 16 kHz audio."""
    out = []
    for i, text in enumerate(TEXTS):
        path = folder / f"{i}.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
        audio = read_wav(path)
        out.append(np.tile(audio, -(-seconds * 16_000 // len(audio)))[: seconds * 16_000])
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass
class Stack:
    triton: TritonServer
    ws_url: str
    gateway: subprocess.Popen[bytes] | None = None  # the gateway process (its pid for RSS figures)


@contextlib.contextmanager
def serving_stack(model_repository: Path, work: Path, max_sessions: int,
                  gateway_main: list[str] | None = None, env: dict[str, str] | None = None,
                  gateway_log: Path | None = None) -> Iterator[Stack]:
    """tritonserver and a gateway process in front of it, both stopped on exit. `gateway_main` replaces
    `-m gateway.serve` (bench/gateway_probe.py wraps it); `env` is added to the gateway's environment;
    `gateway_log` keeps its output."""
    server = TritonServer(model_repository, work_dir=work / "triton", log_path=work / "triton.log")
    server.start()
    gateway = None
    try:
        server.wait_ready()
        port = free_port()
        gateway = subprocess.Popen([sys.executable, *(gateway_main or ["-m", "gateway.serve"]),
                                    "--triton-url", server.ports.endpoint, "--port", str(port),
                                    "--max-sessions", str(max_sessions)],
                                   cwd=ROOT, stdout=open(gateway_log, "ab") if gateway_log else subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ready":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield Stack(server, f"ws://127.0.0.1:{port}/backend", gateway)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait()
        server.stop()

"""Keeps the tritonserver that `gateway.serve` started running.

When it exits (a crash, an OOM kill, kill -9), the rest of its process group (the Python backend stubs,
about 150 MB each) is killed, the process reaped, and a new one started after a backoff that doubles
(1 s .. 30 s) and resets once a server stayed up a minute. Meanwhile the gateway's /health says `loading`
and its sessions are told `backend_unavailable` (gateway.shell). When a Triton already answers on the
ports (one started by hand), none is started: the gateway uses that one.
"""

from __future__ import annotations

import logging
import threading
import time

from .launcher import TritonServer

log = logging.getLogger("gateway.supervisor")

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0  # up this long, the backoff starts again from its first step


class Supervisor:
    def __init__(self, server: TritonServer, backoff_s: tuple[float, ...] = BACKOFF_S,
                 stable_s: float = STABLE_S) -> None:
        self.server = server
        self.backoff_s = backoff_s
        self.stable_s = stable_s
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a start and a stop, one at a time
        # PR_SET_PDEATHSIG follows the thread that started the child: this one lives until stop().
        self._thread = threading.Thread(target=self._run, name="triton-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            self.server.stop()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            process = self.server.process
            if process is not None:
                since = time.monotonic()
                code = process.wait()
                if self._stopping.is_set():
                    return
                self.server.reap()
                failures = 0 if time.monotonic() - since > self.stable_s else failures
            delay = self.backoff_s[min(failures, len(self.backoff_s) - 1)]
            failures += 1
            if process is not None:
                log.error("tritonserver (pid %d) exited with code %s; its process group is killed and reaped; "
                          "restarting in %.0f s (restart %d)", process.pid, code, delay, self.restarts + 1)
            if self._stopping.wait(delay):
                return
            self.server.process = None
            if self.server.is_ready():
                log.warning("a tritonserver already answers on port %d (started by hand?): using it, not starting "
                            "another", self.server.ports.http)
                continue
            self._restart()

    def _restart(self) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self.server.start()
        try:
            self.server.wait_ready()
        except Exception as exc:  # noqa: BLE001 (it exited or did not get ready: the loop backs off and retries)
            log.error("tritonserver restart failed: %s", exc)
            return
        self.restarts += 1
        log.warning("tritonserver restarted (pid %d) and ready (restart %d)", self.server.pid, self.restarts)

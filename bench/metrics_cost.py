"""What the gateway's metrics cost (`python bench/load.py --metrics-cost`): one tritonserver, one gateway per mode
(`on`: the histograms and counters recorded, as served; `off`: MINICPMO_METRICS=0, nothing recorded), the same
real-time /backend sessions through each in turn, the modes alternating round by round so that the machine's drift
falls on both. Per mode and session count: chunk latency p50/p95, late and dropped chunks, and the gateway's CPU time
(from /proc) per second a session was open. A Prometheus scraping both once a second (`--scrape`) puts the
exposition's own cost in too.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from common import cpu_s, gateway_process, pct, wait_ready

from gateway.triton import TritonServer, free_port

CHUNK_MS = 1000.0


@dataclass
class Mode:
    name: str  # on | off
    process: subprocess.Popen[bytes]
    port: int
    latencies: dict[int, list[float]] = field(default_factory=dict)  # sessions -> chunk latencies (ms)
    sent: dict[int, int] = field(default_factory=dict)
    cpu_s: dict[int, float] = field(default_factory=dict)
    session_s: dict[int, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/backend"

    def cpu(self) -> float:
        return cpu_s(self.process.pid)


@contextlib.contextmanager
def gateways(model_repository: Path, work: Path, max_sessions: int) -> Iterator[list[Mode]]:
    server = TritonServer(model_repository, work_dir=work / "triton", log_path=work / "triton.log")
    modes: list[Mode] = []
    try:
        server.start()
        server.wait_ready()
        for name, record in (("on", "1"), ("off", "0")):
            port = free_port()
            process = gateway_process(server.ports.endpoint, port, max_sessions, work / f"gateway-{name}.log",
                                      {"MINICPMO_METRICS": record})
            modes.append(Mode(name, process, port))
        for mode in modes:
            wait_ready(mode.port)
        yield modes
    finally:
        for mode in modes:
            mode.process.terminate()
            mode.process.wait()
        server.stop()


class Scraper:
    """Reads each gateway's /metrics once a second, as a Prometheus would."""

    def __init__(self, modes: list[Mode]) -> None:
        self.modes, self._stop = modes, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for mode in self.modes:
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(f"http://127.0.0.1:{mode.port}/metrics", timeout=2)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(model_repository: Path, work: Path, speech: list[np.ndarray], sessions: list[int], rounds: int,
        scrape: bool) -> None:
    from load import gateway_load  # bench/ is on sys.path (load.py runs this)

    work.mkdir(parents=True, exist_ok=True)
    with gateways(model_repository, work, max(sessions) + 8) as modes, \
            (Scraper(modes) if scrape else contextlib.nullcontext()):
        for n in sessions:
            for r in range(rounds):
                for mode in modes if r % 2 == 0 else modes[::-1]:  # alternating: drift falls on both
                    cpu0, t0 = mode.cpu(), time.monotonic()
                    result = asyncio.run(gateway_load(mode.url, n, speech, latencies=True))
                    mode.cpu_s[n] = mode.cpu_s.get(n, 0.0) + mode.cpu() - cpu0
                    mode.session_s[n] = mode.session_s.get(n, 0.0) + n * (time.monotonic() - t0)
                    mode.latencies.setdefault(n, []).extend(result.latencies)
                    mode.sent[n] = mode.sent.get(n, 0) + result.sent
                    print(f"metrics {mode.name}, {n} sessions, round {r + 1}: p95 {result.p95:.0f} ms",
                          file=sys.stderr)
    print(f"\n## the gateway's metrics: recorded (on) vs not (off), {rounds} alternating rounds"
          f"{', /metrics scraped every second' if scrape else ''}\n")
    print("| sessions | metrics | chunk p50 ms | chunk p95 ms | late | dropped | real time | gateway CPU ms per "
          "session-second |")
    print("|---:|---|---:|---:|---:|---:|---|---:|")
    for n in sessions:
        for mode in modes:
            lat = mode.latencies[n]
            late, dropped = sum(x > CHUNK_MS for x in lat), mode.sent[n] - len(lat)
            real_time = pct(lat, 95) < CHUNK_MS and dropped == 0
            cpu_ms = 1000 * mode.cpu_s[n] / max(mode.session_s[n], 1e-9)
            print(f"| {n} | {mode.name} | {pct(lat, 50):.1f} | {pct(lat, 95):.1f} | {late} | {dropped} | "
                  f"{'yes' if real_time else 'no'} | {cpu_ms:.2f} |")
    for mode in modes:
        best = max((n for n in sessions if pct(mode.latencies[n], 95) < CHUNK_MS and mode.sent[n] ==
                    len(mode.latencies[n])), default=0)
        print(f"metrics {mode.name}: largest real-time session count {best}")

"""Sessions over several Triton servers and several gateways (docs/deploy.md): `python bench/load.py --endpoints 2
--gateways 2 --sessions 8` runs this.

E tritonservers and G gateway processes that all list them (each its own port and MINICPMO_GATEWAY_URL) start on
loopback; for each dialect, N real-time sessions (espeak-ng speech, 1 s of audio a second, random phases) are
opened round-robin over the gateways. Printed per dialect: the sessions each endpoint and each gateway held at
the peak (from the gateways' /health), chunk latency, and the gateways' CPU time (from /proc) per second a
session was open (its speech, then its reply and the client's close): sessions per gateway core = session-seconds
held / CPU seconds spent (tritonserver's work is not the gateway's).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import websockets
from common import cpu_s, gateway_process, pct, wait_ready  # bench/ is on sys.path, as load.py has it

from gateway.audio import resample
from gateway.triton import TritonServer, free_port
from minicpmo_client.backend import converse, converse_realtime

Session = Callable[[str, np.ndarray], Awaitable[list[float]]]  # (gateway ws://host:port, 16 kHz audio) -> latencies


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        return cpu_s(self.process.pid)

    def per_endpoint(self) -> dict[str, int]:
        return {e["endpoint"]: e["sessions"] for e in httpx.get(f"{self.http}/health", timeout=5).json()["endpoints"]}


@contextlib.contextmanager
def fleet(model_repository: Path, work: Path, endpoints: int, gateways: int,
          max_sessions: int) -> Iterator[tuple[list[TritonServer], list[Gateway]]]:
    servers = [TritonServer(model_repository, work_dir=work / f"triton{i}", log_path=work / f"triton{i}.log")
               for i in range(endpoints)]
    started: list[Gateway] = []
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        listing = ", ".join(s.ports.endpoint for s in servers)
        for i in range(gateways):
            port = free_port()
            process = gateway_process(listing, port, max_sessions, work / f"gateway{i}.log",
                                      {"MINICPMO_GATEWAY_URL": f"ws://127.0.0.1:{port}"})
            started.append(Gateway(process, port))
        for gw in started:
            wait_ready(gw.port)
        yield servers, started
    finally:
        for gw in started:
            gw.process.terminate()
            gw.process.wait()
        for server in servers:
            server.stop()


async def minicpm_session(url: str, audio: np.ndarray) -> list[float]:
    """MiniCPM-o's dialect (`?mode=audio`): float32 16 kHz appends of 1 s in real time, its events read as they
    come, then `session.close`. Its replies carry no input id: no per-chunk latency."""
    async with websockets.connect(f"{url}/v1/realtime?mode=audio", max_size=64 << 20) as ws:
        while json.loads(await ws.recv())["type"] != "session.queue_done":
            pass
        await ws.send(json.dumps({"type": "session.update", "session": {"do_sample": False}}))
        while json.loads(await ws.recv())["type"] != "session.created":
            pass

        async def read() -> None:
            while json.loads(await ws.recv())["type"] != "session.closed":
                pass

        reader = asyncio.create_task(read())
        start = time.perf_counter()
        for i in range(len(audio) // 16_000):
            await asyncio.sleep(max(0.0, start + i - time.perf_counter()))
            chunk = base64.b64encode(audio[i * 16_000:(i + 1) * 16_000].astype("<f4").tobytes()).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        await asyncio.sleep(2.0)  # its last replies
        await ws.send(json.dumps({"type": "session.close"}))
        await asyncio.wait_for(reader, 30)
    return []


async def backend_session(url: str, audio: np.ndarray) -> list[float]:
    result = await converse(f"{url}/backend", audio, realtime=True, config={"do_sample": False})
    return result.chunk_latencies_ms()


def realtime_session(turn_detection: str) -> Session:
    async def run(url: str, audio: np.ndarray) -> list[float]:
        await converse_realtime(f"{url}/v1/realtime", resample(audio, 16_000, 24_000), turn_detection=turn_detection,
                                greedy=True)
        return []  # the client library's own timing is per reply, not per chunk
    return run


DIALECTS = {
    "/backend": backend_session,
    "/v1/realtime (OpenAI, duplex)": realtime_session("duplex"),
    "/v1/realtime (OpenAI, server_vad)": realtime_session("server_vad"),
    "/v1/realtime?mode=audio (MiniCPM-o)": minicpm_session,
}


async def drive(gateways: list[Gateway], n: int, speech: list[np.ndarray],
                session: Session) -> tuple[list[float], int, float, Counter, Counter]:
    """N sessions round-robin over the gateways; their latencies, failures, the seconds they were open in all,
    and the peak sessions per endpoint and per gateway seen on /health meanwhile."""
    rng = random.Random(n)
    peak_endpoint: Counter[str] = Counter()
    peak_gateway: Counter[str] = Counter()
    done = asyncio.Event()
    open_s: list[float] = []  # how long each session was open: what a gateway holds it for

    async def watch() -> None:
        while not done.is_set():
            seen = await asyncio.gather(*(asyncio.to_thread(gw.per_endpoint) for gw in gateways))
            per_endpoint: Counter[str] = Counter()
            for gw, counts in zip(gateways, seen, strict=True):
                per_endpoint.update(counts)
                peak_gateway[str(gw.port)] = max(peak_gateway[str(gw.port)], sum(counts.values()))
            if sum(per_endpoint.values()) >= sum(peak_endpoint.values()):
                peak_endpoint.clear()
                peak_endpoint.update(per_endpoint)
            await asyncio.sleep(0.5)

    async def caller(i: int) -> list[float]:
        await asyncio.sleep(rng.random())
        url = f"ws://127.0.0.1:{gateways[i % len(gateways)].port}"
        started = time.perf_counter()
        try:
            return await session(url, speech[i % len(speech)])
        finally:
            open_s.append(time.perf_counter() - started)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(caller(i) for i in range(n)), return_exceptions=True)
    done.set()
    await watcher
    latencies = [x for r in results if not isinstance(r, BaseException) for x in r]
    failed = sum(isinstance(r, BaseException) for r in results)
    return latencies, failed, sum(open_s), peak_endpoint, peak_gateway


def run(model_repository: Path, work: Path, speech: list[np.ndarray], seconds: int, endpoints: int, gateways: int,
        sessions: int) -> None:
    rows = []
    with fleet(model_repository, work, endpoints, gateways, max(sessions, 8) * 2) as (_, gws):
        for name, session in DIALECTS.items():
            cpu = [gw.cpu_s() for gw in gws]
            latencies, failed, served, per_endpoint, per_gateway = asyncio.run(drive(gws, sessions, speech, session))
            spent = sum(gw.cpu_s() - was for gw, was in zip(gws, cpu, strict=True))
            rows.append((name, latencies, failed, per_endpoint, per_gateway, spent, served))
            print(f"{name}: {sessions} sessions, {failed} failed, gateway CPU {spent:.1f} s", file=sys.stderr)
    print(f"\nfleet: {endpoints} tritonservers, {gateways} gateways, {sessions} sessions per dialect of {seconds} s of "
          "espeak-ng speech at real-time pace, tiny preset, 2 CPU cores shared by all of them\n")
    print("| dialect | sessions per endpoint (peak) | sessions per gateway (peak) | chunk p50 / p95 ms | failed "
          "| gateway CPU ms per session-second | sessions per gateway core |")
    print("|---|---|---|---|---:|---:|---:|")
    for name, latencies, failed, per_endpoint, per_gateway, spent, served in rows:
        ms = spent * 1000 / max(served, 1)
        lat = f"{pct(latencies, 50):.0f} / {pct(latencies, 95):.0f}" if latencies else "-"
        print(f"| {name} | {' / '.join(str(v) for _, v in sorted(per_endpoint.items()))} | "
              f"{' / '.join(str(v) for _, v in sorted(per_gateway.items()))} | {lat} | {failed} | {ms:.1f} | "
              f"{1000 / ms if ms else float('inf'):.0f} |")

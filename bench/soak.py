"""A bounded soak: many sessions over a few minutes, mixed dialects, some hostile; then nothing may be left.

    .venv/bin/python bench/soak.py --sessions 200 --rounds 3 --concurrency 8

Each session is one of: /backend full_duplex (two 1 s appends, then close), OpenAI Realtime (one append,
session.close), MiniCPM-o ?mode=audio (session.update, one append, session.close), or hostile (binary and
deep JSON frames, out-of-bound audio, a lone surrogate, a client that vanishes mid-step). Printed after
each round, once everything has settled: sessions by kind and outcome, live sequences per stage and active
gateway sessions (both must be 0), the RSS (and its anonymous part) of the gateway and of Triton with its
stubs against the first 20 sessions' and the last round's (a leak grows every round; an allocator that
keeps what a peak freed stops after a round or two), and what the gateway holds (bench/gateway_probe.py:
gc-tracked objects, asyncio tasks, threads, its tables, glibc's heap in use and free). At the end, the
gateway's RSS after malloc_trim(0): what is left is what is in use. Not a timed test: the figures are for
reading (`--tracemalloc` adds the Python allocations that grew most per round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import websockets
from common import ROOT, Stack, make_speech, serving_stack
from load import tree_rss_mib

from gateway.audio import encode_f32_base64, encode_pcm16_base64, resample

STAGES = ("duplex", "llm", "tts", "token2wav")


def live(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for stage in STAGES:
        prefix = f"minicpmo_{stage}_live_sequences "
        out[stage] = next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)),
                          float("nan"))
    return out


async def drain(ws: websockets.ClientConnection, until: set[str], timeout_s: float = 60.0) -> str:
    async with asyncio.timeout(timeout_s):
        while True:
            ev = json.loads(await ws.recv())
            if ev["type"] in until:
                return ev["type"] if ev["type"] != "error" else f"error:{ev['error']['code']}"


async def backend_session(base: str, audio: np.ndarray) -> str:
    async with websockets.connect(base + "/backend", max_size=64 << 20) as ws:
        await ws.send(json.dumps({"type": "session.init", "payload": {"config": {"do_sample": False}}}))
        await drain(ws, {"session.created"})
        steps = 0
        for i in range(2):
            await ws.send(json.dumps({"type": "input.append", "input": {
                "input_id": f"in_{i}", "audio": encode_f32_base64(audio[i * 16_000:(i + 1) * 16_000])}}))
        async with asyncio.timeout(120):
            while steps < 2:
                ev = json.loads(await ws.recv())
                steps += ev.get("chunk_usage") is not None
    return "ok"


async def openai_session(base: str, audio: np.ndarray) -> str:
    # duplex (a step per second) and session.closed: the extensions, as the page asks for them
    async with websockets.connect(base + "/v1/realtime?extensions=duplex,events", max_size=64 << 20) as ws:
        await drain(ws, {"session.created"})
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": encode_pcm16_base64(resample(audio[:16_000], 16_000, 24_000))}))
        await asyncio.sleep(0.5)
        await ws.send(json.dumps({"type": "session.close"}))
        return await drain(ws, {"session.closed"}, 120)


async def minicpm_session(base: str, audio: np.ndarray) -> str:
    async with websockets.connect(base + "/v1/realtime?mode=audio", max_size=64 << 20) as ws:
        await drain(ws, {"session.queue_done"})
        await ws.send(json.dumps({"type": "session.update", "session": {"config": {"do_sample": False}}}))
        await drain(ws, {"session.created"})
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": encode_f32_base64(audio[:16_000])}))
        await drain(ws, {"response.listen", "response.output_audio.delta"}, 120)
        await ws.send(json.dumps({"type": "session.close"}))
        return await drain(ws, {"session.closed"}, 120)


HOSTILE: list[tuple[str, str | bytes]] = [
    ("/backend", b"\xff\xfe garbage"),
    ("/backend", "[" * 100_000),
    ("/v1/realtime", '{"type": "session.update", "session": {"instructions": "\\ud800"}}'),
    ("/v1/realtime?mode=audio", '{"type": "x", "n": ' + "9" * 5000 + "}"),
]


async def hostile_session(base: str, audio: np.ndarray, rng: random.Random) -> str:
    if rng.random() < 0.3:  # a client that vanishes with a step in flight
        ws = await websockets.connect(base + "/backend", max_size=64 << 20)
        await ws.send(json.dumps({"type": "session.init", "payload": {}}))
        await drain(ws, {"session.created"})
        await ws.send(json.dumps({"type": "input.append", "input": {"input_id": "x",
                                                                    "audio": encode_f32_base64(audio[:16_000])}}))
        ws.transport.abort()  # no close frame
        return "vanished"
    path, frame = rng.choice(HOSTILE)
    async with websockets.connect(base + path, max_size=64 << 20) as ws:
        await ws.send(frame)
        try:
            return await drain(ws, {"error"}, 30)
        except websockets.ConnectionClosed:
            return "closed"


async def soak(base: str, sessions: int, concurrency: int, speech: list[np.ndarray], seed: int,
               on_warm: asyncio.Event) -> Counter[str]:
    rng = random.Random(seed)
    kinds = rng.choices(["backend", "openai", "minicpm", "hostile"], weights=[3, 2, 2, 3], k=sessions)
    outcomes: Counter[str] = Counter()
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i: int, kind: str) -> None:
        nonlocal done
        audio = speech[i % len(speech)]
        async with sem:
            try:
                if kind == "backend":
                    result = await backend_session(base, audio)
                elif kind == "openai":
                    result = await openai_session(base, audio)
                elif kind == "minicpm":
                    result = await minicpm_session(base, audio)
                else:
                    result = await hostile_session(base, audio, random.Random(seed + i))
            except Exception as exc:  # noqa: BLE001 (counted: the figure to read)
                result = f"failed:{type(exc).__name__}"
        outcomes[f"{kind} {result}"] += 1
        done += 1
        if done == min(20, sessions):
            on_warm.set()

    await asyncio.gather(*(one(i, k) for i, k in enumerate(kinds)))
    return outcomes


def settle(stack: Stack, http: str) -> tuple[dict[str, float], int]:
    """Wait until no sequence is live in any stage and the gateway holds no session (resumable sessions whose
    socket went without session.close wait out their 30 s resume grace)."""
    deadline = time.monotonic() + 30
    while (left := live(stack.triton.ports.metrics_url)) and any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    deadline = time.monotonic() + 60
    while (active := httpx.get(f"{http}/health", timeout=5).json()["active_sessions"]) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    return left, active


def probe(pid: int, path: Path, sig: int = signal.SIGUSR1) -> dict[str, Any]:
    """bench/gateway_probe.py's report of what the gateway holds (SIGUSR1; SIGUSR2: after malloc_trim)."""
    path.unlink(missing_ok=True)
    os.kill(pid, sig)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.2)
    return {}


def show_probe(report: dict[str, Any], before: dict[str, Any] | None) -> None:
    heap = report.get("heap", {})
    print(f"    gateway holds: {report.get('objects_total')} objects tracked by gc, "
          f"{report.get('asyncio_tasks')} asyncio tasks, {report.get('threads_native')} threads "
          f"({report.get('threads_python')} Python), tables {report.get('tables')}; glibc heap "
          f"{heap.get('in_use_mib', 0):.1f} MiB in use, {heap.get('free_mib', 0):.1f} MiB free in "
          f"{heap.get('arena_mib', 0):.1f} MiB of arenas, {heap.get('mmap_mib', 0):.1f} MiB mmapped"
          + (f"; Python traced {report['traced_mib']:.1f} MiB" if "traced_mib" in report else ""))
    print("    arenas (MiB from the system / free): "
          + ", ".join(f"{a['system_mib']:.1f}/{a['free_mib']:.1f}" for a in report.get("arenas", [])))
    if before is not None:
        grown = Counter(report.get("objects", {}))
        grown.subtract(before.get("objects", {}))
        print(f"    objects grown since the last round: {dict((k, v) for k, v in grown.most_common(8) if v > 0)}")
    for line in report.get("growth", [])[:8]:
        print(f"    traced growth: {line}")


def memory(gateway_pid: int, triton_pid: int) -> dict[str, float]:
    """RSS and its anonymous part (heap and stacks: what a leak grows; the rest is mapped libraries' pages,
    which the kernel drops and reads back as the machine's memory comes and goes), MB."""
    return {f"{name} {field}": tree_rss_mib(pid, field) for name, pid in (("gateway", gateway_pid),
                                                                           ("triton", triton_pid))
            for field in ("VmRSS", "RssAnon")}


def show_memory(now: dict[str, float], warm: dict[str, float], last: dict[str, float] | None) -> None:
    for name, what in (("gateway", "gateway"), ("triton", "triton + stubs")):
        print(f"    {what}: " + ", ".join(
            f"{'RSS' if field == 'VmRSS' else 'anonymous'} {now[key]:.0f} MB (x{now[key] / warm[key]:.2f} of the "
            f"first 20 sessions'" + (f", x{now[key] / last[key]:.2f} of the last round's" if last else "") + ")"
            for field in ("VmRSS", "RssAnon") for key in [f"{name} {field}"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=200, help="sessions per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--tracemalloc", action="store_true",
                        help="trace the gateway's Python allocations (slower, and its RSS then includes the traces)")
    parser.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the gateway's environment, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    args = parser.parse_args()
    env = {"SOAK_PROBE_TRACEMALLOC": "1" if args.tracemalloc else "0"}
    env.update(item.split("=", 1) for item in args.gateway_env)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        speech = make_speech(work, 3)
        report_path = work / "probe.json"
        env["SOAK_PROBE_REPORT"] = str(report_path)
        with serving_stack(ROOT / "model_repository", work, max_sessions=64,
                           gateway_main=[str(ROOT / "bench" / "gateway_probe.py")], env=env) as stack:
            assert stack.gateway is not None
            pids = (stack.gateway.pid, stack.triton.pid or 0)
            base = stack.ws_url.removesuffix("/backend")
            idle = memory(*pids)
            print(f"{args.rounds} round(s) of {args.sessions} sessions, concurrency {args.concurrency}; gateway env "
                  f"{args.gateway_env or 'as is'}; idle: " + ", ".join(f"{k} {v:.0f} MB" for k, v in idle.items()),
                  flush=True)
            before = probe(pids[0], report_path)
            warm: dict[str, float] = {}
            last: dict[str, float] | None = None
            for r in range(args.rounds):
                async def run(seed: int) -> Counter[str]:
                    on_warm = asyncio.Event()
                    task = asyncio.create_task(soak(base, args.sessions, args.concurrency, speech, seed, on_warm))
                    if not warm:
                        await on_warm.wait()
                        warm.update(memory(*pids))
                    return await task

                started = time.monotonic()
                outcomes = asyncio.run(run(args.seed + r * args.sessions))
                elapsed = time.monotonic() - started
                left, active = settle(stack, base.replace("ws://", "http://"))
                settled_s = time.monotonic() - started - elapsed
                now = memory(*pids)
                report = probe(pids[0], report_path)
                print(f"round {r + 1}: {args.sessions} sessions in {elapsed:.0f} s: "
                      + ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items())))
                print(f"    after {settled_s:.0f} s: live sequences {left}; gateway active sessions {active}")
                show_memory(now, warm, last)
                show_probe(report, before)
                before, last = report, now
            report = probe(pids[0], report_path, signal.SIGUSR2)
            print(f"after malloc_trim(0) in the gateway (its allocator's free pages given back): RSS "
                  f"{tree_rss_mib(pids[0]):.0f} MB, anonymous {tree_rss_mib(pids[0], 'RssAnon'):.0f} MB")
            show_probe(report, None)


if __name__ == "__main__":
    main()

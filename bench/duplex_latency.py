"""Duplex latency: N concurrent real-time sessions through gateway + Triton vs the same step in process.

    python bench/duplex_latency.py [--sessions 1 4 16] [--seconds 20]

Starts tritonserver and the gateway on free ports (or uses --gateway-url), streams espeak-ng speech
at real-time pace (1 s appends) from every session at once, and prints a markdown table: per-chunk
latency (append -> first delta of that step) p50/p95, first-audio latency, and the in-process step.
The overhead is paired: the one-session run and the in-process run hear the same audio and decode
greedily, so step i does the same work in both; the table gives the median of their differences.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_speech, pct, serving_stack  # noqa: E402

from gateway.client import converse  # noqa: E402
from gateway.triton import DEFAULT_MODEL_REPOSITORY  # noqa: E402
from minicpmo_triton.duplex_options import DuplexOptions  # noqa: E402
from minicpmo_triton.inprocess import InProcessStages  # noqa: E402
from minicpmo_triton.pipeline import StepEvent, StepInput  # noqa: E402


async def gateway_run(url: str, n: int, speech: list[np.ndarray]) -> dict[str, Any]:
    results = await asyncio.gather(*(converse(url, speech[i % len(speech)], realtime=True, config={"do_sample": False})
                                     for i in range(n)))
    chunk = [lat for r in results for lat in r.chunk_latencies_ms()]
    first_audio = [s * 1000 for r in results for s in r.first_audio_latency_s]
    answered = sum(len(r.chunk_latencies_ms()) for r in results)
    sent = sum(len(r.timings) for r in results)
    first = [None if t.first_event_at is None else (t.first_event_at - t.sent_at) * 1000
             for t in results[0].timings]
    return {"p50": pct(chunk, 50), "p95": pct(chunk, 95), "fa50": pct(first_audio, 50),
            "fa95": pct(first_audio, 95), "answered": answered, "sent": sent, "steps": first}


async def inprocess_run(repository: Path, speech: np.ndarray) -> dict[str, Any]:
    """The same step, one session, stages called directly (no gateway, no Triton)."""
    stages = InProcessStages(repository)
    pipeline = stages.pipeline()
    n = len(speech) // 16_000
    latencies, first_audio = [], []
    turn_start: float | None = None
    options = DuplexOptions.from_config({"do_sample": False})
    for i in range(n):
        t0 = time.perf_counter()
        first: list[float] = []

        async def emit(ev: StepEvent, t0: float = t0, first: list[float] = first) -> None:
            nonlocal turn_start
            now = time.perf_counter()
            if not first:
                first.append(now)
            if ev.kind == "text" and turn_start is None:
                turn_start = t0
            if ev.kind == "audio" and turn_start is not None:
                first_audio.append((now - turn_start) * 1000)
                turn_start = None

        await pipeline.step(1, i == 0, i == n - 1, StepInput(audio=speech[i * 16_000:(i + 1) * 16_000],
                                                             options=options), emit)
        latencies.append(((first[0] if first else time.perf_counter()) - t0) * 1000)
    return {"p50": pct(latencies, 50), "p95": pct(latencies, 95), "fa50": pct(first_audio, 50),
            "fa95": pct(first_audio, 95), "steps": latencies}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=int, default=20, help="speech per session")
    parser.add_argument("--gateway-url", help="an already running gateway (ws://host:port/backend)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-"))
    speech = make_speech(work, args.seconds)
    local = asyncio.run(inprocess_run(args.model_repository, speech[0]))
    if args.gateway_url:
        rows = [(n, asyncio.run(gateway_run(args.gateway_url, n, speech))) for n in args.sessions]
    else:
        with serving_stack(args.model_repository, work, max(args.sessions)) as stack:
            rows = [(n, asyncio.run(gateway_run(stack.ws_url, n, speech))) for n in args.sessions]

    print(f"\nduplex_latency: tiny preset, {args.seconds} s of espeak-ng speech per session at real-time pace\n")
    print("| path | sessions | chunk p50 ms | chunk p95 ms | first audio p50 ms | first audio p95 ms | answered |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| in-process stages | 1 | {local['p50']:.1f} | {local['p95']:.1f} | {local['fa50']:.1f} | "
          f"{local['fa95']:.1f} | - |")
    for n, r in rows:
        print(f"| gateway + Triton | {n} | {r['p50']:.1f} | {r['p95']:.1f} | {r['fa50']:.1f} | {r['fa95']:.1f} | "
              f"{r['answered']}/{r['sent']} |")
    one = rows[0][1] if rows and rows[0][0] == 1 else None
    if one is not None:
        # Step 0 also starts the session (system prompt, state) in both: paired like the rest.
        diffs = [t - i for t, i in zip(one["steps"], local["steps"], strict=False) if t is not None]
        print(f"\noverhead at 1 session, step by step (same audio, same greedy tokens): p50 "
              f"+{pct(diffs, 50):.1f} ms, p95 +{pct(diffs, 95):.1f} ms over {len(diffs)} steps; "
              f"chunk p50 {one['p50']:.1f} vs {local['p50']:.1f} ms in process")
    return 0


if __name__ == "__main__":
    sys.exit(main())

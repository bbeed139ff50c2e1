"""Duplex latency: N concurrent real-time sessions through gateway + Triton vs the same step in process.

    python bench/duplex_latency.py [--sessions 1 4 16] [--seconds 20]

Starts tritonserver and the gateway on free ports (or uses --gateway-url), streams espeak-ng speech
at real-time pace (1 s appends) from every session at once, and prints a markdown table: per-chunk
latency (append -> first delta of that step) p50/p95, first-audio latency, and the in-process step.
The overhead is paired: the one-session run and the in-process session hear the same audio and decode
greedily, so step i does the same work in both, and the in-process step i runs in the quiet half second
after Triton answered step i (same machine state); the table gives the median of their differences.
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

from common import make_speech, pct, serving_stack

from gateway.triton import DEFAULT_MODEL_REPOSITORY
from minicpmo_client.backend import converse
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import StepEvent, StepInput


async def gateway_run(url: str, n: int, speech: list[np.ndarray], on_event: Any = None) -> dict[str, Any]:
    results = await asyncio.gather(*(converse(url, speech[i % len(speech)], realtime=True, config={"do_sample": False},
                                              on_event=on_event if i == 0 else None)
                                     for i in range(n)))
    chunk = [lat for r in results for lat in r.chunk_latencies_ms()]
    first_audio = [s * 1000 for r in results for s in r.first_audio_latency_s]
    answered = sum(len(r.chunk_latencies_ms()) for r in results)
    sent = sum(len(r.timings) for r in results)
    first = [None if t.first_event_at is None else (t.first_event_at - t.sent_at) * 1000
             for t in results[0].timings]
    return {"p50": pct(chunk, 50), "p95": pct(chunk, 95), "fa50": pct(first_audio, 50),
            "fa95": pct(first_audio, 95), "answered": answered, "sent": sent, "steps": first}


class InProcessSession:
    """The same session, its steps calling the stage code in this process (no gateway, no Triton)."""

    def __init__(self, repository: Path, speech: np.ndarray) -> None:
        self.pipeline = InProcessStages(repository).pipeline()
        self.speech = speech
        self.n = len(speech) // 16_000
        self.options = DuplexOptions.from_config({"do_sample": False})
        self.steps: list[float | None] = [None] * self.n
        self.first_audio: list[float] = []
        self._turn_start: float | None = None

    async def step(self, i: int) -> None:
        t0 = time.perf_counter()
        first: list[float] = []

        async def emit(ev: StepEvent) -> None:
            now = time.perf_counter()
            if not first:
                first.append(now)
            if ev.kind == "text" and self._turn_start is None:
                self._turn_start = t0
            if ev.kind == "audio" and self._turn_start is not None:
                self.first_audio.append((now - self._turn_start) * 1000)
                self._turn_start = None

        await self.pipeline.step(1, i == 0, i == self.n - 1, StepInput(
            audio=self.speech[i * 16_000:(i + 1) * 16_000], options=self.options), emit)
        self.steps[i] = ((first[0] if first else time.perf_counter()) - t0) * 1000


async def paired_run(url: str, local: InProcessSession, speech: list[np.ndarray]) -> dict[str, Any]:
    """One gateway session; in process, step i runs in the quiet half second after Triton answered step i,
    so both sides of a pair see the same machine (its speed drifts by tens of percent over minutes)."""
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Task[None]] = []
    seen: set[str] = set()

    def on_event(ev: dict[str, Any], _now: float) -> None:
        input_id = ev.get("input_id")
        if isinstance(input_id, str) and input_id.startswith("in_") and input_id not in seen:
            seen.add(input_id)
            i = int(input_id[3:])
            # Its audio is out well before then; the next append is due a second after this one's.
            loop.call_later(0.45, lambda: pending.append(loop.create_task(local.step(i))))

    result = await gateway_run(url, 1, speech, on_event)
    await asyncio.gather(*pending)
    for i in range(local.n):  # a step Triton never answered still runs here, so the session stays in step
        if local.steps[i] is None:
            await local.step(i)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=int, default=20, help="speech per session")
    parser.add_argument("--gateway-url", help="an already running gateway (ws://host:port/backend)")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-"))
    speech = make_speech(work, args.seconds)
    local = InProcessSession(args.model_repository, speech[0])

    def sweep(url: str) -> list[tuple[int, dict[str, Any]]]:
        rows = []
        for n in args.sessions:
            # The one-session run is paired step by step with the in-process session.
            rows.append((n, asyncio.run(paired_run(url, local, speech) if n == 1 else gateway_run(url, n, speech))))
        return rows

    if args.gateway_url:
        rows = sweep(args.gateway_url)
    else:
        with serving_stack(args.model_repository, work, max(args.sessions)) as stack:
            rows = sweep(stack.ws_url)
    if 1 not in args.sessions:  # nothing to pair with: the in-process session runs on its own
        async def alone() -> None:
            for i in range(local.n):
                await local.step(i)

        asyncio.run(alone())
    steps = [s for s in local.steps if s is not None]

    print(f"\nduplex_latency: tiny preset, {args.seconds} s of espeak-ng speech per session at real-time pace\n")
    print("| path | sessions | chunk p50 ms | chunk p95 ms | first audio p50 ms | first audio p95 ms | answered |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| in-process stages | 1 | {pct(steps, 50):.1f} | {pct(steps, 95):.1f} | {pct(local.first_audio, 50):.1f} | "
          f"{pct(local.first_audio, 95):.1f} | - |")
    for n, r in rows:
        print(f"| gateway + Triton | {n} | {r['p50']:.1f} | {r['p95']:.1f} | {r['fa50']:.1f} | {r['fa95']:.1f} | "
              f"{r['answered']}/{r['sent']} |")
    one = rows[0][1] if rows and rows[0][0] == 1 else None
    if one is not None:
        # Step 0 also starts the session (system prompt, state) in both: paired like the rest.
        diffs = [t - i for t, i in zip(one["steps"], local.steps, strict=False) if t is not None and i is not None]
        print(f"\noverhead at 1 session, step by step (same audio, same greedy tokens, each pair within the same "
              f"second): p50 +{pct(diffs, 50):.1f} ms, p95 +{pct(diffs, 95):.1f} ms over {len(diffs)} steps; "
              f"chunk p50 {one['p50']:.1f} vs {pct(steps, 50):.1f} ms in process")
    return 0


if __name__ == "__main__":
    sys.exit(main())

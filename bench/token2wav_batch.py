"""token2wav on the CPU, today's path against the device path in one run (after `python -m export --preset tiny`).

- today's: the host path (numpy + ONNX Runtime) as the model serves it on a CPU instance, one synchronous batch
  per execute (`Token2WavStage.run` over every session's call);
- in flight: the device path (torch, every turn's caches in slots of one pool, batched; stage_engine=device on
  this CPU), through its in-flight loop (`InflightToken2Wav`): the same calls submitted at once.

Both on one thread (`ort_threads` 1, torch's too). Each session streams mid-turn chunks (25 tokens) from its own
voice prompt, the two paths taking turns round by round (a shared machine's load falls on both). Prints the median
ms per chunk at each session count both ways, and the latency of a session's 1-chunk call
submitted beside others' 4-chunk calls (a turn's first flush beside long ones): today it waits for its batch's
longest call, in flight it is answered when its own chunk is done.

    python -m bench.token2wav_batch [--sessions 1 8 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

from export.__main__ import REPO_ROOT
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import Token2WavRequest
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.token2wav import Token2WavStage
from minicpmo_triton.stages.token2wav_device import DeviceStreamer
from minicpmo_triton.stages.token2wav_inflight import InflightToken2Wav

FOLDER = REPO_ROOT / "model_repository" / "token2wav" / "1"


def calls(n: int, tokens: int, rng: np.random.Generator, start: bool = False) -> list[StageCall[Token2WavRequest]]:
    voice = [(0.1 * np.random.default_rng(i).standard_normal(16_000 * 3)).astype(np.float32) for i in range(n)]
    return [StageCall(Token2WavRequest(rng.integers(0, 6000, tokens), turn_start=start,
                                       voice=voice[i] if start else np.zeros(0, np.float32)), i + 1, start=start)
            for i in range(n)]


def submit_all(loop: InflightToken2Wav, batch: list[StageCall[Token2WavRequest]]) -> list[float]:
    """Each call's seconds from the submission of all to its answer."""
    done = threading.Semaphore(0)
    answered: list[float] = [0.0] * len(batch)
    t0 = time.perf_counter()

    def reply(i: int) -> Any:
        def answer(result: Any) -> None:
            assert not isinstance(result, Exception), result
            answered[i] = time.perf_counter() - t0
            done.release()
        return answer

    for i, c in enumerate(batch):
        loop.submit(c, reply(i))
    for _ in batch:
        done.acquire()
    return answered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=5, help="mid-turn chunks timed per session (medians)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    preset = load_stage_config(FOLDER)
    print(f"preset {preset.name}, 3 s voices, median of {args.rounds} mid-turn chunks (25 tokens) per session, "
          "the two paths alternated, one thread")
    print("| sessions | today's ms/chunk | in flight ms/chunk | today / in flight |\n|---:|---:|---:|---:|")
    rows = []
    for n in args.sessions:
        today = Token2WavStage.load(FOLDER, preset, 600)
        ring = Token2WavStage.load(FOLDER, preset, 600, streamer=DeviceStreamer.load(FOLDER, preset.token2wav, "cpu"))
        loop = InflightToken2Wav(ring, sweep_period_s=1)
        try:
            rng = np.random.default_rng(n)
            first = calls(n, 25, rng, start=True)  # the voices' setup and the turn's first chunk: not timed
            today.run(first)
            submit_all(loop, first)
            times: dict[str, list[float]] = {"today": [], "flight": []}
            for _ in range(args.rounds):  # alternated, so a shared machine's load falls on both alike
                batch = calls(n, 25, rng)
                for name, run in (("today", today.run), ("flight", functools.partial(submit_all, loop))):
                    t0 = time.perf_counter()
                    run(batch)
                    times[name].append((time.perf_counter() - t0) * 1000 / n)
            today_ms, flight_ms = (statistics.median(times[k]) for k in ("today", "flight"))
            if n >= 2:  # one session's 1-chunk call beside the others' 4-chunk calls
                mixed = calls(n, 100, rng)
                mixed[0] = calls(1, 25, rng)[0]
                t0 = time.perf_counter()
                today.run(mixed)
                today_alone = (time.perf_counter() - t0) * 1000  # the batch answers all its calls together
                flight_alone = submit_all(loop, mixed)[0] * 1000
                rows.append((n, today_alone, flight_alone))
        finally:
            loop.close()
        print(f"| {n} | {today_ms:.1f} | {flight_ms:.1f} | {today_ms / flight_ms:.2f}x |", flush=True)
    if rows:
        print("\nA 1-chunk call beside 4-chunk calls, ms until it is answered:")
        print("| sessions | today's | in flight |\n|---:|---:|---:|")
        for n, a, b in rows:
            print(f"| {n} | {a:.0f} | {b:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

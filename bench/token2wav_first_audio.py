"""When a turn's first speech is heard: token2wav's forced flush (the duplex demo's) vs whole 25 + 3 chunks.

`python -m bench.token2wav_first_audio` (after `python -m export --preset tiny`): one turn through the
`token2wav` stage in process, its steps one second apart carrying the speech tokens given (`--steps`, default a
short first chunk of 10 tokens, then 25 a second); for each mode, the step whose audio first holds speech and
when its first speech sample plays (ms from the turn's first step: that step's end + its compute + where the
speech starts inside its audio, after any left padding, the stream's 3840-sample lead and the 3 silence tokens).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from export.__main__ import REPO_ROOT
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import Token2WavRequest
from minicpmo_triton.stages.token2wav import Token2WavSession, Token2WavStage

SAMPLE_RATE = 24_000
STEP_MS = 1000.0


def first_speech_ms(stage: Token2WavStage, steps: list[int], flush: bool) -> tuple[int, float, float]:
    """(step index, ms from the turn's start, compute ms of that step) of the first speech sample."""
    d, rng = stage.d, np.random.default_rng(0)
    stage.flush = flush
    sess = Token2WavSession()
    for i, n in enumerate(steps):
        req = Token2WavRequest(rng.integers(0, d.vocab, n), turn_start=i == 0, finalize=i == len(steps) - 1)
        t0 = time.perf_counter()
        wav = stage.compute([(req, sess)])[0].waveform
        compute_ms = (time.perf_counter() - t0) * 1000
        if len(wav) and np.any(wav):
            # exact zeros lead (the padding and the stream's lead); then the turn's silence tokens, 960 samples each
            start = int(np.argmax(wav != 0)) + d.turn_lead_silence * SAMPLE_RATE // 25
            return i, (i + 1) * STEP_MS + compute_ms + start * 1000 / SAMPLE_RATE, compute_ms
    raise RuntimeError("no speech in the turn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, nargs="*", default=[10, 25, 25, 25, 5])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    folder = REPO_ROOT / "model_repository" / "token2wav" / "1"
    preset = load_stage_config(folder)
    stage = Token2WavStage.load(folder, preset, ttl_s=60, threads=args.threads)
    print(f"preset {preset.name}; speech tokens per step (1 s apart): {args.steps}")
    print("| mode | first audio in step | first speech plays at (ms) | that step's compute (ms) |")
    print("|---|---:|---:|---:|")
    rows = {}
    for name, flush in (("whole 25 + 3 chunks", False), ("forced flush (demo)", True)):
        step, at, cost = rows[name] = first_speech_ms(stage, args.steps, flush)
        print(f"| {name} | {step + 1} | {at:.0f} | {cost:.1f} |")
    before, after = rows["whole 25 + 3 chunks"][1], rows["forced flush (demo)"][1]
    print(f"first speech {before - after:.0f} ms sooner with the forced flush ({after / before:.2f}x the time)")


if __name__ == "__main__":
    main()

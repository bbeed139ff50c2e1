"""token2wav per-chunk cost in process: N sessions' chunks as one batched forward vs one by one.

`python -m bench.token2wav_batch` (after `python -m export --preset tiny`): each session streams mid-turn
chunks (25 + 3 tokens) from its own voice prompt; prints ms per chunk at batch 1, 8, 32 both ways, the
speed-up, and the state bytes per session.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from export.__main__ import REPO_ROOT
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stages.token2wav_stream import Stream, Token2WavStreamer


def _streams(streamer: Token2WavStreamer, n: int, prompt_tokens: int) -> list[Stream]:
    d, rng = streamer.d, np.random.default_rng(0)
    prompt = streamer.setup(rng.integers(0, d.vocab, prompt_tokens),
                            rng.normal(-6, 1.5, (2 * prompt_tokens, d.n_mels)).astype(np.float32),
                            rng.standard_normal(192).astype(np.float32))
    streams = [streamer.new_stream(prompt, seed=i) for i in range(n)]
    for s in streams:
        streamer.restart(s)
    return streams


def per_chunk_ms(streamer: Token2WavStreamer, n: int, batched: bool, rounds: int, prompt_tokens: int) -> float:
    d, rng = streamer.d, np.random.default_rng(1)
    streams = _streams(streamer, n, prompt_tokens)
    chunk = d.chunk_tokens + d.lookahead
    streamer.chunk([(s, rng.integers(0, d.vocab, chunk).tolist(), False) for s in streams])  # first chunk: warm-up
    t0 = time.perf_counter()
    for _ in range(rounds):
        rows = [(s, rng.integers(0, d.vocab, chunk).tolist(), False) for s in streams]
        if batched:
            streamer.chunk(rows)
        else:
            for row in rows:
                streamer.chunk([row])
    return (time.perf_counter() - t0) * 1000 / (rounds * n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=75, help="the voice prompt's length (3 s)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    folder = REPO_ROOT / "model_repository" / "token2wav" / "1"
    preset = load_stage_config(folder)
    streamer = Token2WavStreamer.load(folder, preset.token2wav, args.threads)
    print(f"preset {preset.name}, voice prompt {args.prompt_tokens} tokens, {args.rounds} mid-turn chunks each")
    print("| sessions | batched ms/chunk | one by one ms/chunk | speed-up |")
    print("|---:|---:|---:|---:|")
    for n in args.batches:
        batched = per_chunk_ms(streamer, n, True, args.rounds, args.prompt_tokens)
        single = per_chunk_ms(streamer, n, False, args.rounds, args.prompt_tokens)
        print(f"| {n} | {batched:.1f} | {single:.1f} | {single / batched:.2f}x |")
    stream = _streams(streamer, 1, args.prompt_tokens)[0]
    d = preset.token2wav
    for _ in range(6):  # past the prompt + 100 frames: the caches' steady size
        streamer.chunk([(stream, [0] * (d.chunk_tokens + d.lookahead), False)])
    print(f"state per session (steady, prompt + 100 frames): {stream.nbytes / 1024:.0f} KiB")


if __name__ == "__main__":
    main()

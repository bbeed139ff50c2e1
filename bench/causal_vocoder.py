"""minicpmo-utils 1.0.7's causal vocoder as the token2wav stage runs it (torch, a session at a time): cost per chunk.

`python -m bench.causal_vocoder [--threads 1]`: a causal HiFT of the official classes at tiny's width (16) and the
published one (512), random weights; one session streams mid-turn chunks of 50 mel frames (1 s); prints ms per
chunk, its real-time factor, and the session's vocoder state (bytes) after them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from export.modules.token2wav import causal_hift_yaml
from minicpmo_triton.vocoder.causal_vocoder import TAGS, CausalVocoder
from minicpmo_triton.vocoder.official_stepaudio2 import load_tagged_yaml

FRAMES = 50  # a 25-token chunk's mel


def per_chunk(channels: int, rounds: int) -> tuple[float, int]:
    model = load_tagged_yaml(causal_hift_yaml(channels), TAGS, {"hifigan": None})["hift"].eval()
    vocoder = CausalVocoder(model)
    state = vocoder.new_state()
    rng = np.random.default_rng(0)
    vocoder.stream(state, rng.normal(-6, 2, (80, FRAMES)).astype(np.float32), False)  # the first: warm-up
    t0 = time.perf_counter()
    for _ in range(rounds):
        vocoder.stream(state, rng.normal(-6, 2, (80, FRAMES)).astype(np.float32), False)
    return (time.perf_counter() - t0) / rounds, state.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"causal vocoder, one session, {FRAMES}-frame (1 s) chunks, {args.threads} torch thread(s)")
    print(f"{'width':>6} {'ms/chunk':>9} {'x real time':>12} {'state bytes':>12}")
    for channels in (16, 512):
        seconds, nbytes = per_chunk(channels, args.rounds)
        print(f"{channels:>6} {seconds * 1e3:>9.0f} {seconds / (FRAMES * 0.02):>12.2f} {nbytes:>12}")


if __name__ == "__main__":
    main()

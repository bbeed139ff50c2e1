"""What deciding an OpenAI `input_audio_buffer.append` costs the gateway per second of audio, against a
thread hand-off: the figures behind `gateway.dialects.openai.OFFLOAD_FRAME_BYTES`.

`python -m bench.frame_cost [--busy N]`: decoding (JSON + base64 audio/pcm), resampling 24 -> 16 kHz
(soxr, streamed), Silero VAD (31 windows a second), and one `run_in_executor` round trip, in ms (median,
p90 and p99 of 200 runs); with `--busy N`, N processes spin beside it (the hand-off then waits for a core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections.abc import Callable

import numpy as np

from bench.common import pct
from gateway.audio import StreamResampler, decode_pcm16_base64, encode_pcm16_base64
from gateway.vad import SileroVad

RUNS = 200


def _spin() -> None:
    while True:
        pass


def _ms(work: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(RUNS):
        start = time.perf_counter()
        work()
        out.append((time.perf_counter() - start) * 1e3)
    return out


async def _handoff() -> list[float]:
    loop, out = asyncio.get_running_loop(), []
    for _ in range(RUNS):
        await asyncio.sleep(0.02)  # frames come apart: the worker thread is parked, as it is between them
        start = time.perf_counter()
        await loop.run_in_executor(None, int)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=0, help="processes spinning beside the measurement")
    args = parser.parse_args()
    busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    try:
        second = (np.random.default_rng(0).standard_normal(24_000) * 0.1).astype(np.float32)
        frame = json.dumps({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(second)})
        resampler, vad = StreamResampler(24_000, 16_000), SileroVad()
        audio_16k = resampler(second)[:16_000]
        rows = [
            ("decode (JSON + base64 pcm16)", _ms(lambda: decode_pcm16_base64(json.loads(frame)["audio"], 1 << 30))),
            ("resample 24 -> 16 kHz", _ms(lambda: resampler(second))),
            ("Silero VAD", _ms(lambda: vad.probabilities(audio_16k))),
            ("thread hand-off (per frame)", asyncio.run(_handoff())),
        ]
    finally:
        for p in busy:
            p.kill()
    print(f"1 s of 24 kHz audio/pcm = a {len(frame):,}-character frame; {args.busy} busy processes")
    print(f"{'work per second of audio':<32}{'median ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for name, ms in rows:
        print(f"{name:<32}{pct(ms, 50):>10.2f}{pct(ms, 90):>10.2f}{pct(ms, 99):>10.2f}")


if __name__ == "__main__":
    main()

"""Wall-clock timing with the device synchronised, shared by bench/gpu_check.py's stages."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device: str, fn: Any, repeats: int) -> float:
    """Median ms of `repeats` calls after two warm-ups (the first compiles)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def iteration_ms(core: Any, device: str, repeats: int, warmup: int = 4) -> float:
    """Median wall ms of an engine core's step (its host work, its launch, reading the previous iteration's
    tokens), after `warmup` steps (the prefill, a bucket's eager first iteration that compiles, its capture)."""
    for _ in range(warmup):
        core.step()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        core.step()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None

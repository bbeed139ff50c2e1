"""The batched prefill + token-by-token decode that the LLM and TTS stages share.

All rows prefill in one forward; then every row still decoding feeds its next token in one forward
per step, until each row's `choose` says it is done. Each row's cache is extracted when it finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..engine.exported import Engine
from ..engine.kv_batch import KvBatch, KvCache, right_pad

# choose(row, outputs of that row) -> the token to feed next, or None when the row is done
Choose = Callable[[int, dict[str, np.ndarray]], "int | None"]
StepFeeds = Callable[[list[int], list[int]], dict[str, np.ndarray]]  # (rows, tokens) -> T=1 feeds


@dataclass
class DecodeTiming:
    prefill_ms: float
    decode_ms: float
    steps: int


def batched_decode(
    engine: Engine,
    caches: list[KvCache],
    prefill: list[dict[str, np.ndarray]],
    step_feeds: StepFeeds,
    choose: Choose,
    per_row_outputs: tuple[str, ...],
) -> tuple[list[KvCache], DecodeTiming]:
    t0 = time.perf_counter()
    new_len = np.array([len(next(iter(p.values()))) for p in prefill], np.int64)
    batch = KvBatch(caches)
    feeds = {name: right_pad([p[name] for p in prefill]) for name in prefill[0]}
    out = engine.run({**feeds, **batch.feeds(new_len)})
    batch.advance(out["present_key"], out["present_value"], new_len)
    prefill_ms = (time.perf_counter() - t0) * 1000

    finished: list[KvCache | None] = [None] * len(caches)
    rows = list(range(len(caches)))  # batch position -> original row
    tokens: dict[int, int] = {}

    def choose_all(outputs: dict[str, np.ndarray], positions: list[int]) -> None:
        for pos, row in enumerate(positions):
            nxt = choose(row, {name: outputs[name][pos] for name in per_row_outputs})
            if nxt is None:
                finished[row] = batch.extract(pos)
            else:
                tokens[row] = nxt

    choose_all(out, rows)
    steps = 0
    while tokens:
        keep = [pos for pos, row in enumerate(rows) if row in tokens]
        if len(keep) != len(rows):
            batch.select(keep)
            rows = [rows[pos] for pos in keep]
        ones = np.ones(len(rows), np.int64)
        step_tokens = [tokens.pop(row) for row in rows]
        out = engine.run({**step_feeds(rows, step_tokens), **batch.feeds(ones)})
        batch.advance(out["present_key"], out["present_value"], ones)
        choose_all(out, rows)
        steps += 1
    timing = DecodeTiming(prefill_ms, (time.perf_counter() - t0) * 1000 - prefill_ms, steps)
    assert all(c is not None for c in finished), "every row ends with its cache extracted"
    return finished, timing  # type: ignore[return-value]

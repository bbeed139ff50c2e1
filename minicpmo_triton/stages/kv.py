"""One KV interface for a decoder stage (the LLM's, the TTS's): where each session's cache lives and how a batch
of rows is run over them, so the stage keeps only its per-session rules.

Two implementations: `HostKv` here (numpy, no torch: the cache is host arrays fed to the exported graph each call
and given back grown, each token chosen on the host from the logits), and `stages.pool_kv.PoolKv` (the cache in a
pool on the device, each token chosen there by the engine core). A row brings its cache, its prefill and, when it
decodes, its rules (`RowRules`), which serve both: `choose` picks from host logits, `row` / `confirm` / `done` drive
the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..engine.exported import Engine
from ..engine.kv_batch import KvBatch, KvCache
from ..rules.duplex_window import drop_tokens
from .decode_loop import batched_decode


class RowRules(Protocol):
    """A decoding row's rules on either path (`HostKv.run` calls `choose`; the engine core `row`, `confirm`,
    `done`, `n_hidden`)."""

    def choose(self, out: dict[str, np.ndarray]) -> int | None: ...

    @property
    def decodes(self) -> bool: ...  # False: a prefill only (the host path still reads its outputs once)

    @property
    def row(self) -> Any: ...

    @property
    def n_hidden(self) -> int: ...

    @property
    def hidden_on_device(self) -> bool: ...

    def confirm(self, token: int, flags: int) -> bool: ...

    def done(self) -> None: ...

    def take_hidden(self, hidden: np.ndarray | None) -> None:
        """The device path's kept hidden rows, handed over when the row is done."""
        ...


@dataclass
class KvRow:
    """One row of a batch: its session (the one-step-per-session key), its cache, its prefill (the stage's
    `Prefill` / `TtsFeed`), its rules (None: a prefill only)."""

    session: object
    cache: Any
    prefill: Any
    rules: RowRules | None


class StageKv(Protocol):
    name: str

    def open(self, admit_tokens: int) -> Any: ...

    def free(self, cache: Any) -> None: ...

    def reserve(self, cache: Any, tokens: int) -> None: ...

    def release(self, cache: Any) -> Any:
        """An empty cache in the session's place (a turn's end: a pool keeps only the admission room)."""
        ...

    def feed(self, cache: Any, prefill: Any) -> Any: ...

    def slide(self, cache: Any, keep: int, drop: int, theta: float, insert: Any) -> Any: ...

    def sweep(self, held: list[Any]) -> None: ...

    def run(self, rows: list[KvRow]) -> list[tuple[Any, float, float]]:
        """Every row to its end: its new cache, its prefill's ms and its decode's ms."""
        ...


class HostKv:
    """Host arrays through the exported graph: the cache in with every call, grown out (`batched_decode`). `feeds`
    turns the stage's prefills into the graph's inputs; `step_feeds` a decode step's tokens; `outputs` the
    per-row outputs a row's `choose` reads."""

    name = "onnx"

    def __init__(self, engine: Engine, empty: Callable[[], KvCache],
                 feeds: Callable[[list[Any]], list[dict[str, np.ndarray]]],
                 step_feeds: Callable[[list[int], list[int]], dict[str, np.ndarray]],
                 outputs: tuple[str, ...]) -> None:
        self.engine, self.empty, self.feeds, self.step_feeds, self.outputs = engine, empty, feeds, step_feeds, outputs

    def open(self, admit_tokens: int) -> KvCache:
        return self.empty()

    def free(self, cache: KvCache) -> None:
        """Host arrays: nothing held outside the session."""

    def reserve(self, cache: KvCache, tokens: int) -> None:
        """A host cache grows as it must."""

    def release(self, cache: KvCache) -> KvCache:
        return self.empty()

    def sweep(self, held: list[Any]) -> None:
        """Nothing outside the sessions."""

    def feed(self, cache: KvCache, prefill: Any) -> KvCache:
        """Tokens into one session's cache, alone (no decode)."""
        if not len(prefill):
            return cache
        batch = KvBatch([cache])
        [feeds] = self.feeds([prefill])
        n = np.array([len(next(iter(feeds.values())))], np.int64)
        out = self.engine.run({k: v[None] for k, v in feeds.items()} | batch.feeds(n))
        batch.advance(out["present_key"], out["present_value"], n)
        return batch.extract(0)

    def slide(self, cache: KvCache, keep: int, drop: int, theta: float, insert: Any) -> KvCache:
        """The window's slide: [keep, keep + drop) cut, `insert` (a prefill of len(insert) tokens) fed at `keep`
        over the kept head, the rest moved up after it with its keys re-rotated (`duplex_window.drop_tokens`)."""
        k, v = cache.key, cache.value
        head = KvCache(k[:, :, :keep], v[:, :, :keep])
        tail = KvCache(drop_tokens(k, keep, drop, theta, len(insert)), v[:, :, keep + drop:])
        if len(insert):
            head = self.feed(head, insert)
        return KvCache(np.concatenate([head.key, tail.key], axis=2), np.concatenate([head.value, tail.value], axis=2))

    def run(self, rows: list[KvRow]) -> list[tuple[KvCache, float, float]]:
        rules = [r.rules for r in rows]

        def choose(row: int, out: dict[str, np.ndarray]) -> int | None:
            r = rules[row]
            return None if r is None else r.choose(out)

        caches, timing = batched_decode(self.engine, [r.cache for r in rows], self.feeds([r.prefill for r in rows]),
                                        self.step_feeds, choose, self.outputs)
        return [(c, timing.prefill_ms, timing.decode_ms) for c in caches]

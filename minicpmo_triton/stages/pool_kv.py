"""`stages.kv.StageKv` over the engine core: each session's cache a place in the core's pool (`PagedCache`), a batch of
rows run as the core's requests, each token chosen on the device under the row's rules."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..engine.build import BATCH_ROWS, llm_core, load_weights, tts_core
from ..engine.core import EngineCore
from ..engine.pool import KvPool
from ..engine.protocol import PagedCache
from ..engine.request import Request
from ..model_config import PresetConfig

if TYPE_CHECKING:
    from ..media.tokenizer import Tokenizer


class PoolKv:
    name = "paged"

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    @property
    def pool(self) -> KvPool:
        return self.core.runner.pool

    def open(self, admit_tokens: int) -> PagedCache:
        return PagedCache(self.pool.open(admit_tokens), 0)

    def free(self, cache: PagedCache) -> None:
        self.pool.free(cache.seq)

    def reserve(self, cache: PagedCache, tokens: int) -> None:
        self.pool.reserve(cache.seq, tokens)

    def release(self, cache: PagedCache) -> PagedCache:
        """A turn's end: the pool keeps the session's admission room, the rest goes back."""
        self.pool.truncate(cache.seq, 0)
        return cache.truncated(0)

    def sweep(self, held: list[Any]) -> None:
        """Entries no session holds (a slide's old one, one an undo dropped) go back; only with nothing in flight."""
        seqs = {c.seq for c in held if isinstance(c, PagedCache)}
        for seq in [q for q in self.pool.tables if q not in seqs]:
            self.pool.free(seq)

    def feed(self, cache: PagedCache, prefill: Any) -> PagedCache:
        """Tokens into one session's cache now, alone (no decode): the core's running rows are not stepped."""
        if not len(prefill):
            return cache
        self.core.runner.feed(cache.seq, cache.length, prefill)
        return PagedCache(cache.seq, cache.length + len(prefill))

    def slide(self, cache: PagedCache, keep: int, drop: int, theta: float, insert: Any) -> PagedCache:
        """The window's slide into a new pool entry (a copy: a step that fails after it is undone by keeping the
        old one), `insert` fed at `keep` between the kept head and the re-rotated rest."""
        seq = self.pool.slid_copy(cache.seq, keep, drop, cache.length, theta, len(insert))
        if len(insert):
            self.feed(PagedCache(seq, keep), insert)
        return PagedCache(seq, cache.length - drop + len(insert))

    def request(self, session: object, cache: PagedCache, prefill: Any, rules: Any) -> Request:
        """A row as the core's request. Its room is reserved here too (a no-op when the stage's check reserved it;
        not when a window slide moved the session to a new entry since): the device reads its table as it is."""
        decodes = rules is not None and rules.decodes
        decided = rules.row.max_new if decodes and hasattr(rules.row, "max_new") else \
            rules.row.n_tokens + 1 if decodes else 0
        self.pool.reserve(cache.seq, cache.length + len(prefill) + decided)
        return Request(session, cache.seq, cache.length, prefill, rules if decodes else None)

    def settle(self, req: Request) -> PagedCache:
        """A finished request's cache: its pool entry cut to its length, its rules given its hidden rows."""
        self.pool.truncate(req.seq, req.length)
        if req.rules is not None:
            req.rules.take_hidden(req.hidden)
        return PagedCache(req.seq, req.length)

    def run(self, rows: list[Any]) -> list[tuple[PagedCache, float, float]]:
        """Every row to its end; a row's own failure fails the batch (its caller runs each row alone then, so the
        others get their results and that row its error)."""
        requests = [self.request(object(), r.cache, r.prefill, r.rules) for r in rows]
        try:
            self.core.run(requests)
        except Exception:
            self.core.abort()
            raise
        for req in requests:
            if req.error is not None:
                raise req.error
        return [(self.settle(req), *timing(req)) for req in requests]


def timing(req: Request) -> tuple[float, float]:
    """A request's prefill ms (queued to its first results read) and decode ms (from there to its end)."""
    first = req.t_first or req.t_done
    return (first - req.t_admitted) * 1000, (req.t_done - first) * 1000


def llm_kv(weights: dict[str, torch.Tensor], preset: PresetConfig, tokenizer: Tokenizer, *, rows: int = BATCH_ROWS,
           overlap: bool = True, graphs: bool | None = None, **build: Any) -> PoolKv:
    """The LLM stage's device KV: its core over `weights` with the stage's rule masks; `build`:
    `build.build_decoder`'s settings (pool size, dtypes, attention)."""
    from .llm import rule_masks

    dx = preset.duplex
    core = llm_core(weights, preset.llm, preset.tokens, rule_masks(preset, tokenizer), window=dx.repetition_window,
                    top_k=dx.top_k, rows=rows, overlap=overlap, graphs=graphs,
                    **{"max_tokens": dx.context_tokens, **build})
    return PoolKv(core)


def tts_kv(weights: dict[str, torch.Tensor], preset: PresetConfig, *, rows: int = BATCH_ROWS, overlap: bool = True,
           graphs: bool | None = None, **build: Any) -> PoolKv:
    """The TTS stage's device KV: its core over `weights` with the preset's TTS rules."""
    from .tts import tts_rules

    return PoolKv(tts_core(weights, preset.tts, tts_rules(preset), rows=rows, overlap=overlap, graphs=graphs,
                           **build))


def load_llm_kv(folder: Path, preset: PresetConfig, tokenizer: Tokenizer, device: str, **build: Any) -> PoolKv:
    """The LLM's device KV over the exported weights (`folder`/weights.safetensors) on `device`."""
    return llm_kv(load_weights(folder, device), preset, tokenizer, device=device, **build)


def load_tts_kv(folder: Path, preset: PresetConfig, device: str, **build: Any) -> PoolKv:
    """The TTS's device KV over the exported weights (`folder`/weights.safetensors) on `device`."""
    return tts_kv(load_weights(folder, device), preset, device=device, **build)

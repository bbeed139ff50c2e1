"""In-flight batching for the LLM stage on the paged engine (`inflight.InflightLoop`): a new session's prefill (a
few hundred prompt tokens) joins the running decode between two iterations, and each row is answered in the
iteration it finishes. What is the LLM's here: the admitted rows' audio is encoded in one batch, each row is
prepared by `LlmStage.prepare` (rollback, window slide, prefill ids) and answered with `LlmStage.result`; entries a
window slide left behind are given back when the loop is idle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..chat_rules import ChatDecoder
from ..duplex_rules import ChunkDecoder
from ..paged.protocol import Prefill, RowPick
from ..sampling import SamplingParams
from ..stage_io import LlmRequest, LlmResult
from .base import isolated
from .inflight import InflightLoop, Row
from .llm import LlmStage, PagedCache, _DeviceRows


@dataclass
class _LlmRow(Row):
    """What `LlmStage.compute` keeps per row."""

    prefill: dict[str, np.ndarray] = field(default_factory=dict)
    embeds: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    encode_ms: float = 0.0
    dec: ChunkDecoder | ChatDecoder | None = None
    params: SamplingParams | None = None

    @property
    def req(self) -> LlmRequest:
        return self.queued.call.request


class _LoopRows(_DeviceRows):
    """`_DeviceRows` over lists that grow as rows are admitted; a row whose host rules raise fails alone."""

    def __init__(self, loop: InflightLlm) -> None:
        super().__init__(loop.stage, [], [], [], [])
        self.loop = loop

    def add_row(self, row: _LlmRow) -> None:
        assert row.dec is not None and row.params is not None
        self.items.append((row.req, row.sess))
        self.decoders.append(row.dec)
        self.params.append(row.params)
        self.hidden_of.append([])

    def wants_hidden(self, row: int) -> bool:
        r = self.loop.rows[row]
        if not r.t_first:
            r.t_first = time.perf_counter()  # asked right after each forward: this row's first one is done
        return row not in self.loop.failed and self.loop.guard(row, super().wants_hidden, False)

    def pick(self, row: int) -> RowPick | None:
        return None if row in self.loop.failed else self.loop.guard(row, super().pick, None)

    def accept(self, row: int, token: int, drew_second: bool) -> int | None:
        return self.loop.guard(row, lambda r: super(_LoopRows, self).accept(r, token, drew_second), None)


class InflightLlm(InflightLoop[_LlmRow, LlmStage, "_LoopRows"]):
    """The engine thread of one `llm` model instance on the paged engine."""

    thread_name = "llm-engine"
    driver_cls = _LoopRows
    row_cls = _LlmRow

    def _after_run(self) -> None:
        self.stage.sweep_pool()  # nothing in flight now: entries a slide left behind are given back

    def _join(self, rows: list[_LlmRow]) -> list[tuple[_LlmRow, Any]]:
        joined = []
        for row in self._encode(rows):
            try:
                row.prefill, row.dec, row.params = self.stage.prepare(row.req, row.sess, row.embeds)
            except Exception as exc:  # noqa: BLE001 (a bad rollback point, say: this call fails alone)
                self._undo(row)
                self._answer(row.queued, exc)
                continue
            joined.append((row, Prefill(row.prefill["input_ids"], row.embeds, row.prefill["use_embeds"])))
        return joined

    def _encode(self, rows: list[_LlmRow]) -> list[_LlmRow]:
        """The admitted rows' audio through the encoder, in one batch (each alone where the batch fails)."""
        def encode(batch: list[_LlmRow]) -> list[tuple[np.ndarray, float]]:
            embeds, ms = self.stage.encode([(r.req, r.sess) for r in batch])
            return [(e, ms) for e in embeds]

        kept = []
        for row, out in zip(rows, isolated(encode, rows, lambda i: self._undo(rows[i])), strict=True):
            if isinstance(out, Exception):
                self._answer(row.queued, out)
            else:
                row.embeds, row.encode_ms = out
                kept.append(row)
        return kept

    def _result(self, index: int, cache: PagedCache) -> LlmResult:
        row, d = self.rows[index], self._driver
        now = time.perf_counter()
        first = row.t_first or now
        return self.stage.result(row.req, row.sess, d.decoders[index], cache, d.hidden_of[index],
                                 len(row.prefill["input_ids"]), (first - row.t_admitted) * 1000,
                                 (now - first) * 1000, row.encode_ms, join_iteration=row.join_iteration,
                                 done_iteration=self.engine.iterations)

    def _release(self, index: int) -> None:
        super()._release(index)
        row = self.rows[index]
        row.prefill, row.embeds, row.dec = {}, row.embeds[:0], None
        self._driver.hidden_of[index] = []

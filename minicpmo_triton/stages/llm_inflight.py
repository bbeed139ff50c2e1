"""In-flight batching for the LLM stage on the device engine (`inflight.InflightLoop`): a new session's prefill (a
few hundred prompt tokens) joins the running decode between two iterations, and each row is answered in the
iteration it finishes. What is the LLM's here: the entered rows' audio is encoded in one batch on the preparation
thread (`_work`: the mel and the streaming Whisper, on the encoder's own CUDA stream on a GPU; the embeddings stay
on the device and are spliced into the LLM's input after the engine's stream waited for them), each row is then
prepared on the engine thread by `LlmStage.prepare` (rollback, window slide, prefill ids, its rules: the LLM's pool)
and answered with `LlmStage.result`; pool entries a window slide left behind are given back when the loop is idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.lane import Handoff
from ..engine.protocol import PagedCache
from ..stage_io import LlmRequest, LlmResult
from .base import isolated
from .inflight import InflightLoop, Row
from .llm import LlmStage


@dataclass
class _LlmRow(Row):
    embeds: Any = None
    encode_ms: float = 0.0
    handoff: Handoff | None = None  # the encoder's lane's work, waited for before the row's first iteration

    @property
    def req(self) -> LlmRequest:
        return self.queued.call.request


class InflightLlm(InflightLoop[_LlmRow, LlmStage]):
    """The engine thread of one `llm` model instance on the device engine."""

    thread_name = "llm-engine"
    row_cls = _LlmRow
    heavy_work = True

    def _after_run(self) -> None:
        self.stage.sweep_pool()  # nothing in flight now: entries a slide left behind are given back

    def _work(self, rows: list[_LlmRow]) -> list[Exception | None]:
        """The entered rows' audio through the encoder, in one batch (each alone where the batch fails)."""
        def encode(batch: list[_LlmRow]) -> list[tuple[Any, float, Handoff]]:
            embeds, ms, handoff = self.stage.launch_encode([(r.req, r.sess) for r in batch])
            return [(e, ms, handoff) for e in embeds]

        errors: list[Exception | None] = []
        for row, out in zip(rows, isolated(encode, rows, lambda i: self._undo(rows[i])), strict=True):
            if isinstance(out, Exception):
                errors.append(out)
            else:
                row.embeds, row.encode_ms, row.handoff = out
                errors.append(None)
        return errors

    def _prepare(self, rows: list[_LlmRow]) -> list[_LlmRow]:
        prepared = []
        for row in rows:
            if row.handoff is not None:
                row.handoff.wait()  # the engine's stream waits for the encoder's: before the row's first iteration
            try:
                row.prefill, row.rules = self.stage.prepare(row.req, row.sess, row.embeds)
            except Exception as exc:  # noqa: BLE001 (a bad rollback point, say: this call fails alone)
                self._undo(row)
                self._answer(row.queued, exc)
                continue
            prepared.append(row)
        return prepared

    def _result(self, row: _LlmRow, cache: PagedCache, prefill_ms: float, decode_ms: float, join: int,
                done: int) -> LlmResult:
        return self.stage.result(row.rules, cache, len(row.prefill), prefill_ms, decode_ms, row.encode_ms,
                                 join_iteration=join, done_iteration=done)

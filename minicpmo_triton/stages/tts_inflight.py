"""In-flight batching for the TTS stage on the device engine (`inflight.InflightLoop`): a session's chunk joins the
running decode between two iterations (its condition packed beside the others' one-code steps) and is answered in
the iteration its last code is chosen, so a chunk of 3 codes never waits for one of 25, and a new chunk never waits
for a batch to drain. A chunk is opened by `TtsStage.begin` (a turn's reset, its condition and its rules) and closed
by `TtsStage.finish` (its cache dropped at a turn's end), as the stage's synchronous `compute` does."""

from __future__ import annotations

from ..engine.protocol import PagedCache
from ..stage_io import TtsResult
from .inflight import InflightLoop, Row
from .tts import TtsStage


class InflightTts(InflightLoop[Row, TtsStage]):
    """The engine thread of one `tts` model instance on the device engine."""

    thread_name = "tts-engine"

    def _prepare(self, rows: list[Row]) -> list[Row]:
        prepared = []
        for row in rows:
            try:
                row.prefill, row.rules = self.stage.begin(row.req, row.sess)
            except Exception as exc:  # noqa: BLE001 (this call fails alone)
                self._undo(row)
                self._answer(row.queued, exc)
                continue
            prepared.append(row)
        return prepared

    def _result(self, row: Row, cache: PagedCache, prefill_ms: float, decode_ms: float, join: int,
                done: int) -> TtsResult:
        return self.stage.finish(row.rules, cache)

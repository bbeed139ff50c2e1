"""In-flight batching for the TTS stage on the paged TTS engine (`inflight.InflightLoop`): a session's chunk joins
the running decode between two iterations (its condition packed beside the others' one-code steps) and is
answered in the iteration its last code is chosen, so a chunk of 3 codes never waits for one of 25, and a new
chunk never waits for a batch to drain. A chunk is opened by `TtsStage.begin` (a turn's reset) and closed by
`TtsStage.finish` (its cache dropped at a turn's end), as the stage's synchronous `compute` does; the codes are
chosen on the device by the stage's rules (`TtsRows`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..paged.protocol import TtsPick
from ..stage_io import TtsRequest, TtsResult
from .inflight import InflightLoop, Row
from .llm import PagedCache
from .tts import TtsRows, TtsStage


@dataclass
class _TtsRow(Row):
    opened: bool = False  # the chunk opened its turn (the cache was reset)

    @property
    def req(self) -> TtsRequest:
        return self.queued.call.request


class _LoopTtsRows(TtsRows):
    """`TtsRows` over lists that grow as rows are admitted; a row whose rules raise fails alone."""

    def __init__(self, loop: InflightTts) -> None:
        super().__init__(loop.stage)
        self.loop = loop

    def add_row(self, row: _TtsRow) -> None:
        self.add(row.req, row.sess, row.opened)

    def pick(self, row: int) -> TtsPick | None:  # type: ignore[override]
        return None if row in self.loop.failed else self.loop.guard(row, super().pick, None)

    def accept(self, row: int, code: int) -> int | None:
        return self.loop.guard(row, lambda r: super(_LoopTtsRows, self).accept(r, code), None)


class InflightTts(InflightLoop[_TtsRow, TtsStage, "_LoopTtsRows"]):
    """The engine thread of one `tts` model instance on the paged TTS engine."""

    thread_name = "tts-engine"
    driver_cls = _LoopTtsRows
    row_cls = _TtsRow

    def _join(self, rows: list[_TtsRow]) -> list[tuple[_TtsRow, Any]]:
        joined = []
        for row in rows:
            try:
                row.opened, prefill = self.stage.begin(row.req, row.sess)
            except Exception as exc:  # noqa: BLE001 (this call fails alone)
                self._undo(row)
                self._answer(row.queued, exc)
                continue
            joined.append((row, self.stage.feeds([prefill])[0]))
        return joined

    def _result(self, index: int, cache: PagedCache) -> TtsResult:
        row = self.rows[index]
        return self.stage.finish(row.req, row.sess, cache, self._driver.codes[index])

    def _release(self, index: int) -> None:
        super()._release(index)
        self._driver.codes[index] = []

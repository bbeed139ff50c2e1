"""In-flight batching for the LLM stage on the paged engine: one engine thread runs the decode loop; requests join it.

`submit` only queues a call with the function that answers it. The engine thread takes the queue between two
iterations of `PagedLlmEngine.run` (its `admit` hook): a new row's prefill is packed beside the running rows'
one-token steps, so a session that starts (a few hundred prompt tokens) costs the others one longer iteration,
not a wait for its own turn. A row is answered in the iteration it finishes (`run`'s `done` hook), never held
for the longest row of its batch.

Where things happen (all on the engine thread, so the stage's store and the KV pool have one user):
- START creates the session's state when its call is admitted; END releases it in `_answer`, the one place
  a call is answered, after its row is done (or failed, or had no work).
- A row whose preparation or host rules raise is undone and answered with its error alone; the other rows
  go on. A failure of the whole forward (no row to blame) undoes the unfinished rows and runs each alone,
  as `isolated` does for the stage's synchronous path.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..chat_rules import ChatDecoder
from ..duplex_rules import ChunkDecoder
from ..paged.protocol import Prefill, RowPick
from ..sampling import SamplingParams
from ..stage_io import LlmRequest, LlmResult
from .base import StageCall, _restore, _snapshot, isolated
from .llm import LlmSession, LlmStage, PagedCache, _DeviceRows

Reply = Callable[[LlmResult | Exception], None]
# Rows one run of the engine loop numbers before it stops admitting and drains: its per-row lists (the engine's,
# the driver's) grow with every call while it runs, and under steady traffic it would never end on its own.
ROWS_PER_RUN = 4096


@dataclass
class _Queued:
    call: StageCall[LlmRequest]
    reply: Reply


@dataclass
class _Row:
    """One admitted call in the loop: what `LlmStage.compute` keeps per row, plus its answer and its undo."""

    queued: _Queued
    sess: LlmSession
    before: dict[str, Any]  # the session as it was before this call (`base._snapshot`)
    prefill: dict[str, np.ndarray] = field(default_factory=dict)
    embeds: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    encode_ms: float = 0.0
    join_iteration: int = 0
    t_admitted: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0  # its first forward done (its prefill)

    @property
    def req(self) -> LlmRequest:
        return self.queued.call.request


class _LoopRows(_DeviceRows):
    """`_DeviceRows` over lists that grow as rows are admitted; a row whose host rules raise fails alone."""

    def __init__(self, loop: InflightLlm) -> None:
        super().__init__(loop.stage, [], [], [], [])
        self.loop = loop

    def add(self, row: _Row, dec: ChunkDecoder | ChatDecoder, params: SamplingParams) -> None:
        self.items.append((row.req, row.sess))
        self.decoders.append(dec)
        self.params.append(params)
        self.hidden_of.append([])

    def wants_hidden(self, row: int) -> bool:
        r = self.loop.rows[row]
        if not r.t_first:
            r.t_first = time.perf_counter()  # asked right after each forward: this row's first one is done
        return row not in self.loop.failed and self._guard(row, super().wants_hidden, False)

    def pick(self, row: int) -> RowPick | None:
        return None if row in self.loop.failed else self._guard(row, super().pick, None)

    def accept(self, row: int, token: int, drew_second: bool) -> int | None:
        return self._guard(row, lambda r: super(_LoopRows, self).accept(r, token, drew_second), None)

    def _guard(self, row: int, step: Callable[[int], Any], failed: Any) -> Any:
        try:
            return step(row)
        except Exception as exc:  # noqa: BLE001 (this row's rules broke: it fails alone, the loop goes on)
            self.loop.fail(row, exc)
            return failed


class InflightLlm:
    """The engine thread of one `llm` model instance on the paged engine."""

    def __init__(self, stage: LlmStage, sweep_period_s: float, on_change: Callable[[], None] = lambda: None) -> None:
        assert stage.paged is not None, "in-flight batching runs the paged engine"
        self.stage, self.engine = stage, stage.paged
        self.sweep_period_s = sweep_period_s
        self.on_change = on_change  # the live-sequence gauge: called after the store changed
        self._queue: deque[_Queued] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.rows: list[_Row] = []  # this run's rows, numbered as the engine numbers them
        self.failed: set[int] = set()
        self._open: set[int] = set()  # rows neither answered nor failed
        self._driver = _LoopRows(self)
        self._thread = threading.Thread(target=self._serve, name="llm-engine", daemon=True)
        self._thread.start()

    def submit(self, call: StageCall[LlmRequest], reply: Reply) -> None:
        with self._cv:
            self._queue.append(_Queued(call, reply))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    # ---- the engine thread ----
    def _serve(self) -> None:
        while True:
            with self._cv:
                if not self._queue and not self._stop:
                    self._cv.wait(self.sweep_period_s)
                if self._stop:
                    return
            try:
                if self.stage.store.evict_expired():  # here, not on a timer thread: the pool has one user
                    self.on_change()
                self._run()
            except Exception as exc:  # noqa: BLE001 (a bug in the loop itself: its callers are told, it serves on)
                for index in sorted(self._open):
                    self._open.discard(index)
                    self._answer(self.rows[index].queued, exc)

    def _run(self) -> None:
        self.rows, self.failed, self._open = [], set(), set()
        self._driver = _LoopRows(self)
        first = self._admit()
        if first:
            try:
                self.engine.run([s for s, _, _ in first], [n for _, n, _ in first], [p for _, _, p in first],
                                self._driver, admit=self._admit, done=self._done)
            except Exception:  # noqa: BLE001 (the batch's forward failed: each unfinished row is run alone)
                self._run_alone(sorted(self._open))
        self.stage.sweep_pool()  # nothing in flight now: entries a slide left behind are given back

    def _admit(self) -> list[tuple[int, int, Prefill]]:
        """The queued calls that can join now: their state found or created, checked, prepared, as the engine's
        new rows (session, its length, its prefill). Calls with nothing to decode are answered at once."""
        if len(self.rows) >= ROWS_PER_RUN:
            return []  # this run drains (a few dozen iterations) and the next one starts with fresh row lists
        with self._cv:
            # a session's next call waits for its row in flight, or for the one queued before it (a client may
            # send it before the answer)
            busy = {self.rows[r].queued.call.corr_id for r in self._open}
            ready: list[_Queued] = []
            held: deque[_Queued] = deque()
            for q in self._queue:
                (held if q.call.corr_id in busy else ready).append(q)
                busy.add(q.call.corr_id)
            self._queue = held
        rows: list[_Row] = []
        for q in ready:
            row = self._enter(q)
            if row is not None:
                rows.append(row)
        rows = self._encode(rows)
        new: list[tuple[int, int, Prefill]] = []
        iteration = self.engine.iterations
        for row in rows:
            try:
                pre, dec, params = self.stage.prepare(row.req, row.sess, row.embeds)
            except Exception as exc:  # noqa: BLE001 (a bad rollback point, say: this call fails alone)
                self._undo(row)
                self._answer(row.queued, exc)
                continue
            row.prefill, row.join_iteration = pre, iteration
            index = len(self.rows)
            self.rows.append(row)
            self._open.add(index)
            self._driver.add(row, dec, params)
            assert isinstance(row.sess.cache, PagedCache)
            new.append((row.sess.cache.seq, row.sess.cache.length,
                        Prefill(pre["input_ids"], row.embeds, pre["use_embeds"])))
        if ready:
            self.on_change()
        return new

    def _enter(self, q: _Queued) -> _Row | None:
        """`SequenceStage.enter`: the state found or created, the call checked; no-ops and refusals answered here."""
        try:
            state = self.stage.enter(q.call)
        except Exception as exc:  # noqa: BLE001 (one bad call must not fail the others)
            self._answer(q, exc)
            return None
        if state is None:
            self._answer(q, self.stage.empty_result())
            return None
        return _Row(q, state, _snapshot(state))

    def _encode(self, rows: list[_Row]) -> list[_Row]:
        """The admitted rows' audio through the encoder, in one batch (each alone where the batch fails)."""
        def encode(batch: list[_Row]) -> list[tuple[np.ndarray, float]]:
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

    def _done(self, index: int, length: int) -> None:
        """The engine's `done`: the row's answer, sent now."""
        if index not in self._open:
            return  # failed earlier: already answered
        row, d = self.rows[index], self._driver
        assert isinstance(row.sess.cache, PagedCache) and self.engine is not None
        seq = row.sess.cache.seq
        self.engine.pool.truncate(seq, length)
        now = time.perf_counter()
        first = row.t_first or now
        result = self.stage.result(row.req, row.sess, d.decoders[index], PagedCache(seq, length), d.hidden_of[index],
                                   len(row.prefill["input_ids"]), (first - row.t_admitted) * 1000,
                                   (now - first) * 1000, row.encode_ms, join_iteration=row.join_iteration,
                                   done_iteration=self.engine.iterations)
        self._open.discard(index)
        self._release(index)
        self._answer(row.queued, result)

    def fail(self, index: int, exc: Exception) -> None:
        """A row's host rules raised: it is undone and answered with its error; it feeds nothing more."""
        if index in self._open:
            self._open.discard(index)
            self.failed.add(index)
            self._undo(self.rows[index])
            self._release(index)
            self._answer(self.rows[index].queued, exc)

    def _run_alone(self, indices: list[int]) -> None:
        for index in indices:
            row = self.rows[index]
            self._open.discard(index)
            self._undo(row)
            out = isolated(self.stage.compute, [(row.req, row.sess)], lambda _, r=row: self._undo(r))[0]  # type: ignore[misc]
            self._answer(row.queued, out)

    @staticmethod
    def _undo(row: _Row) -> None:
        _restore(row.sess, row.before)

    def _release(self, index: int) -> None:
        """A finished row's arrays let go (its number stays, as the engine's lists keep it until the run ends)."""
        row = self.rows[index]
        row.prefill, row.before, row.embeds = {}, {}, row.embeds[:0]
        self._driver.hidden_of[index] = []

    def _answer(self, q: _Queued, result: LlmResult | Exception) -> None:
        """The one place a call is answered, and so the one place END releases its session (state, pool blocks)."""
        if q.call.end:
            self.stage.store.end(q.call.corr_id)
            self.on_change()
        q.reply(result)

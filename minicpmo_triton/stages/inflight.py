"""In-flight batching for a stage on a paged engine (the LLM's, the TTS's): one engine thread runs the engine's
decode loop (`paged.loop.DecodeLoop.run`); requests join it between iterations.

`submit` only queues a call with the function that answers it. The engine thread takes the queue between two
iterations (the loop's `admit` hook): a new row's prefill is packed beside the running rows' one-token steps, so a
session that starts costs the others one longer iteration, not a wait for its own turn. A row is answered in the
iteration it finishes (the loop's `done` hook), never held for the longest row of its batch.

Where things happen (all on the engine thread, so the stage's store and the KV pool have one user):
- START creates the session's state when its call is admitted; END releases it in `_answer`, the one place
  a call is answered, after its row is done (or failed, or had no work): its pool blocks go back there.
- A row whose preparation or host rules raise is undone and answered with its error alone; the other rows
  go on. A failure of the whole forward (no row to blame) undoes the unfinished rows and runs each alone,
  as `isolated` does for the stage's synchronous path.

A stage's loop (`InflightLlm`, `InflightTts`) gives its driver (the stage's rules per row, `guard`ed), how admitted
rows are prepared (`_join`) and how a finished row's result is built (`_result`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from .base import SequenceStage, StageCall, _restore, _snapshot, isolated
from .llm import PagedCache

Reply = Callable[[Any], None]
# Rows one run of the engine loop numbers before it stops admitting and drains: its per-row lists (the engine's,
# the driver's) grow with every call while it runs, and under steady traffic it would never end on its own.
ROWS_PER_RUN = 4096


@dataclass
class Queued:
    call: StageCall[Any]
    reply: Reply


@dataclass
class Row:
    """One admitted call in the loop; a stage's loop keeps what else it needs in a subclass."""

    queued: Queued
    sess: Any
    before: dict[str, Any]  # the session as it was before this call (`base._snapshot`)
    join_iteration: int = 0
    t_admitted: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0  # its first forward done (its prefill)

    @property
    def req(self) -> Any:
        return self.queued.call.request


class Engine(Protocol):
    iterations: int
    pool: Any

    def run(self, seqs: list[int], pasts: list[int], feeds: list[Any], driver: Any, admit: Any = None,
            done: Any = None) -> Any: ...


class LoopDriver(Protocol):
    def add_row(self, row: Any) -> None: ...


RowT = TypeVar("RowT", bound=Row)
StageT = TypeVar("StageT", bound=SequenceStage[Any, Any, Any])
DriverT = TypeVar("DriverT", bound=LoopDriver)


class InflightLoop(Generic[RowT, StageT, DriverT]):
    """The engine thread of one stateful model instance on a paged engine."""

    thread_name = "engine"
    row_cls: type[Row] = Row
    driver_cls: Callable[[Any], DriverT]
    rows_per_run = ROWS_PER_RUN

    def __init__(self, stage: StageT, sweep_period_s: float,
                 on_change: Callable[[], None] = lambda: None) -> None:
        engine: Engine | None = getattr(stage, "paged", None)
        assert engine is not None, "in-flight batching runs the stage's paged engine"
        self.stage: StageT = stage
        self.engine = engine
        self.sweep_period_s = sweep_period_s
        self.on_change = on_change  # the live-sequence gauge: called after the store changed
        self._queue: deque[Queued] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.rows: list[RowT] = []  # this run's rows, numbered as the engine numbers them
        self.failed: set[int] = set()
        self._open: set[int] = set()  # rows neither answered nor failed
        self._driver: DriverT = self.driver_cls(self)
        self._thread = threading.Thread(target=self._serve, name=self.thread_name, daemon=True)
        self._thread.start()

    # ---- a stage's loop gives these (and its `driver_cls`, `row_cls`) ----
    def _join(self, rows: list[RowT]) -> list[tuple[RowT, Any]]:
        """The admitted rows prepared, with their feeds; a row that cannot be is undone and answered here."""
        raise NotImplementedError

    def _result(self, index: int, cache: PagedCache) -> Any:
        raise NotImplementedError

    def _after_run(self) -> None:
        """Nothing in flight now."""

    def _release(self, index: int) -> None:
        """A finished row's arrays let go (its number stays, as the engine's lists keep it until the run ends)."""
        self.rows[index].before = {}

    # ---- the public side ----
    def submit(self, call: StageCall[Any], reply: Reply) -> None:
        with self._cv:
            self._queue.append(Queued(call, reply))
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def guard(self, row: int, step: Callable[[int], Any], failed: Any) -> Any:
        """A driver's step for one row: if the stage's rules raise, that row fails alone and the loop goes on."""
        try:
            return step(row)
        except Exception as exc:  # noqa: BLE001 (this row's rules broke: it fails alone, the loop goes on)
            self.fail(row, exc)
            return failed

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
        self._driver = self.driver_cls(self)
        first = self._admit()
        if first:
            try:
                self.engine.run([s for s, _, _ in first], [n for _, n, _ in first], [p for _, _, p in first],
                                self._driver, admit=self._admit, done=self._done)
            except Exception:  # noqa: BLE001 (the batch's forward failed: each unfinished row is run alone)
                self._run_alone(sorted(self._open))
        self._after_run()

    def _admit(self) -> list[tuple[int, int, Any]]:
        """The queued calls that can join now: their state found or created, checked, prepared, as the engine's
        new rows (session, its length, its feed). Calls with nothing to decode are answered at once."""
        if len(self.rows) >= self.rows_per_run:
            return []  # this run drains (a few dozen iterations) and the next one starts with fresh row lists
        with self._cv:
            # a session's next call waits for its row in flight, or for the one queued before it (a client may
            # send it before the answer)
            busy = {self.rows[r].queued.call.corr_id for r in self._open}
            ready: list[Queued] = []
            held: deque[Queued] = deque()
            for q in self._queue:
                (held if q.call.corr_id in busy else ready).append(q)
                busy.add(q.call.corr_id)
            self._queue = held
        entered = [row for row in map(self._enter, ready) if row is not None]
        new: list[tuple[int, int, Any]] = []
        iteration = self.engine.iterations
        for row, feed in self._join(entered):
            row.join_iteration = iteration
            self._open.add(len(self.rows))
            self.rows.append(row)
            self._driver.add_row(row)
            assert isinstance(row.sess.cache, PagedCache)
            new.append((row.sess.cache.seq, row.sess.cache.length, feed))
        if ready:
            self.on_change()
        return new

    def _enter(self, q: Queued) -> RowT | None:
        """`SequenceStage.enter`: the state found or created, the call checked; no-ops and refusals answered here."""
        try:
            state = self.stage.enter(q.call)
        except Exception as exc:  # noqa: BLE001 (one bad call must not fail the others)
            self._answer(q, exc)
            return None
        if state is None:
            self._answer(q, self.stage.empty_result())
            return None
        return self.row_cls(q, state, _snapshot(state))  # type: ignore[return-value]

    def _done(self, index: int, length: int) -> None:
        """The engine's `done`: the row's answer, sent now."""
        if index not in self._open:
            return  # failed earlier: already answered
        row = self.rows[index]
        assert isinstance(row.sess.cache, PagedCache)
        seq = row.sess.cache.seq
        self.engine.pool.truncate(seq, length)
        result = self._result(index, PagedCache(seq, length))
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
    def _undo(row: Row) -> None:
        _restore(row.sess, row.before)

    def _answer(self, q: Queued, result: Any) -> None:
        """The one place a call is answered, and so the one place END releases its session (state, pool blocks)."""
        if q.call.end:
            self.stage.store.end(q.call.corr_id)
            self.on_change()
        q.reply(result)

"""In-flight batching for a stage on the device engine (the LLM's, the TTS's): one engine thread steps the stage's
engine core (`engine.core.EngineCore`); queued calls become its requests between two iterations.

`submit` only queues a call with the function that answers it. The engine thread takes the queue before each
iteration: a call whose session has no request in the core (nor a row in preparation) is entered (START creates the
session's state, `check` refuses a bad call or `pool_full` at once); a stage's heavy work for it (`_work`: the LLM's
mel and streaming Whisper) is done by the preparation thread (`preparer.Preparer`), off the engine thread, batched
across the rows entered together; back on the engine thread, between two iterations, the row is prepared by the
stage (its prefill and its rules) and added to the core, whose scheduler packs its prefill beside the running rows'
one-token steps; a session that starts costs the others one longer iteration, not a wait for its own turn nor for
its encoding. A request is answered in the iteration its row ends, never held for the longest row of its batch. A
session's next call waits until its previous one is answered (the stage prepares a call from the session's state as
the previous one left it).

Where things happen (on the engine thread, so the stage's store and the pool have one user; the preparation thread
holds a row, and of its session only what `_work` touches, from its entry to its hand back):
- START creates the session's state when its call is entered; END releases it in `_answer`, the one place a call
  is answered, after its request ended (or failed, or had no work): its pool blocks go back there.
- A request whose work, preparation or host rules raise is undone and answered with its error alone; the others
  go on.
  An iteration that raises (no row to blame) gives up every request taken in (`EngineCore.abort`): each is undone
  and run alone through the stage's synchronous path, as `isolated` does there.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..engine.protocol import PagedCache
from .base import SequenceStage, StageCall, _restore, _snapshot, isolated
from .preparer import Preparer, Served

Reply = Callable[[Any], None]


@dataclass
class Queued:
    call: StageCall[Any]
    reply: Reply


@dataclass
class Row:
    """One entered call; a stage's loop keeps what else it needs in a subclass."""

    queued: Queued
    sess: Any
    before: dict[str, Any]  # the session as it was before this call (`base._snapshot`)
    rules: Any = None
    prefill: Any = None
    t_entered: float = field(default_factory=time.perf_counter)

    @property
    def req(self) -> Any:
        return self.queued.call.request


RowT = TypeVar("RowT", bound=Row)
StageT = TypeVar("StageT", bound=SequenceStage[Any, Any, Any])


class InflightLoop(Served, Generic[RowT, StageT]):
    """The engine thread of one stateful model instance on the device engine."""

    thread_name = "engine"
    row_cls: type[Row] = Row
    heavy_work = False  # a stage's loop with heavy work for its entered rows (`_work`) sets it

    def __init__(self, stage: StageT, sweep_period_s: float, on_change: Callable[[], None] = lambda: None,
                 off_thread: bool = True) -> None:
        """`off_thread`: the rows' `_work` on the preparation thread (False: on the engine thread, between two
        iterations, as bench/engine_host.py's "before")."""
        self.kv: Any = stage.kv  # type: ignore[attr-defined]
        assert getattr(self.kv, "core", None) is not None, "in-flight batching runs the stage's engine core"
        self.stage: StageT = stage
        self.core = self.kv.core
        self.sweep_period_s = sweep_period_s
        self.on_change = on_change  # the live-sequence gauge: called after the store changed
        self._queue: deque[Queued] = deque()
        self._worked: list[tuple[RowT, Exception | None]] = []  # rows back from the preparation thread
        self._preparing: set[int] = set()  # sessions whose row the preparation thread holds (the engine's to change)
        self._preparer = Preparer(self._work, self._back, f"{self.thread_name}-prep") \
            if self.heavy_work and off_thread else None
        self._start(self.thread_name)

    # ---- a stage's loop gives these ----
    def _work(self, rows: list[RowT]) -> list[Exception | None]:
        """The entered rows' heavy work, off the engine thread (`heavy_work`): each row's error or None. A row that
        fails is undone by the engine thread and answered with its error."""
        return [None] * len(rows)

    def _prepare(self, rows: list[RowT]) -> list[RowT]:
        """The entered rows' prefills and rules (`row.prefill`, `row.rules`); a row that cannot be prepared is
        undone and answered here (and left out)."""
        raise NotImplementedError

    def _result(self, row: RowT, cache: PagedCache, prefill_ms: float, decode_ms: float, join: int, done: int) -> Any:
        raise NotImplementedError

    def _after_run(self) -> None:
        """Nothing in flight now."""

    # ---- the public side ----
    def submit(self, call: StageCall[Any], reply: Reply) -> None:
        self._wake(lambda: self._queue.append(Queued(call, reply)))

    def close(self) -> None:
        super().close()
        if self._preparer is not None:
            self._preparer.close()

    def _back(self, rows: list[tuple[RowT, Exception | None]]) -> None:
        """The preparation thread hands rows back; the engine thread takes them before its next iteration."""
        self._wake(lambda: self._worked.extend(rows))

    # ---- the engine thread ----
    def _serve(self) -> None:
        while True:
            with self._cv:
                admissible = any(q.call.corr_id not in self._preparing for q in self._queue)
                if not admissible and not self._worked and not self._stop and not self.core.has_work:
                    self._cv.wait(self.sweep_period_s)
                if self._stop:
                    return
            try:
                if not self.core.has_work and not self._preparing and self.stage.store.evict_expired():
                    self.on_change()  # here: the pool has one user, and no session is being prepared
                self._admit()
                self._step()
                if not self.core.has_work:
                    self._after_run()
            except Exception as exc:  # noqa: BLE001 (a bug in the loop itself: its callers are told, it serves on)
                for req in self.core.abort():
                    self._undo(req.tag)
                    self._answer(req.tag.queued, exc)

    def _step(self) -> None:
        try:
            ended = self.core.step()
        except Exception:  # noqa: BLE001 (an iteration failed with no row to blame: each row runs alone)
            self._run_alone([req.tag for req in self.core.abort()])
            return
        for req in ended:
            row = req.tag
            if req.error is not None:
                self._undo(row)
                self._answer(row.queued, req.error)
                continue
            prefill_ms = ((req.t_first or req.t_done) - row.t_entered) * 1000
            decode_ms = (req.t_done - (req.t_first or req.t_done)) * 1000
            result = self._result(row, self.kv.settle(req), prefill_ms, decode_ms, req.join_iteration,
                                  req.done_iteration)
            row.before = {}
            self._answer(row.queued, result)

    def _admit(self) -> None:
        """The queued calls that can join now are entered and given their work (on the preparation thread); the
        rows back from it are prepared and added to the core. Calls with nothing to decode are answered at once; a
        session's next call waits for its previous one's answer."""
        with self._cv:
            busy: set[int] = set(self._preparing)
            ready: list[Queued] = []
            held: deque[Queued] = deque()
            for q in self._queue:
                corr = q.call.corr_id
                (held if corr in busy or self.core.busy(corr) else ready).append(q)
                busy.add(corr)
            self._queue = held
            worked, self._worked = self._worked, []
        if not ready and not worked:
            return
        entered = [row for row in map(self._enter, ready) if row is not None]
        if self._preparer is None:
            worked += zip(entered, self._work(entered) if entered else [], strict=True)
        elif entered:
            self._preparing.update(row.queued.call.corr_id for row in entered)
            self._preparer.submit(entered)
        kept = []
        for row, error in worked:
            self._preparing.discard(row.queued.call.corr_id)
            if error is not None:
                self._undo(row)
                self._answer(row.queued, error)
            else:
                kept.append(row)
        for row in self._prepare(kept) if kept else []:
            try:  # its room again (a window slide may have moved the session to a new pool entry): pool_full alone
                req = self.kv.request(row.queued.call.corr_id, row.sess.cache, row.prefill, row.rules)
            except Exception as exc:  # noqa: BLE001 (this call fails alone)
                self._undo(row)
                self._answer(row.queued, exc)
                continue
            req.tag = row
            self.core.add(req)
        self.on_change()

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

    def _run_alone(self, rows: list[RowT]) -> None:
        for row in rows:
            self._undo(row)
            out = isolated(self.stage.compute, [(row.req, row.sess)], lambda _, r=row: self._undo(r))[0]  # type: ignore[misc]
            self._answer(row.queued, out)

    @staticmethod
    def _undo(row: Row) -> None:
        if row.before:
            if row.rules is not None:
                row.rules.done()  # the rng's uniforms drawn ahead: given back before the snapshot is put back
            _restore(row.sess, row.before)

    def _answer(self, q: Queued, result: Any) -> None:
        """The one place a call is answered, and so the one place END releases its session (state, pool blocks)."""
        if q.call.end:
            self.stage.store.end(q.call.corr_id)
            self.on_change()
        q.reply(result)

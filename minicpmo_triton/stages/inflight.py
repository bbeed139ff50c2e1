"""In-flight batching for a stage on the device engine (the LLM's, the TTS's): one engine thread steps the stage's
engine core (`engine.core.EngineCore`); queued calls become its requests between two iterations.

`submit` only queues a call with the function that answers it. The engine thread takes the queue before each
iteration: a call whose session has no request in the core is entered (START creates the session's state,
`check` refuses a bad call or `pool_full` at once), prepared by the stage (its prefill and its rules) and added to
the core, whose scheduler packs its prefill beside the running rows' one-token steps; a session that starts costs
the others one longer iteration, not a wait for its own turn. A request is answered in the iteration its row ends,
never held for the longest row of its batch. A session's next call waits until its previous one is answered (the
stage prepares a call from the session's state as the previous one left it).

Where things happen (all on the engine thread, so the stage's store and the pool have one user):
- START creates the session's state when its call is entered; END releases it in `_answer`, the one place a call
  is answered, after its request ended (or failed, or had no work): its pool blocks go back there.
- A request whose preparation or host rules raise is undone and answered with its error alone; the others go on.
  An iteration that raises (no row to blame) gives up every request taken in (`EngineCore.abort`): each is undone
  and run alone through the stage's synchronous path, as `isolated` does there.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..engine.protocol import PagedCache
from .base import SequenceStage, StageCall, _restore, _snapshot, isolated

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


class InflightLoop(Generic[RowT, StageT]):
    """The engine thread of one stateful model instance on the device engine."""

    thread_name = "engine"
    row_cls: type[Row] = Row

    def __init__(self, stage: StageT, sweep_period_s: float, on_change: Callable[[], None] = lambda: None) -> None:
        self.kv: Any = stage.kv  # type: ignore[attr-defined]
        assert getattr(self.kv, "core", None) is not None, "in-flight batching runs the stage's engine core"
        self.stage: StageT = stage
        self.core = self.kv.core
        self.sweep_period_s = sweep_period_s
        self.on_change = on_change  # the live-sequence gauge: called after the store changed
        self._queue: deque[Queued] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name=self.thread_name, daemon=True)
        self._thread.start()

    # ---- a stage's loop gives these ----
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
        with self._cv:
            self._queue.append(Queued(call, reply))
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
                if not self._queue and not self._stop and not self.core.has_work:
                    self._cv.wait(self.sweep_period_s)
                if self._stop:
                    return
            try:
                if not self.core.has_work and self.stage.store.evict_expired():  # here: the pool has one user
                    self.on_change()
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
        """The queued calls that can join now: entered, prepared, added to the core. Calls with nothing to decode
        are answered at once; a session's next call waits for its previous one's answer."""
        with self._cv:
            busy: set[int] = set()
            ready: list[Queued] = []
            held: deque[Queued] = deque()
            for q in self._queue:
                corr = q.call.corr_id
                (held if corr in busy or self.core.busy(corr) else ready).append(q)
                busy.add(corr)
            self._queue = held
        if not ready:
            return
        entered = [row for row in map(self._enter, ready) if row is not None]
        for row in self._prepare(entered):
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

"""What every stateful stage shares: START creates state, END frees it (an END for state already gone frees
nothing and fails nothing), the rest look it up; one bad row fails alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .state_store import SequenceStore

Req = TypeVar("Req")
Res = TypeVar("Res")
State = TypeVar("State")
T = TypeVar("T")


@dataclass
class StageCall(Generic[Req]):
    request: Req
    corr_id: int = 0
    start: bool = False
    end: bool = False


def isolated(run_batch: Callable[[list[T]], Sequence[Res]], items: list[T],
             undo: Callable[[int], None] = lambda row: None) -> list[Res | Exception]:
    """All items in one batch; when that fails, each item again alone (after `undo(row)` puts its state back
    as it was before the batch), so a row that still fails fails alone and every other row gets exactly
    what it gets alone. A row that fails alone is undone too: it leaves no trace."""
    try:
        return list(run_batch(items))
    except Exception as exc:  # noqa: BLE001 (which row broke the batch is found below)
        if len(items) == 1:
            undo(0)
            return [exc]
    outs: list[Res | Exception] = []
    for row, item in enumerate(items):
        undo(row)
        try:
            outs.extend(run_batch([item]))
        except Exception as exc:  # noqa: BLE001 (the row that broke the batch fails alone, with its error)
            undo(row)
            outs.append(exc)
    return outs


@dataclass(frozen=True)
class _RngAt:
    rng: np.random.Generator
    state: Mapping[str, Any]  # its bit generator's state (a deep copy of the generator costs 17x more)


@dataclass(frozen=True)
class _Nested:
    obj: Any  # a state object inside the state (an audio stream), undone field by field too
    snap: dict[str, Any]


def _mutable_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type) \
        and not type(value).__dataclass_params__.frozen  # type: ignore[attr-defined]


def _snapshot(state: Any) -> dict[str, Any]:
    """What `compute` may change: it rebinds fields (of the state and of the dataclasses inside it), changes
    lists and draws from the rng, and never writes into an array in place (a KV cache is replaced, not
    grown), so the fields with lists copied, nested dataclasses' fields and the rng's position are enough
    to undo it."""
    snap: dict[str, Any] = {}
    for name, value in vars(state).items():
        if isinstance(value, list):
            value = list(value)
        elif isinstance(value, np.random.Generator):
            value = _RngAt(value, value.bit_generator.state)
        elif _mutable_dataclass(value):
            value = _Nested(value, _snapshot(value))
        snap[name] = value
    return snap


def _restore(state: Any, snap: dict[str, Any]) -> None:
    for name, value in snap.items():
        if isinstance(value, list):
            value = list(value)  # the snapshot stays intact for a second undo
        elif isinstance(value, _RngAt):
            value.rng.bit_generator.state = value.state
            value = value.rng
        elif isinstance(value, _Nested):
            _restore(value.obj, value.snap)
            value = value.obj
        setattr(state, name, value)


def answer_order(calls: Sequence[StageCall[Req]], can_wait: Callable[[Req], bool]) -> list[list[int]]:
    """A batch's calls as groups to run and answer one after another: first those someone waits on, then those
    that can wait, so a session's step is answered without waiting for another's prefill chunk in its batch. A
    sequence with more than one call in the batch keeps them all in the first group, in order."""
    seen: dict[int, int] = {}
    for call in calls:
        seen[call.corr_id] = seen.get(call.corr_id, 0) + 1
    waits = [seen[c.corr_id] == 1 and can_wait(c.request) for c in calls]
    first = [i for i, w in enumerate(waits) if not w]
    later = [i for i, w in enumerate(waits) if w]
    return [g for g in (first, later) if g]


class SequenceStage(Generic[Req, Res, State]):
    """Subclasses give `new_state` and `compute`, which runs the whole batch in one go."""

    def __init__(self, ttl_s: float) -> None:
        self.store: SequenceStore[State] = SequenceStore(ttl_s, on_drop=self.drop_state)

    def counted(self) -> dict[str, int]:
        """The stage's running counts by name (the llm's window slides), published as counters on Triton's port."""
        return {}

    def drop_state(self, state: State) -> None:
        """A session's state is gone (END, a restart, eviction): give back what it holds outside itself."""

    def new_state(self, call: StageCall[Req]) -> State:
        raise NotImplementedError

    def is_noop(self, request: Req) -> bool:
        """An END-only call carries no work."""
        raise NotImplementedError

    def can_wait(self, request: Req) -> bool:
        """No caller is waiting on this call's answer to go on (a long prompt's leading prefill chunk): a batch
        answers the other calls first (`answer_order`)."""
        return False

    def check(self, request: Req, state: State) -> None:
        """Reject one call before the batch runs (raise), so a bad call cannot fail the others."""

    def compute(self, items: list[tuple[Req, State]]) -> list[Res]:
        raise NotImplementedError

    def empty_result(self) -> Res:
        raise NotImplementedError

    def enter(self, call: StageCall[Req]) -> State | None:
        """One call before its batch: START creates the state, the rest look it up, `check` refuses a bad call
        (it raises). None: the call has no work (its answer is `empty_result`)."""
        if call.end and not call.start and self.is_noop(call.request) and call.corr_id not in self.store:
            return None  # an END for state that is gone (refused at its START, or idled out): nothing to free
        state = self.store.start(call.corr_id, self.new_state(call)) if call.start else self.store.get(call.corr_id)
        if self.is_noop(call.request):
            return None
        self.check(call.request, state)
        return state

    def run(self, calls: list[StageCall[Req]]) -> list[Res | Exception]:
        results: list[Res | Exception] = [self.empty_result() for _ in calls]
        work: list[tuple[int, Req, State]] = []
        for i, call in enumerate(calls):
            try:
                state = self.enter(call)
            except Exception as exc:  # noqa: BLE001 (one bad call must not fail the batch)
                results[i] = exc
                continue
            if state is not None:
                work.append((i, call.request, state))
        if work:
            items = [(req, st) for _, req, st in work]
            before = [_snapshot(st) for _, st in items]

            def undo(row: int) -> None:
                _restore(items[row][1], before[row])

            for (i, _, _), out in zip(work, isolated(self.compute, items, undo), strict=True):
                results[i] = out
        for call in calls:
            if call.end:
                self.store.end(call.corr_id)
        return results

    @property
    def live_sequences(self) -> int:
        return len(self.store)

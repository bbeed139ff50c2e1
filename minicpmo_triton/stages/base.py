"""What every stateful stage shares: START creates state, END frees it, the rest look it up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from ..state_store import SequenceStore

Req = TypeVar("Req")
Res = TypeVar("Res")
State = TypeVar("State")


@dataclass
class StageCall(Generic[Req]):
    request: Req
    corr_id: int = 0
    start: bool = False
    end: bool = False


class SequenceStage(Generic[Req, Res, State]):
    """Subclasses give `new_state` and `compute`, which runs the whole batch in one go."""

    def __init__(self, ttl_s: float) -> None:
        self.store: SequenceStore[State] = SequenceStore(ttl_s)

    def new_state(self, call: StageCall[Req]) -> State:
        raise NotImplementedError

    def is_noop(self, request: Req) -> bool:
        """An END-only call carries no work."""
        raise NotImplementedError

    def check(self, request: Req, state: State) -> None:
        """Reject one call before the batch runs (raise), so a bad call cannot fail the others."""

    def compute(self, items: list[tuple[Req, State]]) -> list[Res]:
        raise NotImplementedError

    def empty_result(self) -> Res:
        raise NotImplementedError

    def run(self, calls: list[StageCall[Req]]) -> list[Res | Exception]:
        results: list[Res | Exception] = [self.empty_result() for _ in calls]
        work: list[tuple[int, Req, State]] = []
        for i, call in enumerate(calls):
            try:
                state = self.store.start(call.corr_id, self.new_state(call)) if call.start \
                    else self.store.get(call.corr_id)
                if self.is_noop(call.request):
                    continue
                self.check(call.request, state)
            except Exception as exc:  # noqa: BLE001 (one bad call must not fail the batch)
                results[i] = exc
                continue
            work.append((i, call.request, state))
        if work:
            try:
                outs = self.compute([(req, st) for _, req, st in work])
            except Exception as exc:  # noqa: BLE001
                outs = [exc] * len(work)
            for (i, _, _), out in zip(work, outs, strict=True):
                results[i] = out
        for call in calls:
            if call.end:
                self.store.end(call.corr_id)
        return results

    @property
    def live_sequences(self) -> int:
        return len(self.store)

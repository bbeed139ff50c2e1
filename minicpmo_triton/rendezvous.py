"""Steps meet before a stage, so their calls reach its sequence batcher together.

Two reasons to wait at the door, both bounded:
- Steps in flight: with no queue delay on the batcher, steps that started together still drift apart
  by the time they reach the LLM (each spent a different few ms on its way: a vision encoder, a
  replay, the event loop) and would run one by one. A step that arrives waits for the other steps
  in flight, at most `max_wait_s`.
- Load (`BatchWindow`, off unless `max_s` > 0): real-time callers' seconds do not line up, so under
  load the first step at the door holds it open for the steps that start in the next few hundred
  ms, long enough to expect a batch of `target`, and never longer than `max_s`; below
  `min_sessions` live sessions nothing is held for load. On 2 CPU cores it raised the LLM's batch
  but cost more latency than the batch saved; it is meant for accelerators.
A lone step on a quiet server has nobody to wait for and goes straight on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchWindow:
    target: int = 8  # the door opens as soon as this many wait
    max_s: float = 0.0  # 0: never held for load
    min_sessions: int = 24
    period_s: float = 1.0  # each live session brings one step per period

    def hold_s(self, live_sessions: int) -> float:
        """How long the first step at the door holds it for `target - 1` more (0: not at all)."""
        if self.max_s <= 0 or self.target < 2 or live_sessions < max(self.min_sessions, 2):
            return 0.0
        return min(self.max_s, (self.target - 1) * self.period_s / (live_sessions - 1))


class Member:
    """One step's place at the meeting: it arrives once, or leaves without arriving."""

    def __init__(self, meet: Rendezvous) -> None:
        self._meet = meet
        self.arrived = False

    async def arrive(self) -> None:
        if not self.arrived:
            self.arrived = True
            await self._meet._arrive()


class Rendezvous:
    def __init__(self, max_wait_s: float, window: BatchWindow | None = None,
                 live_sessions: Callable[[], int] = lambda: 0) -> None:
        self.max_wait_s = max_wait_s
        self.window = window or BatchWindow()
        self._live_sessions = live_sessions
        self._expected = 0  # members that have neither arrived nor left
        self._waiting: list[asyncio.Future[None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._held = False  # the waiting group is held for load, not only for steps in flight
        self.met = 0  # steps released together with at least one other

    @contextlib.asynccontextmanager
    async def member(self) -> AsyncIterator[Member]:
        self._expected += 1
        member = Member(self)
        try:
            yield member
        finally:
            if not member.arrived:
                self._expected -= 1
                if self._expected == 0 and not self._held:
                    self._release()

    async def pass_through(self) -> None:
        """Arrive without having been in flight (an END): joins a group that is waiting, else goes on."""
        async with self.member() as member:
            await member.arrive()

    async def _arrive(self) -> None:
        self._expected -= 1
        hold = self.window.hold_s(self._live_sessions())
        if not self._waiting and hold <= 0 and (self._expected == 0 or self.max_wait_s <= 0):
            return  # alone and nobody coming: straight on
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        if hold > 0:
            self._held = True
            if len(self._waiting) >= self.window.target:
                self._release()
            else:
                self._arm(max(hold, self.max_wait_s))
        elif self._expected == 0 and not self._held:
            self._release()
        else:
            self._arm(self.max_wait_s)
        await fut

    def _arm(self, after_s: float) -> None:
        """The group's deadline, set by its first member: later ones wait less, none waits longer."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(after_s, self._release)

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._held = False
        waiting, self._waiting = self._waiting, []
        if len(waiting) > 1:
            self.met += len(waiting)
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)

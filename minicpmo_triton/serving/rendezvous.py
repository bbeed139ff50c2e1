"""Steps meet before a stage, so their calls reach its sequence batcher together.

Two reasons to wait at the door, both bounded:
- Steps in flight: with no queue delay on the batcher, steps that started together still drift apart
  by the time they reach the LLM (each spent a different few ms on its way: a vision encoder, a
  replay, the event loop) and would run one by one. A step that arrives waits for the other steps
  in flight, at most `max_wait_s`.
- Load (`BatchWindow`, off unless `max_s` > 0): real-time callers' seconds do not line up, so at
  mid load the first step at the door holds it open for the steps that start in the next few hundred
  ms, long enough to expect a batch of `target`, and never longer than `max_s`. Only from
  `min_sessions` (fewer: a batch takes too long to gather) up to `max_sessions` live sessions (more:
  the queues batch by themselves), counting the highest number of the last few seconds so that a
  wave winding down is not held for; and only while recent steps' p90 time to their first event
  (less their own wait here) plus the hold fits in `budget_s`.
A lone step on a quiet server has nobody to wait for and goes straight on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchWindow:
    target: int = 8  # the door opens as soon as this many wait
    max_s: float = 0.0  # 0: never held for load
    min_sessions: int = 24
    max_sessions: int = 40  # from here on the queues batch by themselves: holding would only add its wait
    period_s: float = 1.0  # each live session brings one step per period
    budget_s: float = 0.5  # recent steps' p90 (without the door) plus the hold stay under this

    def hold_s(self, live_sessions: int, recent_s: float = 0.0) -> float:
        """How long the first step at the door holds it for `target - 1` more (0: not at all), given
        recent steps' p90 time to their first event without the door (`recent_s`)."""
        if self.max_s <= 0 or self.target < 2 or not max(self.min_sessions, 2) <= live_sessions < self.max_sessions:
            return 0.0
        hold = min(self.max_s, (self.target - 1) * self.period_s / (live_sessions - 1), self.budget_s - recent_s)
        return max(0.0, hold)


class RecentPeak:
    """The highest value seen in the last one to two `span_s` (two buckets): sessions that are winding
    down one by one still count as the load they were part of, so the door is not held for them."""

    def __init__(self, span_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.span_s = span_s
        self._clock = clock
        self._bucket_start = clock()
        self._current = self._previous = 0

    def see(self, value: int) -> int:
        now = self._clock()
        if now - self._bucket_start >= self.span_s:
            # A whole idle bucket forgets everything; otherwise the current becomes the previous.
            self._previous = self._current if now - self._bucket_start < 2 * self.span_s else 0
            self._current, self._bucket_start = 0, now
        self._current = max(self._current, value)
        return max(self._current, self._previous)


class RecentLatency:
    """The last `size` steps' time to their first event, less their wait at the door."""

    def __init__(self, size: int = 64) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._values.append(seconds)

    def quantile(self, q: float = 0.9) -> float:
        if not self._values:
            return 0.0
        ordered = sorted(self._values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Member:
    """One step's place at the meeting: it arrives once, or leaves without arriving."""

    def __init__(self, meet: Rendezvous) -> None:
        self._meet = meet
        self.arrived = False
        self.waited_s = 0.0  # at the door

    async def arrive(self) -> None:
        if not self.arrived:
            self.arrived = True
            clock = asyncio.get_running_loop().time  # the clock its timers run on
            t0 = clock()
            await self._meet._arrive()
            self.waited_s = clock() - t0

    @contextlib.asynccontextmanager
    async def aside(self) -> AsyncIterator[None]:
        """Work of this step's that the others at the door must not wait for (a long prefill's leading chunks, a
        voice prompt's encoding): meanwhile the step does not count as in flight."""
        meet = self._meet
        meet._expected -= 1
        if meet._expected == 0 and not meet._held:
            meet._release()
        try:
            yield
        finally:
            meet._expected += 1


class Rendezvous:
    def __init__(self, max_wait_s: float, window: BatchWindow | None = None,
                 live_sessions: Callable[[], int] = lambda: 0) -> None:
        self.max_wait_s = max_wait_s
        self.window = window or BatchWindow()
        self._live_sessions = live_sessions
        self.recent = RecentLatency()  # what steps cost without the door: the window's room
        self.peak_sessions = RecentPeak()
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
        hold = self.window.hold_s(self.peak_sessions.see(self._live_sessions()), self.recent.quantile())
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

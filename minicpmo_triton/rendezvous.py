"""Steps in flight meet before a stage, so their calls reach its sequence batcher together.

With no queue delay on the batcher, steps that started together still drift apart by the time
they reach the LLM (each spent a different few ms in the audio encoder) and run one by one.
A step that arrives here waits for the other steps in flight, at most `max_wait_s`, then all go
at once. A lone step has nobody to wait for and goes straight on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


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
    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self._expected = 0  # members that have neither arrived nor left
        self._waiting: list[asyncio.Future[None]] = []
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
                if self._expected == 0:
                    self._release()

    async def _arrive(self) -> None:
        self._expected -= 1
        if self._expected == 0 or self.max_wait_s <= 0:
            self._release(arriving=1)
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.max_wait_s)
        except asyncio.TimeoutError:
            self._release()

    def _release(self, arriving: int = 0) -> None:
        waiting, self._waiting = self._waiting, []
        if len(waiting) + arriving > 1:
            self.met += len(waiting) + arriving
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)

"""Under load, duplex steps start on a shared beat so that the stages see them together.

Real-time sessions send their seconds at phases of their own; with no queue delay on the batchers
they meet by chance only (a mean LLM batch of 1.6 at 32 sessions). From `min_sessions` live sessions
on, a step waits for the next multiple of `period_s` (half a period on average), and the steps of
one beat go through the audio encoder and the LLM as one batch. Below it nothing waits.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable


class Cadence:
    def __init__(self, period_s: float, min_sessions: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.min_sessions = min_sessions
        self._clock = clock

    def delay(self, live_sessions: int) -> float:
        """How long a step starting now waits for its beat (0 when the cadence is off)."""
        if self.period_s <= 0 or live_sessions < self.min_sessions:
            return 0.0
        now = self._clock()
        return math.ceil(now / self.period_s) * self.period_s - now

    async def wait(self, live_sessions: int) -> float:
        delay = self.delay(live_sessions)
        if delay > 0:
            await asyncio.sleep(delay)
        return delay

"""Reconnect timing: exponential backoff with jitter, bounded (pure code; the random source is injectable)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays `base_s * factor**i` capped at `max_s`, each shortened by up to `jitter` of itself at random
    (so that many clients dropped together do not come back together), for at most `attempts` tries.
    The defaults total under 12 s: well inside the server's 30 s disconnect grace, after which a
    session cannot be resumed."""

    base_s: float = 0.2
    factor: float = 2.0
    max_s: float = 5.0
    attempts: int = 6
    jitter: float = 0.5

    def delays(self, rand: Callable[[], float] = random.random) -> Iterator[float]:
        for i in range(self.attempts):
            delay = min(self.max_s, self.base_s * self.factor ** i)
            yield delay * (1.0 - self.jitter * rand())

"""The server events a session sent, kept for a while so a reconnecting client can be replayed (pure code).

Bounded by age and by bytes, oldest first out. `since(seq)` gives what follows `seq`, or None when
some of it was already dropped (the client must resync).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Journal:
    max_age_s: float = 60.0
    max_bytes: int = 8 << 20
    clock: Callable[[], float] = time.monotonic
    _entries: deque[tuple[int, float, str]] = field(default_factory=deque)  # (seq, time, json text)
    _bytes: int = 0
    dropped_through: int = 0  # the highest seq no longer kept (0: nothing dropped)

    def add(self, seq: int, text: str) -> None:
        self._entries.append((seq, self.clock(), text))
        self._bytes += len(text)
        self._trim()

    def _trim(self) -> None:
        horizon = self.clock() - self.max_age_s
        while self._entries and (self._bytes > self.max_bytes or self._entries[0][1] < horizon):
            seq, _, text = self._entries.popleft()
            self._bytes -= len(text)
            self.dropped_through = seq

    def since(self, seq: int) -> list[str] | None:
        """Events after `seq`, in order; None if any of them is no longer kept."""
        self._trim()
        if seq < self.dropped_through:
            return None
        return [text for s, _, text in self._entries if s > seq]

    @property
    def nbytes(self) -> int:
        return self._bytes

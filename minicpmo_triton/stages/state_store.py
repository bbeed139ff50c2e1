"""Per-sequence state keyed by correlation ID, freed on END and evicted after an idle TTL.

Triton drops an idle sequence without telling a Python-backend model, so the TTL is ours.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class SequenceNotStarted(KeyError):
    """A step arrived for a correlation ID with no live state (never started, ended, or evicted)."""

    def __str__(self) -> str:
        return f"sequence {self.args[0]} has no state: it was not started with START, or it ended or idled out"


@dataclass
class _Entry(Generic[T]):
    value: T
    touched: float


class SequenceStore(Generic[T]):
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[T], None] | None = None) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_drop = on_drop  # state held outside the entry (KV pool blocks) is given back here
        self._entries: dict[int, _Entry[T]] = {}
        self._lock = threading.Lock()
        self.evicted_total = 0

    def start(self, corr_id: int, value: T) -> T:
        """Begin (or restart) a sequence: any earlier state under this ID is replaced."""
        with self._lock:
            old = self._entries.get(corr_id)
            self._entries[corr_id] = _Entry(value, self._clock())
        if old is not None:
            self._drop(old.value)
        return value

    def _drop(self, value: T) -> None:
        if self._on_drop is not None:
            self._on_drop(value)

    def get(self, corr_id: int) -> T:
        with self._lock:
            entry = self._entries.get(corr_id)
            if entry is None:
                raise SequenceNotStarted(corr_id)
            entry.touched = self._clock()
            return entry.value

    def get_or_none(self, corr_id: int) -> T | None:
        try:
            return self.get(corr_id)
        except SequenceNotStarted:
            return None

    def end(self, corr_id: int) -> bool:
        with self._lock:
            entry = self._entries.pop(corr_id, None)
        if entry is not None:
            self._drop(entry.value)
        return entry is not None

    def evict_expired(self) -> list[int]:
        now = self._clock()
        with self._lock:
            expired = [cid for cid, e in self._entries.items() if now - e.touched > self.ttl_s]
            dropped = [self._entries.pop(cid).value for cid in expired]
            self.evicted_total += len(expired)
        for value in dropped:
            self._drop(value)
        return expired

    def values(self) -> list[T]:
        with self._lock:
            return [e.value for e in self._entries.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, corr_id: int) -> bool:
        with self._lock:
            return corr_id in self._entries

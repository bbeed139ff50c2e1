"""The preparation thread of an in-flight loop: the heavy part of admitting calls (the LLM's: the entered rows' mel
and streaming Whisper, one batch for the rows entered together) done off the engine thread, so the rows decoding
are not held by another row's encoding.

One owner of a session's state at a time: the engine thread enters a call (the session's state found or made, its
checks and reservations) and hands its row here; until the row comes back, only this thread touches it (of the
session, what the work needs: its audio stream), and the engine thread holds that session's next call. Rows handed
over while a batch is at work make the next batch together. Each row comes back (`done`) with its error or None;
the engine thread undoes and answers a failed one, prepares and adds the others between two iterations.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Work = Callable[[list[Any]], list[Exception | None]]
Done = Callable[[list[tuple[Any, Exception | None]]], None]


class Served:
    """A daemon thread running `_serve`, woken through `_cv` after a change (`_wake`); `close` stops it."""

    def _start(self, name: str) -> None:
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        raise NotImplementedError

    def _wake(self, change: Callable[[], Any]) -> None:
        with self._cv:
            change()
            self._cv.notify()

    def close(self) -> None:
        self._wake(lambda: setattr(self, "_stop", True))
        self._thread.join(timeout=10)


class Preparer(Served):
    def __init__(self, work: Work, done: Done, name: str) -> None:
        """`work`: a batch of rows -> each row's error or None (run here); `done`: the rows back to their loop."""
        self.work, self.done = work, done
        self._rows: list[Any] = []
        self._start(name)

    def submit(self, rows: list[Any]) -> None:
        self._wake(lambda: self._rows.extend(rows))

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._rows and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                rows, self._rows = self._rows, []
            try:
                errors = self.work(rows)
            except Exception as exc:  # noqa: BLE001 (a bug in the work itself: each row is told, the thread goes on)
                errors = [exc] * len(rows)
            self.done(list(zip(rows, errors, strict=True)))

"""The gateway's sessions: slots (one limit for every protocol), a FIFO of callers waiting for one,
the live sessions by id, and whether Triton's entry model is ready."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

from tritonclient.grpc import aio as grpcaio

from .protocol import CLOSE_GOING_AWAY
from .settings import Settings
from .triton_stream import ENTRY_MODEL

if TYPE_CHECKING:
    from .connection import Connection
    from .realtime.session import RealtimeSession


class SessionLimitReached(Exception):
    pass


class QueueFull(Exception):
    pass


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sessions: dict[str, Connection] = {}  # /backend
        self.realtime: dict[str, RealtimeSession] = {}  # /v1/realtime, attached or within their grace
        self._reserved = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.ready = False
        self.stale_dropped_closed = 0  # stale deltas fenced off by sessions that have ended
        self.mean_session_s = 60.0  # an EMA of session lifetimes, for queue wait estimates

    @property
    def active_sessions(self) -> int:
        return len(self.sessions) + len(self.realtime)

    @property
    def stale_dropped(self) -> int:
        return self.stale_dropped_closed + sum(s.state.stale_dropped for s in self.realtime.values())

    def reserve(self) -> None:
        if self._reserved >= self.settings.max_sessions or self._waiters:
            raise SessionLimitReached
        self._reserved += 1

    def enqueue(self) -> asyncio.Future[None]:
        """A place in the FIFO for a slot; the future resolves when one is handed over."""
        if len(self._waiters) >= self.settings.queue_max:
            raise QueueFull
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def position(self, fut: asyncio.Future[None]) -> int:
        return next((i + 1 for i, w in enumerate(self._waiters) if w is fut), 0)

    @property
    def queue_length(self) -> int:
        return len(self._waiters)

    def leave_queue(self, fut: asyncio.Future[None]) -> None:
        """A caller that stops waiting; a slot already handed to it goes to the next one."""
        if fut in self._waiters:
            self._waiters.remove(fut)
        elif fut.done() and not fut.cancelled():
            self.release(None)

    def release(self, session_id: str | None, started_at: float | None = None) -> None:
        if session_id is not None:
            self.sessions.pop(session_id, None)
            gone = self.realtime.pop(session_id, None)
            if gone is not None:
                self.stale_dropped_closed += gone.state.stale_dropped
        if started_at is not None:
            self.mean_session_s = 0.8 * self.mean_session_s + 0.2 * (time.monotonic() - started_at)
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes straight on
                return
        self._reserved -= 1

    async def watch_triton(self) -> None:
        client = grpcaio.InferenceServerClient(self.settings.triton_url)
        try:
            while True:
                try:
                    self.ready = bool(await client.is_model_ready(ENTRY_MODEL))
                except Exception:  # noqa: BLE001 (not up yet, or gone: report `loading`)
                    self.ready = False
                await asyncio.sleep(1.0 if self.ready else 0.25)
        finally:
            await client.close()

    async def shutdown(self) -> None:
        sessions = [*self.sessions.values(), *self.realtime.values()]
        await asyncio.gather(*(s.close("server_shutdown", ws_code=CLOSE_GOING_AWAY) for s in sessions),
                             return_exceptions=True)

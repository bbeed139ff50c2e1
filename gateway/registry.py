"""The gateway's sessions: slots (one limit for every dialect), a FIFO of callers waiting for one,
the live sessions by id, and whether the backend is healthy (every stage: gateway/stage_health.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from .settings import Settings
from .stage_health import StageHealth
from .wire import CLOSE_GOING_AWAY

log = logging.getLogger("gateway")


class SessionLimitReached(Exception):
    pass


class QueueFull(Exception):
    pass


class _State(Protocol):
    stale_dropped: int


class LiveSession(Protocol):
    session_id: str
    owner: str  # the principal (gateway.auth) that opened it
    state: _State
    started_at: float
    offloaded: int  # client frames decided in a worker thread

    async def close(self, reason: str, *, ws_code: int = ...) -> None: ...

    def lost(self) -> None:
        """The backend broke under it: the client is told `backend_unavailable` and the session ends."""


class Gateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sessions: dict[str, LiveSession] = {}  # every dialect's, attached or within a resume grace
        self._reserved = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.ready = False
        self._not_ready_why: str | None = None  # None: not checked yet (the first check is always logged)
        self.backend_state = "loading"  # stage_health's verdict: ready | loading | unresponsive | broken
        self.heal: Callable[[], None] | None = None  # restarts the backend (set by gateway.serve, which owns it)
        self.stale_dropped_closed = 0  # stale deltas fenced off by sessions that have ended
        self.offloaded_closed = 0  # frames they decided in a worker thread
        self.mean_session_s = 60.0  # an EMA of session lifetimes, for queue wait estimates

    @property
    def active_sessions(self) -> int:
        return len(self.sessions)

    @property
    def stale_dropped(self) -> int:
        return self.stale_dropped_closed + sum(s.state.stale_dropped for s in self.sessions.values())

    @property
    def offloaded(self) -> int:
        return self.offloaded_closed + sum(s.offloaded for s in self.sessions.values())

    # ---- slots: taken by shell.admitted, given back by it (one place) ----
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
        """A caller that stops waiting before a slot was handed to it."""
        if fut in self._waiters:
            self._waiters.remove(fut)

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes straight on
                return
        self._reserved -= 1

    # ---- live sessions ----
    def place(self) -> str:
        """The Triton endpoint (host:grpc_port) a new session's stream goes to: the one configured. Placing
        sessions over several endpoints belongs here (`shell.running` asks it, once per session)."""
        return self.settings.triton_url

    def add(self, session: LiveSession) -> None:
        self.sessions[session.session_id] = session

    def forget(self, session: LiveSession) -> None:
        if self.sessions.pop(session.session_id, None) is not None:
            self.stale_dropped_closed += session.state.stale_dropped
            self.offloaded_closed += session.offloaded
            self.mean_session_s = 0.8 * self.mean_session_s + 0.2 * (time.monotonic() - session.started_at)

    async def watch_triton(self) -> None:
        """Every stage's health (gateway/stage_health.py): /health, and the sessions of a backend that broke."""
        s = self.settings
        await StageHealth(s.triton_url, s.health_period_s, s.health_timeout_s, s.step_timeout_s, self._backend_is,
                          self._tell_sessions, heal=lambda: self.heal() if self.heal is not None else None).watch()

    def _backend_is(self, state: str, why: str) -> None:
        self.backend_state = state
        self._set_ready(state == "ready", f"{state}: {why}" if why else state)

    def _tell_sessions(self) -> None:
        for session in list(self.sessions.values()):
            session.lost()

    def _set_ready(self, ready: bool, why: str) -> None:
        """Readiness as /health reports it; each change (and each new reason for not being ready) is logged once."""
        if (ready, why) != (self.ready, self._not_ready_why):
            if ready:
                log.info("Triton is ready: new sessions are admitted")
            else:
                log.warning("Triton is not ready: %s; new sessions are refused (not_ready)", why)
        self.ready, self._not_ready_why = ready, why

    async def shutdown(self) -> None:
        sessions = list(self.sessions.values())
        await asyncio.gather(*(s.close("server_shutdown", ws_code=CLOSE_GOING_AWAY) for s in sessions),
                             return_exceptions=True)

"""The gateway's sessions: slots (one limit for every dialect), a FIFO of callers waiting for one,
the live sessions by id, the Triton endpoints they are placed on (`gateway.triton.pool`), and whether every
stage of each is healthy (`gateway.stage_health`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter, deque
from typing import Protocol

from minicpmo_triton.errors import describe

from . import peers
from .metrics import EndpointView, Metrics
from .settings import Settings
from .stage_health import OwnedTriton, StageHealth
from .tracing import StepTracer
from .triton.placement import NoEndpoint
from .triton.pool import EndpointPool
from .triton.stream import next_correlation_id
from .wire import CLOSE_GOING_AWAY, CLOSE_TRY_AGAIN, ProtocolError

log = logging.getLogger("gateway.health")


class SessionLimitReached(Exception):
    pass


class QueueFull(Exception):
    pass


class _State(Protocol):
    stale_dropped: int


class _Stream(Protocol):
    url: str  # the Triton endpoint it is placed on
    corr_id: int


class LiveSession(Protocol):
    session_id: str
    owner: str  # the principal (gateway.auth) that opened it
    started_at: float
    offloaded: int  # client frames decided in a worker thread

    # read-only here (properties), so a session's own richer types fit
    @property
    def state(self) -> _State: ...

    @property
    def triton(self) -> _Stream: ...

    async def close(self, reason: str, *, ws_code: int = ...) -> None: ...

    def lost(self) -> None:
        """The backend broke under it: the client is told `backend_unavailable` and the session ends."""


class Gateway:
    def __init__(self, settings: Settings) -> None:
        if settings.gateway_url:
            peers.check_url(settings.gateway_url)  # a wrong one would send resumes nowhere: refuse to start
        self.settings = settings
        self.sessions: dict[str, LiveSession] = {}  # every dialect's, attached or within a resume grace
        self._reserved = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.pool = EndpointPool(settings.triton_url, settings.triton_endpoints_file or None, settings.failover_s,
                                 self.sessions_per_endpoint, self._endpoint_down)
        # endpoint url -> the Triton there, for those this gateway started (set by gateway.serve before the watches
        # start): restarted when it will not reload a broken stage's model
        self.owned: dict[str, OwnedTriton] = {}
        self.stale_dropped_closed = 0  # stale deltas fenced off by sessions that have ended
        self.offloaded_closed = 0  # frames they decided in a worker thread
        self.mean_session_s = 60.0  # an EMA of session lifetimes, for queue wait estimates
        self.metrics = Metrics(settings.metrics)  # /metrics (gateway/admin.py); the shell records where things happen
        self.tracer = StepTracer.of(settings.otlp_endpoint)  # a trace per step, when an OTLP collector is set

    @property
    def ready(self) -> bool:
        """Some endpoint takes new sessions."""
        return self.pool.ready

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

    # ---- placement: where a session's Triton sequence lives ----
    def place(self) -> tuple[str, int]:
        """The endpoint for a new session and a correlation ID for it there; refused (retryable) when no
        endpoint takes one."""
        try:
            url = self.pool.place().url
        except NoEndpoint as exc:
            raise ProtocolError(exc.code, exc.message, close_code=CLOSE_TRY_AGAIN, error_type="server_error",
                                retryable=True) from None
        taken = {s.triton.corr_id for s in self.sessions.values() if s.triton.url == url}
        return url, next_correlation_id(taken)

    def sessions_per_endpoint(self) -> Counter[str]:
        return Counter(s.triton.url for s in self.sessions.values())

    def stream_lost(self, session: LiveSession) -> None:
        """A session's stream to Triton broke: no new sessions on that endpoint until it answers again."""
        self.pool.suspect(session.triton.url)
        session.lost()

    def _endpoint_down(self, url: str) -> None:
        for session in [s for s in self.sessions.values() if s.triton.url == url]:
            session.lost()

    # ---- live sessions ----
    def add(self, session: LiveSession) -> None:
        self.sessions[session.session_id] = session

    def forget(self, session: LiveSession) -> None:
        if self.sessions.pop(session.session_id, None) is not None:
            self.stale_dropped_closed += session.state.stale_dropped
            self.offloaded_closed += session.offloaded
            self.mean_session_s = 0.8 * self.mean_session_s + 0.2 * (time.monotonic() - session.started_at)

    async def watch_triton(self) -> None:
        await asyncio.gather(self.pool.run(), self._watch_stages(), self._publish_metrics())

    def refresh_metrics(self) -> None:
        """The gauges from the sessions and the endpoints now (each probe period, and before a scrape)."""
        on = self.sessions_per_endpoint()
        self.metrics.refresh(self.active_sessions, self.settings.max_sessions, self.queue_length, self.ready, (
            EndpointView(url, on[url], e.room(on[url]), e.healthy, e.draining, e.queue_ms, e.placements, e.failovers)
            for url, e in self.pool.endpoints.items()))

    async def _publish_metrics(self) -> None:
        # With several workers, any one answers a scrape for all (gateway/metrics.py): each keeps its gauges current.
        while True:
            self.refresh_metrics()
            await asyncio.sleep(self.pool.probe_s)

    async def _watch_stages(self) -> None:
        """One `StageHealth` per listed endpoint, started as endpoints join the list and stopped as they leave (and
        started again should one ever end: logged)."""
        s = self.settings
        watches: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for url, task in [(u, t) for u, t in watches.items() if t.done()]:
                    log.error("endpoint %s: its stage watch ended (%s); starting it again", url,
                              "cancelled" if task.cancelled() else describe(task.exception() or RuntimeError()))
                    del watches[url]
                for url in self.pool.endpoints.keys() - watches.keys():
                    health = StageHealth(url, s.health_period_s, s.health_timeout_s, s.step_timeout_s,
                                         functools.partial(self._stages_are, url),
                                         functools.partial(self._endpoint_down, url),
                                         owned=self.owned.get(url),
                                         reloads_before_restart=s.reloads_before_restart,
                                         control_key=s.triton_control_key, deadline_s=s.heal_deadline_s,
                                         on_heal=self.metrics.healed)
                    watches[url] = asyncio.get_running_loop().create_task(health.watch())
                for url in watches.keys() - self.pool.endpoints.keys():
                    watches.pop(url).cancel()
                await asyncio.sleep(s.health_period_s)
        finally:
            for task in watches.values():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*watches.values(), return_exceptions=True)

    def _stages_are(self, url: str, state: str, why: str) -> None:
        endpoint = self.pool.endpoints.get(url)
        if endpoint is None:
            return
        if state != endpoint.stages and (state == "ready" or endpoint.stages == "ready"):
            if state == "ready":
                log.info("endpoint %s: every stage answers", url)
            else:
                log.warning("endpoint %s: stages %s: %s; no new sessions there", url, state, why)
        endpoint.stages, endpoint.stages_why = state, why

    @property
    def backend_state(self) -> str:
        """The stages' verdict over the endpoints: the first not ready one's, else ready (stage_health's words)."""
        return next((e.stages for e in self.pool.endpoints.values() if e.stages != "ready"), "ready")

    async def shutdown(self) -> None:
        sessions = list(self.sessions.values())
        await asyncio.gather(*(s.close("server_shutdown", ws_code=CLOSE_GOING_AWAY) for s in sessions),
                             return_exceptions=True)
        await asyncio.to_thread(self.tracer.shutdown)  # the last steps' spans are sent

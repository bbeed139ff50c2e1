"""The gateway's Prometheus metrics (`prometheus_client`), served at `GET /metrics` (gateway/admin.py): what callers
feel, per dialect, and the state of the Triton endpoints this gateway places sessions on. Every series is named in
docs/deploy.md ("Metrics").

The shell, the endpoints and the stage watch call `Metrics` where things happen (a step answered, a refusal sent, a
session closed, a stage healed); the gauges are set from the gateway's own state by `refresh`, each probe period and
before a scrape. No label holds caller content: labels are dialects, `ClientCode`s, close reasons from a fixed set
and endpoint addresses (a reason a client gives in `POST /sessions/{id}/close` is counted as `other`).

Several gateway processes on one port (`gateway.serve --workers N`) share one exposition: `gateway.workers` makes a
private directory for prometheus_client's multiprocess mode, names it in `PROMETHEUS_MULTIPROC_DIR` for the
workers (the library reads it when it is imported), marks a dead worker's live gauges gone, and removes the directory
when it stops. Any worker's `/metrics` then answers for all of them: counters and histograms summed, each gauge
combined as its `multiprocess_mode` says.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

disable_created_metrics()  # no `*_created` series (a second series per counter; the workers' exposition has none)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STEP_PERIOD_S = 1.0  # a duplex step hears 1 s of the caller: a step answered later than that is a late chunk
DIALECTS = ("backend", "openai", "minicpm")  # /backend, /v1/realtime, /v1/realtime?mode=audio|video
HEALS = ("reload", "restart")
# The reasons the gateway closes sessions with (shell, dialects, stage errors): anything else is `other`.
CLOSE_REASONS = frozenset({
    "closed", "client_closed", "client_disconnected", "timeout", "init_timeout", "protocol_error", "internal_error",
    "slow_consumer", "disconnect_grace_expired", "resumed_elsewhere", "server_shutdown", "backend_unavailable",
    "backend_error", "step_timeout", "context_full", "invalid_config", "pool_full", "queue_full", "session.close",
})

# Seconds. The step's buckets hold the 1 s period exactly (the SLO line) and the door's 250 ms batch window.
STEP_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
FIRST_AUDIO_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0)
SHORT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


@dataclass(frozen=True)
class EndpointView:
    """One Triton endpoint as this gateway sees it (gateway/triton/pool.py), for the gauges."""

    url: str
    sessions: int  # this gateway's live sessions there
    room: int | None  # None: unknown (no metrics read yet)
    healthy: bool
    draining: bool
    queue_ms: float
    placements: int  # since this gateway started
    failovers: int


class Metrics:
    """One per gateway process. `record=False` (MINICPMO_METRICS=0) records none of the histograms and counters,
    only to measure what they cost (bench/load.py --metrics); the gauges are served either way."""

    def __init__(self, record: bool = True) -> None:
        self.record = record
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        # One naming scheme: minicpmo_gateway_<what> (docs/deploy.md names each).
        def histogram(what: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"minicpmo_gateway_{what}_seconds", doc, ("dialect",), registry=r, buckets=buckets)

        def counter(what: str, doc: str, *labels: str) -> Counter:
            return Counter(f"minicpmo_gateway_{what}", doc, labels, registry=r)

        def gauge(what: str, doc: str, mode: Literal["livesum", "livemin", "livemax"], *labels: str) -> Gauge:
            # each worker's value; the exposition sums them (livesum), or takes the tightest (livemin) or worst
            # (livemax) view of an endpoint among the workers alive
            return Gauge(f"minicpmo_gateway_{what}", doc, labels, registry=r, multiprocess_mode=mode)

        self.step_latency = histogram("step_latency", "A duplex step: the append that completed its second, to its "
                                      "first event sent to the caller", STEP_BUCKETS)
        self.step_queue = histogram("step_queue", "A step's wait in the gateway, planned to sent to Triton (behind "
                                    "the session's step in flight)", SHORT_BUCKETS)
        self.first_audio = histogram("first_audio", "A spoken turn: the append of the step that opened it, to its "
                                     "first audio sent", FIRST_AUDIO_BUCKETS)
        self.barge_in = histogram("barge_in", "A barge-in (or a cancel): the caller's frame that carried it, to the "
                                  "last audio of the cut reply sent (nothing of it leaves after)", SHORT_BUCKETS)
        self.late_chunks = counter("late_chunks", "Steps answered later than their 1 s period (the caller's audio "
                                   "fell behind)", "dialect")
        self.opened = counter("sessions_opened", "Sessions opened", "dialect")
        self.closed = counter("sessions_closed", "Sessions closed, by reason", "dialect", "reason")
        self.refusals = counter("refusals", "Refusals and errors sent to callers, by code", "dialect", "code")
        self.resumes = counter("resumes", "Sessions resumed on a new socket", "dialect")
        self.heals = counter("heals", "Broken stages healed: a model reloaded, or Triton restarted", "action")
        self.active = gauge("active_sessions", "Live sessions, every dialect", "livesum")
        self.max_sessions = gauge("max_sessions", "Session slots", "livesum")
        self.queue_length = gauge("queue_length", "Callers waiting for a slot (MiniCPM-o's dialect)", "livesum")
        self.ready = gauge("ready", "1 while some endpoint takes new sessions", "livemax")
        self.sessions = gauge("sessions", "Live sessions per Triton endpoint", "livesum", "endpoint")
        self.room = gauge("endpoint_room", "New sessions the endpoint has room for (NaN: unknown)", "livemin",
                          "endpoint")
        self.endpoint_ready = gauge("endpoint_ready", "1 while the endpoint and all its stages answer", "livemin",
                                    "endpoint")
        self.draining = gauge("endpoint_draining", "1 while the endpoint takes no new sessions", "livemax", "endpoint")
        self.queue_ms = gauge("endpoint_queue_ms", "The endpoint's stages' mean queue time since the last probe, ms",
                              "livemax", "endpoint")
        self.placements = counter("placements", "Sessions placed on the endpoint", "endpoint")
        self.failovers = counter("failovers", "Times the endpoint's sessions were ended for its silence", "endpoint")
        self._counted: dict[str, tuple[int, int]] = {}  # endpoint -> (placements, failovers) already counted
        # Every dialect's series from the start, at 0: a rate over a series that appears late misses its first count.
        for dialect in DIALECTS:
            for family in (self.step_latency, self.step_queue, self.first_audio, self.barge_in, self.late_chunks,
                           self.opened, self.resumes):
                family.labels(dialect)
        for action in HEALS:
            self.heals.labels(action)
        # The workers' files hold values, not words: their exposition is given each family's HELP from here.
        self._help = {family.name: family.documentation for collector in vars(self).values()
                      if isinstance(collector, MetricWrapperBase) for family in collector.describe()}

    # ---- where things happen ----
    def step_sent(self, dialect: str, planned_s: float) -> None:
        if self.record:
            self.step_queue.labels(dialect).observe(planned_s)

    def step_answered(self, dialect: str, planned_s: float) -> None:
        if self.record:
            self.step_latency.labels(dialect).observe(planned_s)
            if planned_s > STEP_PERIOD_S:
                self.late_chunks.labels(dialect).inc()

    def first_audio_sent(self, dialect: str, seconds: float) -> None:
        if self.record:
            self.first_audio.labels(dialect).observe(seconds)

    def barged_in(self, dialect: str, seconds: float) -> None:
        if self.record:
            self.barge_in.labels(dialect).observe(seconds)

    def refused(self, dialect: str, code: str) -> None:
        if self.record:
            self.refusals.labels(dialect, str(code)).inc()

    def session_opened(self, dialect: str) -> None:
        if self.record:
            self.opened.labels(dialect).inc()

    def session_closed(self, dialect: str, reason: str) -> None:
        if self.record:
            self.closed.labels(dialect, reason if reason in CLOSE_REASONS else "other").inc()

    def resumed(self, dialect: str) -> None:
        if self.record:
            self.resumes.labels(dialect).inc()

    def healed(self, action: str) -> None:
        if self.record:
            self.heals.labels(action).inc()

    # ---- the gauges, from the gateway's state ----
    def refresh(self, active: int, max_sessions: int, queue_length: int, ready: bool,
                endpoints: Iterable[EndpointView]) -> None:
        self.active.set(active)
        self.max_sessions.set(max_sessions)
        self.queue_length.set(queue_length)
        self.ready.set(int(ready))
        views = {e.url: e for e in endpoints}
        for url in set(self._counted) - views.keys():  # forgotten (drained, left the list): shown empty, not frozen
            self._counted.pop(url)
            self.sessions.labels(url).set(0)
            self.endpoint_ready.labels(url).set(0)
            self.draining.labels(url).set(1)
            self.room.labels(url).set(0)
        for url, e in views.items():
            self.sessions.labels(url).set(e.sessions)
            self.room.labels(url).set(math.nan if e.room is None else e.room)
            self.endpoint_ready.labels(url).set(int(e.healthy))
            self.draining.labels(url).set(int(e.draining))
            self.queue_ms.labels(url).set(round(e.queue_ms, 1))
            placed, failed = self._counted.get(url, (0, 0))
            self.placements.labels(url).inc(e.placements - placed)
            self.failovers.labels(url).inc(e.failovers - failed)
            self._counted[url] = (e.placements, e.failovers)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition: this process's registry, or every worker's files in multiprocess mode."""
        folder = multiprocess_dir()
        if folder is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        merged = CollectorRegistry()
        merged.register(_Described(MultiProcessCollector(None, folder), self._help))
        return generate_latest(merged), CONTENT_TYPE_LATEST


class _Described:
    """A collector's families with their own HELP (the multiprocess files keep none: "Multiprocess metric")."""

    def __init__(self, collector: MultiProcessCollector, help_by_name: dict[str, str]) -> None:
        self.collector = collector
        self.help_by_name = help_by_name

    def collect(self) -> Iterable[Metric]:
        for family in self.collector.collect():
            family.documentation = self.help_by_name.get(family.name, family.documentation)
            yield family

"""The Triton servers this gateway places sessions on, watched: the I/O around `placement` and `endpoints`.

Every probe period each listed endpoint is asked whether its entry model is ready (gRPC) and its metrics page
is read (HTTP); the list itself (`MINICPMO_TRITON_URL`, or the file `MINICPMO_TRITON_ENDPOINTS_FILE`,
re-read when it changes) may change meanwhile. An endpoint's state:

- `ready`: takes new sessions once every stage of it answers its probe too (`stages`: gateway/stage_health.py,
  watched by the registry: a dead stub leaves the entry model "ready"), unless it is draining (the list says
  `drain`, the admin call said so, or it left the list: then it is forgotten once its sessions ended);
- `loading`: it answers but its entry model is not ready: no new sessions; live ones go on;
- `down`: it did not answer, or a session's stream to it broke: no new sessions from that moment. Once it has
  not answered for `failover_s` since its first unanswered probe, its sessions still open are ended with
  `backend_unavailable` (retryable): those whose stream broke were told already; this catches a server that
  hangs or a network that splits. From the moment it goes silent: within failover_s + one probe period.

A session that could not END its sequence (its Triton silent, its entry model dead) leaves it here (`orphaned`):
once the endpoint answers again, the pool ENDs it on every model (gateway/triton/orphans.py), so nothing is left
live there until the stages' TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import httpx
from tritonclient.grpc import aio as grpcaio

from . import devices, endpoints, placement
from .endpoints import EndpointSpec
from .orphans import end_everywhere
from .placement import Candidate, Scrape

log = logging.getLogger("gateway.endpoints")

READY, LOADING, DOWN = "ready", "loading", "down"
MAX_ORPHANS = 10_000  # sequences kept to END per endpoint (the oldest forgotten past it: the TTL frees them)
# gRPC backs off reconnecting to a server that went away up to 120 s: a server back sooner would stay `down`.
PROBE_CHANNEL = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                 ("grpc.max_reconnect_backoff_ms", 1000)]


class Endpoint:
    """One Triton server as this gateway sees it."""

    def __init__(self, spec: EndpointSpec) -> None:
        self.spec = spec
        self.url = spec.url
        self.state = LOADING
        self.checked = False  # the first probe's verdict is logged even when it is still `loading`
        self.admin_drain = False
        self.listed = True
        self.slots: dict[str, int] = {}  # sequence slots per model, read from its configs once it is ready
        self.scrape: Scrape | None = None
        self.queue_ms = 0.0
        self.placed = 0  # sessions placed here since its metrics page was last read
        self.placements = 0
        self.failovers = 0  # times its sessions were ended for it
        self.silent_since: float | None = None  # when the first unanswered probe was sent
        self.deadline: asyncio.TimerHandle | None = None  # then its sessions are ended, unless it answers first
        # gateway/stage_health.py's verdict, set by the registry: ready | loading | unresponsive | broken
        self.stages = LOADING
        self.stages_why = ""  # why not ready, in the stage watch's words (a broken stage not healed: why not)
        self.orphans: dict[int, None] = {}  # correlation IDs to END once it answers (ordered: the oldest first)
        self.ending: asyncio.Task[None] | None = None
        self.devices: dict[str, str] = {}  # where each stage model runs, or why it did not load (triton.devices)
        self._client: grpcaio.InferenceServerClient | None = None

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        """Made on first use, inside the event loop that uses it (a gRPC aio channel belongs to one loop)."""
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url, channel_args=PROBE_CHANNEL)
        return self._client

    async def close(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        if self.ending is not None:
            self.ending.cancel()
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()

    @property
    def draining(self) -> bool:
        return self.spec.drain or self.admin_drain or not self.listed

    def room(self, own_sessions: int) -> int | None:
        live = None if self.scrape is None else self.scrape.live
        return placement.room(self.slots, live, own_sessions, self.placed, self.spec.max_sessions)

    def candidate(self, own_sessions: int) -> Candidate:
        return Candidate(self.url, self.takes_sessions, self.room(own_sessions), self.queue_ms, own_sessions)

    @property
    def healthy(self) -> bool:
        """Ready, and every stage of it answered its probe (its entry model's readiness says nothing of a dead stub)."""
        return self.state == READY and self.stages == READY

    @property
    def takes_sessions(self) -> bool:
        return self.healthy and not self.draining

    def describe(self, own_sessions: int) -> EndpointHealth:
        live = None if self.scrape is None else self.scrape.live.get(placement.ENTRY)
        return {"endpoint": self.url, "state": self.state, "stages": self.stages,
                "stages_why": self.stages_why, "draining": self.draining, "devices": self.devices,
                "sessions": own_sessions,
                "server_sessions": None if live is None else int(live), "room": self.room(own_sessions),
                "queue_ms": round(self.queue_ms, 1)}


class EndpointHealth(TypedDict):
    """One Triton endpoint as /health (for key holders) and /admin show it."""

    endpoint: str
    state: str
    stages: str
    stages_why: str
    draining: bool
    sessions: int  # this gateway's on it
    server_sessions: int | None  # everyone's, as its metrics count them (None: not scraped yet)
    room: int | None  # sessions it can still take (None: not known yet)
    queue_ms: float
    devices: dict[str, str]  # model -> where it runs, or why it is not loaded (gateway/triton/devices.py)


class EndpointPool:
    """`sessions()` counts this gateway's live sessions per endpoint url (the registry is their one owner);
    `on_down(url)` ends those on an endpoint that stopped answering."""

    def __init__(self, triton_url: str, endpoints_file: str | None, failover_s: float,
                 sessions: Callable[[], Counter[str]], on_down: Callable[[str], None]) -> None:
        self._inline: str | None = triton_url
        self._file = Path(endpoints_file) if endpoints_file else None
        self._file_stamp: tuple[float, int] | None = None
        self.failover_s = failover_s
        self.probe_s = min(1.0, max(0.05, failover_s / 5))
        self._sessions = sessions
        self._on_down = on_down
        self.endpoints: dict[str, Endpoint] = {}
        self._http: httpx.AsyncClient | None = None
        self.reload(force=True)

    # ---- the list ----
    def _text(self) -> str | None:
        """The list's text; None when the file did not change since it was read."""
        if self._file is None:
            text, self._inline = self._inline, None  # read once: it cannot change
            return text
        stat = self._file.stat()
        stamp = (stat.st_mtime, stat.st_size)
        if stamp == self._file_stamp:
            return None
        self._file_stamp = stamp
        return self._file.read_text(encoding="utf-8")

    def reload(self, force: bool = False) -> None:
        """Take in the list: new endpoints join (loading until probed), drain flags follow it, and endpoints
        that left it drain. A list that does not parse (or a file that cannot be read) is logged and the
        last good one kept; at start it is an error."""
        try:
            text = self._text()
            if text is None:
                return
            specs = endpoints.parse(text)
            if not specs:
                raise ValueError("no Triton endpoint listed")
        except (OSError, ValueError) as exc:
            if force:
                raise
            log.error("the Triton endpoint list was not taken (%s); keeping the last one", exc)
            return
        listed = {spec.url: spec for spec in specs}
        for url, spec in listed.items():
            if url in self.endpoints:
                self.endpoints[url].spec = spec
                self.endpoints[url].listed = True
            else:
                self.endpoints[url] = Endpoint(spec)
                log.info("endpoint %s listed", url)
        for url, endpoint in self.endpoints.items():
            if url not in listed and endpoint.listed:
                endpoint.listed = False
                log.info("endpoint %s left the list: draining", url)

    # ---- placement ----
    @property
    def ready(self) -> bool:
        return any(e.takes_sessions for e in self.endpoints.values())

    @property
    def status(self) -> str:
        if self.ready:
            return "ready"
        return "draining" if any(e.healthy for e in self.endpoints.values()) else "loading"

    def place(self) -> Endpoint:
        """The endpoint a new session goes to; placement.NoEndpoint when none takes one."""
        on = self._sessions()
        chosen = placement.choose(e.candidate(on[e.url]) for e in self.endpoints.values())
        endpoint = self.endpoints[chosen.url]
        endpoint.placed += 1
        endpoint.placements += 1
        return endpoint

    def drain(self, url: str, on: bool) -> Endpoint:
        endpoint = self.endpoints[url]  # KeyError: not listed
        endpoint.admin_drain = on
        log.warning("endpoint %s: %s by the admin call", url, "draining" if on else "drain lifted")
        return endpoint

    def orphaned(self, url: str, corr_id: int) -> None:
        """A session on `url` ended without its sequence's END: it is ENDed once the endpoint answers."""
        endpoint = self.endpoints.get(url)
        if endpoint is None:
            return
        endpoint.orphans[corr_id] = None
        while len(endpoint.orphans) > MAX_ORPHANS:
            del endpoint.orphans[next(iter(endpoint.orphans))]

    async def _end_orphans(self, endpoint: Endpoint) -> None:
        for corr_id in list(endpoint.orphans):
            try:
                took = await end_everywhere(endpoint.client, corr_id)
            except Exception as exc:  # noqa: BLE001 (silent again: the rest waits for its next answer)
                log.info("endpoint %s: sequence %d not ended yet (%s)", endpoint.url, corr_id, type(exc).__name__)
                return
            endpoint.orphans.pop(corr_id, None)
            if took:
                log.info("endpoint %s: sequence %d ended on %s (its session could not)", endpoint.url, corr_id,
                         ", ".join(took))

    def suspect(self, url: str) -> None:
        """A session's stream to it broke: no new sessions there until it answers a probe again."""
        endpoint = self.endpoints.get(url)
        if endpoint is not None and endpoint.state != DOWN:
            endpoint.state = DOWN
            log.warning("endpoint %s: a session's stream broke; no new sessions there until it answers", url)

    # ---- watching ----
    async def run(self) -> None:
        self._http = httpx.AsyncClient(timeout=self.probe_s)
        try:
            while True:
                self.reload()
                await asyncio.gather(*(self._probe(e) for e in list(self.endpoints.values())))
                self._forget_drained()
                await asyncio.sleep(self.probe_s if self.ready else self.probe_s / 4)
        finally:
            await self.close()

    def _forget_drained(self) -> None:
        on = self._sessions()
        for url in [u for u, e in self.endpoints.items() if not e.listed and on[u] == 0]:
            endpoint = self.endpoints.pop(url)
            asyncio.get_running_loop().create_task(endpoint.close())
            log.info("endpoint %s: drained and forgotten", url)

    async def _probe(self, endpoint: Endpoint) -> None:
        sent = time.monotonic()
        try:
            ready = bool(await endpoint.client.is_model_ready(placement.ENTRY, client_timeout=self.probe_s))
        except Exception as exc:  # noqa: BLE001 (refused, timed out, reset: it does not answer)
            self._silent(endpoint, sent, f"does not answer ({type(exc).__name__})")
            return
        self._answered(endpoint)
        if not ready:
            self._set_state(endpoint, LOADING, f"the {placement.ENTRY} model is not ready (still loading, or failed "
                                               "to load)")
            endpoint.slots = {}  # its models may come back with other configs
            endpoint.devices = await devices.read(endpoint.client, "", self.probe_s)
            return
        try:
            if not endpoint.slots:
                endpoint.slots = await self._slots(endpoint)
            assert self._http is not None
            response = await self._http.get(endpoint.spec.metrics_url)
            response.raise_for_status()
            scrape = placement.parse_metrics(response.text)
            endpoint.devices = await devices.read(endpoint.client, response.text, self.probe_s)
            endpoint.queue_ms = placement.queue_ms(endpoint.scrape, scrape)
            endpoint.scrape, endpoint.placed = scrape, 0
        except Exception as exc:  # noqa: BLE001 (no metrics: room is judged from this gateway's own sessions)
            log.debug("endpoint %s: metrics not read: %s", endpoint.url, exc)
            endpoint.scrape = None
        self._set_state(endpoint, READY)
        if endpoint.orphans and (endpoint.ending is None or endpoint.ending.done()):
            endpoint.ending = asyncio.get_running_loop().create_task(self._end_orphans(endpoint))

    async def _slots(self, endpoint: Endpoint) -> dict[str, int]:
        slots = {}
        for model in placement.SEQUENCE_MODELS:
            config = (await endpoint.client.get_model_config(model, as_json=True, client_timeout=self.probe_s))
            oldest = config.get("config", {}).get("sequence_batching", {}).get("oldest", {})
            if "max_candidate_sequences" in oldest:
                slots[model] = int(oldest["max_candidate_sequences"])
        return slots

    def _silent(self, endpoint: Endpoint, since: float, why: str) -> None:
        """A probe sent at `since` went unanswered: no new sessions there; its sessions are ended once it has
        been silent for failover_s (a timer: the bound does not wait for the probes' cycle)."""
        self._set_state(endpoint, DOWN, why)
        endpoint.scrape, endpoint.slots = None, {}
        if endpoint.silent_since is None:
            endpoint.silent_since = since
            delay = max(0.0, since + self.failover_s - time.monotonic())
            endpoint.deadline = asyncio.get_running_loop().call_later(delay, self._fail_over, endpoint)

    def _answered(self, endpoint: Endpoint) -> None:
        endpoint.silent_since = None
        if endpoint.deadline is not None:
            endpoint.deadline.cancel()
            endpoint.deadline = None

    def _fail_over(self, endpoint: Endpoint) -> None:
        endpoint.deadline = None
        endpoint.failovers += 1
        log.error("endpoint %s: no answer for %.1f s: its sessions are ended (backend_unavailable)", endpoint.url,
                  self.failover_s)
        self._on_down(endpoint.url)

    @staticmethod
    def _set_state(endpoint: Endpoint, state: str, why: str = "") -> None:
        """Each change of an endpoint's state is logged once, with why it is not ready."""
        if endpoint.state != state or not endpoint.checked:
            endpoint.checked = True
            if state == READY:
                log.info("endpoint %s: %s -> ready: new sessions are placed there", endpoint.url, endpoint.state)
            else:
                log.warning("endpoint %s: %s -> %s: %s; no new sessions there", endpoint.url, endpoint.state, state,
                            why)
            endpoint.state = state

    async def close(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.close()
        if self._http is not None:
            await self._http.aclose()

    # ---- what /health shows (/metrics: gateway/metrics.py) ----
    def describe(self) -> list[EndpointHealth]:
        on = self._sessions()
        return [e.describe(on[e.url]) for e in self.endpoints.values()]

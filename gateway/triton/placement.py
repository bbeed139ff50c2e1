"""Where a new session goes (pure code): each Triton server's room, judged from its own metrics page and its
models' sequence slots, and the choice among them. A session stays where it is placed for its life: its state
(KV caches, the voice's flow cache) lives in that server's memory.

Room on a server: for each sequence-batched model, its slots (`max_candidate_sequences`: past them a new
sequence waits for one to end, which for a conversation means stalling) less its live sequences
(`minicpmo_<model>_live_sequences`), less the sessions placed since that page was read; and, where the operator set
one, its session bound (`sessions=N`, the GPU's memory) less its live sessions. The most room wins, among
the servers keeping up: one whose stages queue a request over half a duplex step is falling behind and
gets a session only when none keeps up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..codes import ClientCode

SEQUENCE_MODELS = ("duplex", "llm", "tts", "token2wav")  # a session holds a sequence in each while it lives
ENTRY = "duplex"  # one live sequence per session
QUEUE_LIMIT_MS = 500.0  # half of one duplex step (1 s of audio)
_SAMPLE = re.compile(r'^(\w+)\{(?:[^}]*,)?model="([\w-]+)"[^}]*\} ([-+\d.eE]+|NaN)$')
_LIVE = re.compile(r'^minicpmo_(\w+)_live_sequences(?:\{[^}]*\})? ([-+\d.eE]+|NaN)$')  # a stateful model's own gauge


def live_metric(model: str) -> str:
    """A stateful model's live sequences on Triton's metrics page (minicpmo_triton/serving/triton_models.py)."""
    return f"minicpmo_{model}_live_sequences"


class NoEndpoint(Exception):
    """No endpoint takes a new session now; `code` says why (both retryable)."""

    def __init__(self, code: ClientCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Scrape:
    """What one read of a server's metrics page says, per model."""

    live: Mapping[str, float]  # minicpmo_<model>_live_sequences
    queue_us: Mapping[str, float]  # nv_inference_queue_duration_us (a counter)
    requests: Mapping[str, float]  # nv_inference_request_success (a counter)


def parse_metrics(text: str) -> Scrape:
    live: dict[str, float] = {}
    found: dict[str, dict[str, float]] = {"nv_inference_queue_duration_us": {}, "nv_inference_request_success": {}}
    for line in text.splitlines():
        if (own := _LIVE.match(line)) is not None:
            live[own[1]] = live.get(own[1], 0.0) + float(own[2])
        elif (match := _SAMPLE.match(line)) is not None and match[1] in found:
            table = found[match[1]]
            table[match[2]] = table.get(match[2], 0.0) + float(match[3])  # summed over a model's versions
    return Scrape(live, found["nv_inference_queue_duration_us"], found["nv_inference_request_success"])


def queue_ms(before: Scrape | None, after: Scrape) -> float:
    """The worst model's mean queue time per request between two reads of the page (0 without a first read)."""
    if before is None:
        return 0.0
    worst = 0.0
    for model, total in after.queue_us.items():
        requests = after.requests.get(model, 0.0) - before.requests.get(model, 0.0)
        if requests > 0:
            worst = max(worst, (total - before.queue_us.get(model, 0.0)) / requests / 1000.0)
    return worst


def room(slots: Mapping[str, int], live: Mapping[str, float] | None, own_sessions: int, placed: int,
         max_sessions: int | None) -> int | None:
    """Sessions that still fit on a server; None when nothing bounds it that we know of. Without a metrics
    read (`live` None) this gateway's own sessions stand for the server's."""
    used = dict(live) if live is not None else dict.fromkeys(SEQUENCE_MODELS, float(own_sessions))
    bounds = [cap - int(used.get(model, 0.0)) - placed for model, cap in slots.items()]
    if max_sessions is not None:
        bounds.append(max_sessions - max(int(used.get(ENTRY, 0.0)), own_sessions) - placed)
    return min(bounds) if bounds else None


@dataclass(frozen=True)
class Candidate:
    url: str
    open: bool  # ready and not draining
    room: int | None
    queue_ms: float
    sessions: int  # this gateway's sessions there (the tie-break: spread our own)


def choose(candidates: Iterable[Candidate]) -> Candidate:
    """The open endpoint with the most room, those keeping up first; NoEndpoint when none takes a session."""
    open_ = [c for c in candidates if c.open]
    if not open_:
        raise NoEndpoint(ClientCode.NOT_READY, "no model server takes new sessions now (loading, draining or down)")
    fits = [c for c in open_ if c.room is None or c.room > 0]
    if not fits:
        raise NoEndpoint(ClientCode.TOO_MANY_SESSIONS, "every model server is full; retry later")
    unbounded = max((c.room for c in fits if c.room is not None), default=0) + 1
    return min(fits, key=lambda c: (c.queue_ms > QUEUE_LIMIT_MS, -(unbounded if c.room is None else c.room),
                                    c.sessions, c.url))

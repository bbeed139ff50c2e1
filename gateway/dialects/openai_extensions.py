"""What a client of the OpenAI dialect has opted into (pure code).

A client that connects to `/v1/realtime` as OpenAI's SDKs and the voice-agent frameworks do sees only the
spec: spec events, spec fields, spec values (`tests/test_openai_spec.py` checks every event type against the
`openai` package's models). MiniCPM-o's extensions are asked for on the URL, the one thing every framework lets
its user set and no stock client sends: `/v1/realtime?extensions=duplex,events` (either, or both).

- `duplex`: the model's own turns (it decides each second whether to speak). The session starts in duplex;
  `session.duplex` switches. A duplex session reports `audio.input.turn_detection: null` (no VAD cuts the
  caller's audio into turns, nothing is committed for the client) beside `duplex: true`; its responses come
  and go in spec events, as under server VAD, so a framework that takes a URL can run on it.
- `events`: the extension events (`response.speak | listen`, `overlap.decision`, `session.closed`, ...) and
  fields (`server_event_seq`, `capabilities` and `resume_token` on `session.created`, the session's vendor keys,
  the audio deltas' `metadata`, `status_details.cause`, `response.context_window`); resuming a session needs it.

A client event that is itself an extension (`playback.ack`, `session.heartbeat`, `session.close`,
`session.resume`) is answered whoever sends it: sending it is the opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codes import ClientCode
from ..wire import CLOSE_POLICY, ProtocolError
from .openai_objects import StatusDetails

QUERY = "extensions"  # the URL's query parameter
FEATURES = ("duplex", "events")

# response.done's `status_details.reason` is the spec's (`turn_detected | client_cancelled | max_output_tokens |
# content_filter`, or none); the cause in our words goes in `status_details.cause` (with `events`).
SPEC_REASONS = {"barge_in": "turn_detected", "client_cancelled": "client_cancelled",
                "output_cleared": "client_cancelled", "max_output_tokens": "max_output_tokens"}


@dataclass(frozen=True)
class Extensions:
    duplex: bool = False  # the model's own turns offered, and the session's first mode
    events: bool = False  # the extension events and fields; resume

    @classmethod
    def parse(cls, value: str | None) -> Extensions:
        """`?extensions=` as the URL gives it: a comma-separated list of FEATURES (none: the spec alone)."""
        if value is None:
            return cls()
        names = {name.strip() for name in value.split(",") if name.strip()}
        unknown = names - set(FEATURES)
        if unknown:
            raise ProtocolError(ClientCode.INVALID_VALUE, f"{QUERY} must list some of {', '.join(FEATURES)}; "
                                f"unknown: {', '.join(sorted(unknown))}", QUERY, close_code=CLOSE_POLICY)
        return cls(duplex="duplex" in names, events="events" in names)


STOCK = Extensions()
ALL = Extensions(duplex=True, events=True)


def status_details(status: str, cause: str | None, ext: Extensions) -> StatusDetails:
    """A finished response's `status_details`: the spec's reason for `cause` (none when the spec has no word for it,
    e.g. a session that ends), and `cause` itself for a client that opted into the extensions."""
    details: StatusDetails = {"type": status}
    reason = SPEC_REASONS.get(cause or "")
    if reason is not None:
        details["reason"] = reason
    if ext.events and cause is not None:
        details["cause"] = cause
    return details

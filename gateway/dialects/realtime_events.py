"""The envelope the two Realtime dialects (OpenAI's and MiniCPM-o's) share (pure code): client events
are JSON objects with a string `type`; server events carry an `event_id` (and, when sent, a
`server_event_seq`); errors are `{type: error, error: {type, code, message, param, event_id}}`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NotRequired, TypedDict

from ..codes import ClientCode
from ..wire import JsonObject, ProtocolError, new_id, parse_json
from .state import Closed, EventFields, Refusal

MAX_EVENT_BYTES = 15 << 20  # OpenAI's cap on one client event


def parse_event(text: str, bad_json_close: int | None) -> JsonObject:
    """A client event; `invalid_json` (closing with `bad_json_close`, if set) when it is not JSON at all."""
    if len(text) > MAX_EVENT_BYTES or (not text.isascii() and len(text.encode("utf-8")) > MAX_EVENT_BYTES):
        raise ProtocolError(ClientCode.EVENT_TOO_LARGE, f"an event may be at most {MAX_EVENT_BYTES >> 20} MiB")
    try:
        msg = parse_json(text)
    except ValueError as exc:  # not JSON, or past a limit (wire.JSON_MAX_*)
        raise ProtocolError(ClientCode.INVALID_JSON,
                            f"event is not valid JSON: {exc}", close_code=bad_json_close) from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError(ClientCode.INVALID_EVENT, "an event is a JSON object with a string `type`", "type")
    return msg


def event_id(msg: JsonObject) -> str | None:
    return msg["event_id"] if isinstance(msg.get("event_id"), str) else None


@contextlib.contextmanager
def answering(client_event_id: str | None) -> Iterator[None]:
    """A ProtocolError raised in the block names the client event it answers."""
    try:
        yield
    except ProtocolError as err:
        err.event_id = err.event_id or client_event_id
        raise


def name_refusals(events: list[Any], client_event_id: str | None) -> None:
    """An error among an event's answers (a part of it refused, the rest applied) names the client event too."""
    for ev in events:
        if isinstance(ev, Error) and ev.error.get("event_id") is None:
            ev.error["event_id"] = client_event_id


class RealtimeEvent(EventFields):
    """`type`, an `event_id`, then the fields. `server_event_seq` is added when sent."""

    def encode(self) -> dict[str, Any]:
        return {"type": self.type, "event_id": new_id("event"), **self.fields()}


class ErrorObject(TypedDict):
    """An `error` event's `error`, as the spec types it (`param`, `event_id`: null allowed)."""

    type: str
    code: str
    message: str
    param: str | None
    event_id: str | None
    retryable: NotRequired[bool]  # extension: the same request may succeed later
    redirect_url: NotRequired[str]  # extension: the gateway that holds the session (a resume)


class Error(RealtimeEvent, Refusal, type="error"):
    error: ErrorObject


class SessionEvent(RealtimeEvent):
    """An event about the session as a whole, named by its id."""

    session_id: str


# What the shell tells one socket when a session is resumed (per attachment: not journaled).
Replaced = SessionEvent.retyped("Replaced", "session.replaced")  # to the socket another one took over from


class ResyncRequired(SessionEvent, type="session.resync_required"):
    reason: str  # journal_gap: what the client missed is no longer held
    resume_token: str


class Resumed(SessionEvent, type="session.resumed"):
    resume_token: str
    replayed: int  # server events sent again, in order, right after this one


class SessionClosed(RealtimeEvent, Closed):
    pass


def error_event(err: ProtocolError) -> Error:
    error: ErrorObject = {"type": err.error_type, "code": err.code, "message": err.message, "param": err.param,
                          "event_id": err.event_id}
    if err.retryable:
        error["retryable"] = True
    if err.redirect_url:
        error["redirect_url"] = err.redirect_url
    return Error(error)


def closed_event(session_id: str, reason: str, usage: dict[str, int], message: str | None) -> SessionClosed:
    return SessionClosed(session_id, reason, usage, {"message": message} if message else None)

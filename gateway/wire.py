"""What every dialect shares on the wire: close codes, the one client-error type, ids and usage (pure code)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .codes import ClientCode

# A JSON object as parsed from a client: opaque until a parse function reads its fields into typed values (a
# dialect's client event; `session.update`'s `session`, read field by field by `openai_config`).
JsonObject = dict[str, Any]

# WebSocket close codes
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server shutdown
CLOSE_UNSUPPORTED_DATA = 1003  # not JSON
CLOSE_POLICY = 1008  # a protocol violation by the client
CLOSE_SERVER_ERROR = 1011
CLOSE_TRY_AGAIN = 1013  # not ready, or no session slot


class ProtocolError(Exception):
    """A client error, answered with the dialect's `error` event; `close_code` set when the socket closes too.
    `param` and `error_type` are what the Realtime dialects report beside the code; `http_status` what an
    HTTP endpoint answers with it (else 400)."""

    def __init__(self, code: ClientCode, message: str, param: str | None = None, close_code: int | None = None,
                 error_type: str = "invalid_request_error", retryable: bool = False,
                 http_status: int | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable  # the same request may succeed later (a new session, after a backoff)
        self.code = ClientCode(code)  # a string that is no member fails here, where it is raised
        self.message = message
        self.param = param
        self.close_code = close_code
        self.error_type = error_type
        self.http_status = http_status
        self.event_id: str | None = None  # the client event it answers (the Realtime dialects report it)
        self.redirect_url: str | None = None  # session_elsewhere: where the session is (gateway.peers)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def new_session_id() -> str:
    return f"sess_{uuid.uuid4().hex[:12]}"


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex[:12]}"


USAGE_KEYS = ("input_text_tokens", "input_audio_tokens", "input_vision_tokens", "output_text_tokens",
              "output_speech_tokens")


@dataclass
class Usage:
    """Token counts as the stages report them, summed."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE_KEYS, 0))

    def add(self, chunk: dict[str, int]) -> dict[str, int]:
        for key in USAGE_KEYS:
            self.counts[key] += int(chunk.get(key, 0))
        return self.snapshot()

    def snapshot(self) -> dict[str, int]:
        snap = dict(self.counts)
        snap["total_tokens"] = sum(self.counts.values())
        return snap


# ---- JSON limits: every client frame is parsed here, by every dialect ----
JSON_MAX_DEPTH = 32  # arrays/objects inside one another; no event of any dialect needs more than 6
JSON_MAX_NUMBER_CHARS = 100  # characters of one number literal (a float64 needs under 25)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _number(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(literal: str) -> Any:
        if len(literal) > JSON_MAX_NUMBER_CHARS:
            raise ValueError(f"a number of {len(literal)} characters (at most {JSON_MAX_NUMBER_CHARS})")
        return kind(literal)
    return parse


def _check_tree(value: Any) -> None:
    """Depth and text: no deeper than JSON_MAX_DEPTH, no lone UTF-16 surrogate in a string (`"\\ud800"` is
    accepted by Python's parser but is not Unicode text: it would fail later, where it is encoded)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise ValueError("a string holds a lone UTF-16 surrogate (not Unicode text)")
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= JSON_MAX_DEPTH:
            raise ValueError(f"nested deeper than {JSON_MAX_DEPTH} levels")
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)


def json_object(message: JsonObject, key: str) -> JsonObject:
    """`message[key]` when it is a JSON object, else an empty one (absent, null, or another type)."""
    value = message.get(key)
    return value if isinstance(value, dict) else {}


def parse_json(text: str | bytes) -> Any:
    """A client frame's JSON within the limits above; ValueError (its message for the client) otherwise.
    The parser's own recursion guard stops very deep input early (RecursionError, reported as too deep);
    a frame's size is bounded before it gets here (the server's `ws_max_size`)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        # NaN and Infinity pass (Python's reading of them): the settings' range checks refuse them by name.
        value = json.loads(text, parse_int=_number(int), parse_float=_number(float))
    except RecursionError:
        raise ValueError(f"nested deeper than {JSON_MAX_DEPTH} levels") from None
    _check_tree(value)
    return value

"""What every dialect shares on the wire: close codes, the one client-error type, ids and usage (pure code)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

# WebSocket close codes
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server shutdown
CLOSE_UNSUPPORTED_DATA = 1003  # not JSON
CLOSE_POLICY = 1008  # a protocol violation by the client
CLOSE_SERVER_ERROR = 1011
CLOSE_TRY_AGAIN = 1013  # not ready, or no session slot


class ProtocolError(Exception):
    """A client error, answered with the dialect's `error` event; `close_code` set when the socket closes too.
    `param` and `error_type` are what the Realtime dialects report beside the code."""

    def __init__(self, code: str, message: str, param: str | None = None, close_code: int | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.close_code = close_code
        self.error_type = error_type
        self.event_id: str | None = None  # the client event it answers (the Realtime dialects report it)


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

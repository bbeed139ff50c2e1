"""Server events and errors in the OpenAI Realtime envelope (pure code)."""

from __future__ import annotations

import uuid
from typing import Any

MAX_EVENT_BYTES = 15 << 20  # OpenAI's cap on one client event


class RealtimeError(Exception):
    """A client error: answered with an `error` event; `close_code` set when the socket must close too."""

    def __init__(self, code: str, message: str, param: str | None = None, close_code: int | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.close_code = close_code
        self.error_type = error_type


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def server_event(event_type: str, **fields: Any) -> dict[str, Any]:
    """`type`, an `event_id`, then the fields (None left out). `server_event_seq` is added when sent."""
    out: dict[str, Any] = {"type": event_type, "event_id": new_id("event")}
    out.update({k: v for k, v in fields.items() if v is not None})
    return out


def error_event(err: RealtimeError, client_event_id: str | None = None) -> dict[str, Any]:
    return server_event("error", error={
        "type": err.error_type, "code": err.code, "message": err.message, "param": err.param,
        "event_id": client_event_id})


def usage_block(counts: dict[str, int]) -> dict[str, Any]:
    """The stages' token counts in OpenAI's `usage` shape."""
    text_in, audio_in = counts.get("input_text_tokens", 0), counts.get("input_audio_tokens", 0)
    image_in = counts.get("input_vision_tokens", 0)
    text_out, audio_out = counts.get("output_text_tokens", 0), counts.get("output_speech_tokens", 0)
    return {
        "total_tokens": text_in + audio_in + image_in + text_out + audio_out,
        "input_tokens": text_in + audio_in + image_in,
        "output_tokens": text_out + audio_out,
        "input_token_details": {"text_tokens": text_in, "audio_tokens": audio_in, "image_tokens": image_in,
                                "cached_tokens": 0},
        "output_token_details": {"text_tokens": text_out, "audio_tokens": audio_out},
    }

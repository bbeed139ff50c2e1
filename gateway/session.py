"""A full-duplex session's protocol state, as pure code: step events in, protocol events out.

It assigns `response_id`s (one per spoken turn), accumulates usage from the stages' own counts,
and shapes `response.output.delta` events the way the reference backend does.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from .audio import OUTPUT_RATE, encode_f32_base64
from .protocol import event
from .triton_stream import StepEvent

USAGE_KEYS = ("input_text_tokens", "input_audio_tokens", "input_vision_tokens", "output_text_tokens",
              "output_speech_tokens")


def new_session_id() -> str:
    return f"sess_{uuid.uuid4().hex[:12]}"


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex[:12]}"


@dataclass
class Usage:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE_KEYS, 0))

    def add(self, chunk: dict[str, int]) -> dict[str, int]:
        for key in USAGE_KEYS:
            self.counts[key] += int(chunk.get(key, 0))
        return self.snapshot()

    def snapshot(self) -> dict[str, int]:
        snap = dict(self.counts)
        snap["total_tokens"] = sum(self.counts.values())
        return snap


@dataclass
class DuplexProtocolState:
    session_id: str
    mode: str = "full_duplex"
    usage: Usage = field(default_factory=Usage)
    chunk_index: int = 0
    active_response_id: str | None = None

    def created(self) -> dict[str, Any]:
        return event("session.created", session_id=self.session_id, mode=self.mode,
                     metrics={"backend": "triton", "kv_cache_length": 0}, usage=self.usage.snapshot())

    def closed(self, reason: str, message: str | None = None) -> dict[str, Any]:
        return event("session.closed", session_id=self.session_id, reason=reason, usage=self.usage.snapshot(),
                     diagnostic={"message": message} if message else None)

    def on_step_event(self, input_id: str | None, ev: StepEvent) -> dict[str, Any]:
        """Map one step event (not `error`) to its `response.output.delta`."""
        fields: dict[str, Any] = {"session_id": self.session_id, "input_id": input_id, "metrics": ev.metrics}
        if ev.chunk_usage is not None:  # the step's last event carries its usage
            usage = self.usage.add(ev.chunk_usage)
            fields.update(chunk_index=self.chunk_index, chunk_usage=ev.chunk_usage, usage=usage)
            self.chunk_index += 1
        if ev.kind == "listen":
            fields["response_id"] = self.active_response_id
            if ev.end_of_turn:
                fields["end_of_turn"] = True
            self.active_response_id = None
            return event("response.output.delta", kind="listen", **fields)
        if self.active_response_id is None:
            self.active_response_id = new_response_id()
        fields["response_id"] = self.active_response_id
        if ev.kind == "text":
            return event("response.output.delta", kind="text", text=ev.text, **fields)
        if ev.kind == "audio":
            return event("response.output.delta", kind="audio", audio=encode_f32_base64(ev.audio),
                         sample_rate=OUTPUT_RATE, audio_samples=len(ev.audio), **fields)
        raise ValueError(f"unexpected step event kind {ev.kind!r}")

    def on_chat_event(self, turn_input_id: str | None, response_id: str, ev: StepEvent,
                      streaming: bool, audio: str | None = None) -> dict[str, Any] | None:
        """A turn_based turn: deltas when streaming, then `response.done` (with the audio when not)."""
        if ev.kind == "done":
            usage = self.usage.add(ev.chunk_usage or {})
            return event("response.done", session_id=self.session_id, response_id=response_id, input_id=turn_input_id,
                         text=ev.text, audio=None if streaming else audio, reason=ev.reason, metrics=ev.metrics,
                         chunk_usage=ev.chunk_usage, usage=usage)
        if not streaming:
            return None
        fields: dict[str, Any] = {"session_id": self.session_id, "response_id": response_id, "input_id": turn_input_id,
                                  "metrics": ev.metrics}
        if ev.kind == "text":
            return event("response.output.delta", kind="text", text=ev.text, **fields)
        return event("response.output.delta", kind="audio", audio=encode_f32_base64(ev.audio),
                     sample_rate=OUTPUT_RATE, audio_samples=len(ev.audio), **fields)

    def context_accepted(self, input_id: str | None, operation_id: str | None, kind: str, respond: bool) -> dict:
        return event("input.context.accepted", session_id=self.session_id, input_id=input_id,
                     operation_id=operation_id, context_kind=kind, respond=respond)

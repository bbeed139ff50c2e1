"""MiniCPM-o's own Realtime dialect (`/v1/realtime?mode=audio|video`) as a state machine (pure code).

`session.update {session: {instructions, ref_audio, tts_ref_audio, max_slice_nums, voice_config}}` opens
the session (answered by `session.created {session_id, prompt_length}`); each
`input_audio_buffer.append {audio (base64 float32 16 kHz), video_frames, force_listen, max_slice_nums}`
is one duplex step, answered by `response.output_audio.delta {text, audio, end_of_turn, kv_cache_length}`
(text first, its audio after, as the model makes them) or `response.listen {kv_cache_length}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minicpmo_triton.duplex_options import DEFAULT_SYSTEM_PROMPT, DuplexOptions, InvalidOptions

from ..audio import encode_f32_base64
from ..protocol import CLOSE_POLICY, ProtocolError, parse_input_append, voice_ref
from ..triton_stream import StepEvent, StepRequest
from .engine import Effects, EngineState, PlannedStep
from .events import RealtimeError, error_event, server_event

MODES = ("audio", "video")


def _client_error(exc: ProtocolError) -> RealtimeError:
    return RealtimeError(exc.code, exc.message, close_code=exc.close_code, error_type="client_error")


@dataclass
class MiniCPMRealtimeState(EngineState):
    mode: str = "audio"
    instructions: str = DEFAULT_SYSTEM_PROMPT
    model: dict[str, Any] = field(default_factory=dict)
    configured: bool = False
    kv_length: int = 0

    def options(self) -> DuplexOptions:
        return DuplexOptions.from_config({**self.model, "system_prompt": self.instructions})

    def created(self) -> list[dict[str, Any]]:
        return []  # session.created answers the client's session.update

    def on_client(self, msg: dict[str, Any]) -> Effects:
        kind = msg["type"]
        if kind == "session.update":
            return self._configure(msg.get("session"))
        if not self.configured:
            raise RealtimeError("not_ready", "send session.update first", "type", error_type="client_error")
        if kind == "input_audio_buffer.append":
            try:
                step = parse_input_append({"input": {k: v for k, v in msg.items() if k != "type"}})
            except ProtocolError as exc:
                raise _client_error(exc) from exc
            if step.frames and self.mode != "video":
                raise RealtimeError("invalid_payload", "video_frames need ?mode=video", "video_frames",
                                    error_type="client_error")
            req = StepRequest(audio=step.audio, force_listen=step.force_listen, frames=step.frames,
                              max_slice_nums=step.max_slice_nums if step.frames else [])
            return Effects(steps=[PlannedStep("duplex", req, self.epoch)])
        if kind == "session.close":
            return Effects(close=str(msg.get("reason") or "stopped"))
        if kind == "session.heartbeat":
            return Effects()
        raise RealtimeError("unknown_event", f"unknown event type {kind!r}", "type", error_type="client_error")

    def _configure(self, session: Any) -> Effects:
        if self.configured:
            raise RealtimeError("invalid_payload", "the session is configured once, at its start", "session",
                                error_type="client_error")
        session = session if isinstance(session, dict) else {}
        instructions = session.get("instructions") or session.get("system_prompt")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise RealtimeError("invalid_payload", "instructions must be a string", "session.instructions",
                                    error_type="client_error")
            self.instructions = instructions
        voice_config = session.get("voice_config") if isinstance(session.get("voice_config"), dict) else {}
        self.model = {**(session.get("config") if isinstance(session.get("config"), dict) else {}), **voice_config}
        try:
            self.options()
            self.voice = {name: voice_ref(name, session[name], CLOSE_POLICY)
                          for name in ("ref_audio", "tts_ref_audio") if session.get(name) is not None}
        except InvalidOptions as exc:
            raise RealtimeError("invalid_payload", str(exc), "session", error_type="client_error") from exc
        except ProtocolError as exc:
            raise _client_error(exc) from exc
        self.configured = True
        prompt_length = len(self.instructions.encode("utf-8"))  # bytes: the tiny model's tokens
        return Effects([server_event("session.created", session_id=self.session_id, mode=self.mode,
                                     prompt_length=prompt_length)])

    def on_step_event(self, step: PlannedStep, ev: StepEvent) -> Effects:
        if self.is_stale(step, ev):
            return Effects()
        self.kv_length = int(ev.metrics.get("kv_cache_length", self.kv_length))
        if ev.kind == "listen":
            return Effects([server_event("response.listen", kv_cache_length=self.kv_length,
                                         end_of_turn=ev.end_of_turn or None)])
        audio = encode_f32_base64(ev.audio) if ev.kind == "audio" else ""
        return Effects([server_event("response.output_audio.delta", text=ev.text, audio=audio,
                                     end_of_turn=ev.end_of_turn, kv_cache_length=self.kv_length)])

    def on_step_error(self, step: PlannedStep, code: str, message: str) -> Effects:
        return Effects([error_event(RealtimeError(code, message, error_type="client_error"))])

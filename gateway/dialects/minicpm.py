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

from minicpmo_triton.duplex_contract import StepEvent, StepInput
from minicpmo_triton.rules.duplex_options import DEFAULT_SYSTEM_PROMPT, DuplexOptions, InvalidOptions

from ..audio import encode_f32_base64
from ..codes import ClientCode
from ..inputs import InputAppend, parse_append, voice_ref
from ..limits import Limits
from ..wire import CLOSE_POLICY, CLOSE_UNSUPPORTED_DATA, ProtocolError, json_object
from .realtime_events import (
    RealtimeEvent,
    SessionEvent,
    answering,
    closed_event,
    error_event,
    event_id,
    parse_event,
)
from .state import DialectState, Effects, PlannedStep, ServerEvent

MODES = ("audio", "video")


# ---- server events ----

class Queued(RealtimeEvent, type="session.queued"):
    """Where a caller waiting for a slot stands (`session.queued` first, then `session.queue_update`)."""

    position: int
    queue_length: int
    ticket_id: str
    estimated_wait_s: float


QueueUpdate = Queued.retyped("QueueUpdate", "session.queue_update")


QueueDone = SessionEvent.retyped("QueueDone", "session.queue_done")  # a slot is the caller's: its session's id


class SessionCreated(SessionEvent, type="session.created"):
    mode: str
    prompt_length: int


class Listen(RealtimeEvent, type="response.listen"):
    kv_cache_length: int
    end_of_turn: bool | None = None


class OutputAudioDelta(RealtimeEvent, type="response.output_audio.delta"):
    text: str
    audio: str  # base64 float32 24 kHz
    end_of_turn: bool
    kv_cache_length: int


def queue_position(first: bool, position: int, queue_length: int, ticket_id: str, estimated_wait_s: float) -> Queued:
    return (Queued if first else QueueUpdate)(position, queue_length, ticket_id, estimated_wait_s)


def _client_error(exc: ProtocolError) -> ProtocolError:
    exc.error_type = "client_error"
    return exc


# ---- client events ----

@dataclass(frozen=True)
class SessionUpdate:
    session: Any  # {instructions, ref_audio, tts_ref_audio, config, voice_config}, checked when applied


@dataclass(frozen=True)
class SessionClose:
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    pass


ClientEvent = SessionUpdate | InputAppend | SessionClose | Heartbeat  # InputAppend: input_audio_buffer.append


@dataclass(frozen=True)
class Unreadable:
    """An event whose body could not be read: refused once the state has had its say (`not_ready` first)."""

    error: ProtocolError


@dataclass(frozen=True)
class ReadEvent:
    kind: str  # its `type`
    event: ClientEvent | Unreadable
    event_id: str | None


def read_event(msg: dict[str, Any], limits: Limits | None = None) -> ReadEvent:
    """A client event with its audio and images decoded (the CPU work, before the state is touched)."""
    try:
        event: ClientEvent | Unreadable = decode_client(msg, limits)
    except ProtocolError as err:
        event = Unreadable(err)
    return ReadEvent(msg["type"], event, event_id(msg))


def decode_client(msg: dict[str, Any], limits: Limits | None = None) -> ClientEvent:
    kind = msg["type"]
    if kind == "session.update":
        return SessionUpdate(msg.get("session"))
    if kind == "input_audio_buffer.append":
        try:
            return parse_append({k: v for k, v in msg.items() if k != "type"}, limits)
        except ProtocolError as exc:
            raise _client_error(exc) from None
    if kind == "session.close":
        return SessionClose(str(msg.get("reason") or "stopped"))
    if kind == "session.heartbeat":
        return Heartbeat()
    raise ProtocolError(ClientCode.UNKNOWN_EVENT, f"unknown event type {kind!r}", "type", error_type="client_error")


@dataclass
class MiniCPMRealtimeState(DialectState[None]):
    dialect = "minicpm"
    mode: str = "audio"
    instructions: str = DEFAULT_SYSTEM_PROMPT
    model: dict[str, object] = field(default_factory=dict)  # DuplexOptions' keys, as the client set them
    configured: bool = False
    kv_length: int = 0

    def options(self) -> DuplexOptions:
        return DuplexOptions.from_config({**self.model, "system_prompt": self.instructions})

    def created(self) -> list[ServerEvent]:
        return []  # session.created answers the client's session.update

    def read_frame(self, text: str, plan: None) -> ReadEvent:
        return read_event(parse_event(text, CLOSE_UNSUPPORTED_DATA), self.limits)  # not JSON: the socket closes

    def on_client(self, msg: dict[str, Any]) -> Effects:
        """A client event as a JSON object, read and decided at once (tests)."""
        return self.on_frame(read_event(msg, self.limits))

    def error_event(self, err: ProtocolError) -> ServerEvent:
        return error_event(err)

    def on_frame(self, read: ReadEvent) -> Effects:
        with answering(read.event_id):
            return self._decide(read)

    def _decide(self, read: ReadEvent) -> Effects:
        if read.kind not in ("session.update", "session.close") and not self.configured:  # leaving is allowed
            raise ProtocolError(ClientCode.NOT_READY, "send session.update first", "type", error_type="client_error")
        event = read.event
        if isinstance(event, Unreadable):
            raise event.error
        if isinstance(event, SessionUpdate):
            return self._configure(event.session)
        if isinstance(event, InputAppend):
            if event.frames and self.mode != "video":
                raise ProtocolError(ClientCode.INVALID_PAYLOAD, "video_frames need ?mode=video", "video_frames",
                                    error_type="client_error")
            req = StepInput(audio=event.audio, force_listen=event.force_listen, frames=event.frames,
                            max_slice_nums=event.max_slice_nums if event.frames else [])
            return Effects(steps=[PlannedStep("duplex", req, self.epoch)])
        if isinstance(event, SessionClose):
            return Effects(close=event.reason)
        return Effects()  # a heartbeat

    def _configure(self, session: Any) -> Effects:
        if self.configured:
            raise ProtocolError(ClientCode.INVALID_PAYLOAD, "the session is configured once, at its start", "session",
                                error_type="client_error")
        session = session if isinstance(session, dict) else {}
        instructions = session.get("instructions") or session.get("system_prompt")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise ProtocolError(ClientCode.INVALID_PAYLOAD, "instructions must be a string", "session.instructions",
                                    error_type="client_error")
            self.instructions = self.limits.prompt(instructions, "session.instructions")
        voice_config = json_object(session, "voice_config")
        self.model = {**json_object(session, "config"), **voice_config}
        try:
            self.options()
            self.voice = {name: voice_ref(name, session[name], CLOSE_POLICY)
                          for name in ("ref_audio", "tts_ref_audio") if session.get(name) is not None}
            for ref in self.voice.values():
                self.charge_voice(ref)
        except InvalidOptions as exc:
            # the init's ranges: refused, the session waits for a valid session.update
            raise ProtocolError(ClientCode.INVALID_CONFIG, str(exc), "session", error_type="client_error") from exc
        except ProtocolError as exc:
            raise _client_error(exc) from None
        self.configured = True
        prompt_length = len(self.instructions.encode("utf-8"))  # bytes: the tiny model's tokens
        return Effects([SessionCreated(self.session_id, self.mode, prompt_length)])

    def on_step_event(self, step: PlannedStep[None], ev: StepEvent) -> Effects:
        if self.is_stale(step, ev):
            return Effects()
        if ev.metrics.kv_cache_length is not None:
            self.kv_length = int(ev.metrics.kv_cache_length)
        if ev.kind == "listen":
            return Effects([Listen(self.kv_length, ev.end_of_turn or None)])
        audio = encode_f32_base64(ev.audio) if ev.kind == "audio" else ""
        return Effects([OutputAudioDelta(ev.text, audio, ev.end_of_turn, self.kv_length)])

    def on_close(self, reason: str, message: str | None) -> list[ServerEvent]:
        return [closed_event(self.session_id, reason, self.usage.snapshot(), message)]

"""`/backend`, the MiniCPM-o backend protocol, as a dialect of the session engine (pure code).

`session.init` (the first frame) makes a `SessionInit`; each later frame is an `InputAppend` (one duplex
step), an `InputContext` or, in `turn_based` mode, a `ChatTurn`; `BackendState` turns them into planned
steps and the steps' events into `response.output.delta` / `response.done` events. It assigns
`response_id`s (one per spoken turn) and accumulates usage from the stages' own counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minicpmo_triton.duplex_contract import (
    CHAT_MAX_SLICE_NUMS,
    ChatInput,
    ChatMessage,
    Context,
    StepEvent,
    StepInput,
)
from minicpmo_triton.rules.duplex_options import DuplexOptions, InvalidOptions

from ..audio import INPUT_RATE, OUTPUT_RATE, AudioDecodeError, decode_f32_base64, encode_f32_base64
from ..codes import ClientCode
from ..inputs import InputAppend, as_object, first, image_bytes, parse_append, slices, voice_ref
from ..limits import Limits, identifier
from ..wire import CLOSE_POLICY, CLOSE_UNSUPPORTED_DATA, ProtocolError, json_object, new_response_id, parse_json
from .state import Closed, DialectState, Effects, EventFields, PlannedStep, Refusal, ServerEvent

MODES = ("full_duplex", "turn_based")
CHAT_ROLES = ("system", "user", "assistant", "tool")


# ---- client events ----
@dataclass(frozen=True)
class SessionInit:
    mode: str
    system_prompt: str | None
    config: dict[str, object]  # DuplexOptions' keys as the client set them (`init_options` reads them)
    ref_audio_base64: str | None = None
    tts_ref_audio_base64: str | None = None
    voice_name: str = ""  # `voice.name`: a named voice of the model server's voice folder


@dataclass(frozen=True)
class InputContext:
    input_id: str | None
    text: str
    kind: str = "tool_result"
    operation_id: str | None = None
    respond: bool = True


@dataclass(frozen=True)
class ChatTurn:
    """A turn_based `input.append`: the conversation so far, and how to answer it."""

    input_id: str | None
    messages: list[ChatMessage]
    streaming: bool = True
    generate_audio: bool = False
    max_new_tokens: int = 256
    tts_ref_audio: np.ndarray | None = None  # this turn's voice (16 kHz), else the session's


ClientMessage = InputAppend | InputContext | ChatTurn


def loads(text: str | bytes) -> dict[str, Any]:
    try:
        data = parse_json(text)
    except ValueError as exc:  # not JSON, or past a limit (wire.JSON_MAX_*)
        raise ProtocolError(ClientCode.INVALID_JSON, f"message is not valid JSON: {exc}",
                            close_code=CLOSE_UNSUPPORTED_DATA) from exc
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "message must be a JSON object with a string `type`",
                            close_code=CLOSE_POLICY)
    return data


def parse_init(message: dict[str, Any], limits: Limits | None = None) -> SessionInit:
    if message["type"] != "session.init":
        raise ProtocolError(ClientCode.INVALID_FIRST_MESSAGE,
                            f"the first message must be session.init, got {message['type']!r}",
                            close_code=CLOSE_POLICY)
    payload = message.get("payload")
    if not isinstance(payload, dict):
        raise ProtocolError(ClientCode.MISSING_FIELD,
                            "session.init must carry an object `payload`", close_code=CLOSE_POLICY)
    mode = payload.get("mode") or "full_duplex"
    if mode not in MODES:
        raise ProtocolError(ClientCode.INVALID_MODE, f"mode must be one of {', '.join(MODES)}", close_code=CLOSE_POLICY)
    prompt = first(payload.get("system_prompt"), payload.get("instructions"))
    if prompt is not None and not isinstance(prompt, str):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "system_prompt must be a string", close_code=CLOSE_POLICY)
    if prompt is not None:
        (limits or Limits.default()).prompt(prompt, "system_prompt", CLOSE_POLICY)
    config = first(payload.get("config"), payload.get("duplex")) or {}
    if not isinstance(config, dict):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "config must be an object", close_code=CLOSE_POLICY)
    voice = first(payload.get("voice"), payload.get("defaults")) or {}
    if not isinstance(voice, dict):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "voice must be an object", close_code=CLOSE_POLICY)
    init = SessionInit(
        mode=mode,
        system_prompt=prompt,
        config=config,
        ref_audio_base64=first(payload.get("ref_audio_base64"), voice.get("ref_audio_base64"), voice.get("ref_audio")),
        tts_ref_audio_base64=first(payload.get("tts_ref_audio_base64"), voice.get("tts_ref_audio_base64"),
                                    voice.get("tts_ref_audio")),
        voice_name=voice_name(voice.get("name")),
    )
    voice_refs(init)  # refused now, not at the first step
    return init


def voice_name(value: Any) -> str:
    """A named voice: a short name (the model server maps it to a file of its voice folder), else refused."""
    return "" if value is None else identifier(value, "voice.name", ClientCode.INVALID_VOICE, CLOSE_POLICY)


def voice_refs(init: SessionInit) -> dict[str, np.ndarray]:
    """The session's voice references as 16 kHz float32, within VOICE_SECONDS (else `invalid_voice`)."""
    refs = (("ref_audio", init.ref_audio_base64), ("tts_ref_audio", init.tts_ref_audio_base64))
    return {name: voice_ref(name, data, CLOSE_POLICY) for name, data in refs if data is not None}


def init_options(init: SessionInit) -> DuplexOptions:
    try:
        return DuplexOptions.from_config(
            {**init.config, **({"system_prompt": init.system_prompt} if init.system_prompt else {})})
    except InvalidOptions as exc:
        raise ProtocolError(ClientCode.INVALID_CONFIG, str(exc), close_code=CLOSE_POLICY) from exc


def parse_input_append(message: dict[str, Any], limits: Limits) -> ClientMessage:
    payload = as_object(message.get("input"), "input.append's `input`")
    if isinstance(payload.get("context"), dict) and payload["context"].get("text"):
        return parse_input_context({"input_id": payload.get("input_id"), "context": payload["context"]}, limits)
    return parse_append(payload, limits)


def parse_input_context(message: dict[str, Any], limits: Limits) -> InputContext:
    context = as_object(message.get("context"), "input.context's `context`")
    text = context.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ProtocolError(ClientCode.MISSING_FIELD, "input.context requires a non-empty context.text")
    limits.text(text, "context.text")
    input_id = message.get("input_id")
    return InputContext(
        input_id=str(input_id) if input_id is not None else None,
        text=text.strip(),
        kind=identifier(context.get("kind") or "tool_result", "context.kind"),
        operation_id=context.get("operation_id"),
        respond=bool(context.get("respond", True)),
    )


def _chat_message(raw: Any, max_slice_nums: int, limits: Limits) -> ChatMessage:
    m = as_object(raw, "each message")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, f"message role must be one of {', '.join(CHAT_ROLES)}")
    content = m.get("content", "")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "message content must be a string or a list of parts")
    text, audio, images = [], m.get("audio"), []
    for part in parts:
        part = as_object(part, "each content part")
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("audio", "input_audio"):
            audio = first(part.get("audio"), part.get("data"), part.get("audio_base64"))
        elif kind in ("image", "image_url", "input_image"):
            data = first(part.get("image"), part.get("data"), part.get("base64"), part.get("image_url"))
            if isinstance(data, dict):
                data = data.get("url")
            if isinstance(data, str) and data.startswith("data:"):
                data = data.split(",", 1)[-1]  # a data URL
            if not isinstance(data, str):
                raise ProtocolError(ClientCode.BAD_IMAGE, "image content must be base64 (or a base64 data URL)")
            images.append(image_bytes(data))
        else:
            raise ProtocolError(ClientCode.INVALID_PAYLOAD, f"unknown content part {kind!r}")
    if audio is not None:
        if not isinstance(audio, str):
            raise ProtocolError(ClientCode.BAD_AUDIO, "message audio must be base64 float32 16 kHz")
        try:
            audio = decode_f32_base64(audio, limits.audio_samples(INPUT_RATE))
        except AudioDecodeError as exc:
            raise ProtocolError(ClientCode.BAD_AUDIO, str(exc)) from exc
    limits.images(images, "messages.content")
    return ChatMessage(role, limits.text("".join(text), "messages.content"), audio, tuple(images), max_slice_nums)


def parse_chat_turn(message: dict[str, Any], limits: Limits) -> ChatTurn:
    payload = as_object(message.get("input"), "input.append's `input`")
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError(ClientCode.MISSING_FIELD, "turn_based input.append requires a non-empty `messages` list")
    generation = payload.get("generation") or {}
    tts = payload.get("tts") or {}
    if not isinstance(generation, dict) or not isinstance(tts, dict):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "generation and tts must be objects")
    max_new = first(payload.get("max_new_tokens"), generation.get("max_new_tokens"), 256)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or not 1 <= max_new <= 4096:
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "max_new_tokens must be an integer 1..4096")
    input_id = payload.get("input_id")
    image_opts = json_object(payload, "image")
    chosen = first(payload.get("max_slice_nums"), image_opts.get("max_slice_nums"))
    n_slices = CHAT_MAX_SLICE_NUMS if chosen is None else slices(chosen, 1)[0]
    parsed = [_chat_message(m, n_slices, limits) for m in messages]
    limits.conversation(len(parsed), sum(len(m.text.encode("utf-8")) + len(m.key()[2]) for m in parsed))
    tts_ref = first(payload.get("tts_ref_audio"), tts.get("ref_audio_data"), tts.get("ref_audio"))
    voice = None if tts_ref is None else voice_ref("tts_ref_audio", tts_ref, None)  # refused now; the session goes on
    return ChatTurn(
        input_id=str(input_id) if input_id is not None else None,
        messages=parsed,
        streaming=bool(first(payload.get("streaming"), True)),
        generate_audio=bool(first(payload.get("generate_audio"), tts.get("enabled"), False)),
        max_new_tokens=max_new,
        tts_ref_audio=voice,
    )


def parse_client_message(message: dict[str, Any], mode: str = "full_duplex", limits: Limits | None = None
                         ) -> ClientMessage:
    kind = message["type"]
    limits = limits or Limits.default()
    if kind == "input.append":
        return parse_chat_turn(message, limits) if mode == "turn_based" else parse_input_append(message, limits)
    if kind == "input.context" and mode == "turn_based":
        raise ProtocolError(ClientCode.UNSUPPORTED_EVENT, "input.context is for full_duplex; add a message instead")
    if kind == "input.context":
        return parse_input_context(message, limits)
    if kind == "session.init":
        raise ProtocolError(ClientCode.ALREADY_INITIALIZED, "session.init may only be the first message")
    if kind == "session.close":
        raise ProtocolError(ClientCode.UNSUPPORTED_EVENT, "close a session with POST /sessions/{session_id}/close")
    raise ProtocolError(ClientCode.UNKNOWN_EVENT, f"unknown message type {kind!r}")



# ---- server events ----

class BackendEvent(EventFields):
    """`type`, the fields, and `server_send_ts` (unix seconds, when encoded)."""

    def encode(self) -> dict[str, Any]:
        return {"type": self.type, **self.fields(), "server_send_ts": time.time()}


class SessionCreated(BackendEvent, type="session.created"):
    session_id: str
    mode: str
    metrics: dict[str, str | float]
    usage: dict[str, int]


class SessionClosed(BackendEvent, Closed):
    pass


class OutputDelta(BackendEvent, type="response.output.delta"):
    """One step event of a response: `kind` listen | text | audio; a step's last one carries its usage."""

    kind: str
    session_id: str
    input_id: str | None
    response_id: str | None
    metrics: dict[str, str | float]
    text: str | None = None
    audio: str | None = None  # base64 float32
    sample_rate: int | None = None
    audio_samples: int | None = None
    end_of_turn: bool | None = None
    chunk_index: int | None = None
    chunk_usage: dict[str, int] | None = None
    usage: dict[str, int] | None = None


class ResponseDone(BackendEvent, type="response.done"):
    """A turn_based turn's end (with the turn's whole audio when it did not stream)."""

    session_id: str
    response_id: str
    input_id: str | None
    text: str
    audio: str | None
    reason: str
    metrics: dict[str, str | float]
    chunk_usage: dict[str, int] | None
    usage: dict[str, int]


class ContextAccepted(BackendEvent, type="input.context.accepted"):
    session_id: str
    input_id: str | None
    operation_id: str | None
    context_kind: str
    respond: bool


class Error(BackendEvent, Refusal, type="error"):
    session_id: str | None
    error: dict[str, str | bool]


def error_event(code: str, message: str, session_id: str | None = None, retryable: bool = False) -> Error:
    return Error(session_id, {"code": code, "message": message, **({"retryable": True} if retryable else {})})


@dataclass
class BackendState(DialectState[ClientMessage]):
    dialect = "backend"
    mode: str = "full_duplex"
    duplex: DuplexOptions = field(default_factory=DuplexOptions)  # from session.init
    chunk_index: int = 0
    active_response_id: str | None = None
    _turn_audio: list[np.ndarray] = field(default_factory=list)  # a non-streaming turn's audio so far
    named_voice: str = ""  # from session.init's voice.name

    def options(self) -> DuplexOptions:
        return self.duplex

    def voice_name(self) -> str:
        return self.named_voice

    def created(self) -> list[ServerEvent]:
        return [SessionCreated(self.session_id, self.mode, {"backend": "triton", "kv_cache_length": 0},
                               self.usage.snapshot())]

    def frame_plan(self) -> str:
        return self.mode

    def read_frame(self, text: str, plan: str) -> ClientMessage:
        return parse_client_message(loads(text), plan, self.limits)  # its audio, images and voice decoded (limits:
        # fixed for the session, safe to read from the reading thread)

    def on_frame(self, msg: ClientMessage) -> Effects:
        if isinstance(msg, ChatTurn):
            if msg.tts_ref_audio is not None:
                self.charge_voice(msg.tts_ref_audio)
            req: StepInput | ChatInput = ChatInput(msg.messages, msg.max_new_tokens, msg.generate_audio,
                                                   tts_ref_audio=msg.tts_ref_audio)
            return Effects(steps=[PlannedStep("chat", req, self.epoch, response_id=new_response_id(), cause=msg)])
        if isinstance(msg, InputAppend):
            req = StepInput(audio=msg.audio, force_listen=msg.force_listen, frames=msg.frames,
                            max_slice_nums=msg.max_slice_nums if msg.frames else [])
            return Effects(steps=[PlannedStep("duplex", req, self.epoch, cause=msg)])
        req = StepInput.of_context(Context(msg.text, msg.kind, msg.respond))
        return Effects(steps=[PlannedStep("context", req, self.epoch, cause=msg)])

    def error_event(self, err: ProtocolError) -> ServerEvent:
        return error_event(err.code, err.message, self.session_id, err.retryable)

    def prepare(self, step: PlannedStep[ClientMessage]) -> StepInput | ChatInput:
        self._turn_audio = []
        return super().prepare(step)

    def on_step_event(self, step: PlannedStep[ClientMessage], ev: StepEvent) -> Effects:
        msg = step.cause
        if not isinstance(msg, ChatTurn):  # every step here has its cause: an append or a context
            return Effects([self.delta(msg.input_id if msg is not None else None, ev)])
        if ev.kind == "audio":
            self._turn_audio.append(ev.audio)
        whole = encode_f32_base64(np.concatenate(self._turn_audio)) if ev.kind == "done" and self._turn_audio else None
        out = self.chat_event(msg.input_id, step.response_id or "", ev, msg.streaming, whole)
        return Effects([out] if out is not None else [])

    def on_step_end(self, step: PlannedStep[ClientMessage]) -> Effects:
        msg = step.cause
        if not isinstance(msg, InputContext):
            return Effects()
        return Effects([ContextAccepted(self.session_id, msg.input_id, msg.operation_id, msg.kind, msg.respond)])

    def on_step_error(self, step: PlannedStep[ClientMessage], code: ClientCode, message: str) -> Effects:
        return Effects([error_event(code, message, self.session_id)])

    def on_close(self, reason: str, message: str | None) -> list[ServerEvent]:
        return [SessionClosed(self.session_id, reason, self.usage.snapshot(),
                              {"message": message} if message else None)]

    def delta(self, input_id: str | None, ev: StepEvent) -> OutputDelta:
        """Map one duplex step event (not `error`) to its `response.output.delta`."""
        if ev.kind == "listen":
            out = OutputDelta("listen", self.session_id, input_id, self.active_response_id, ev.metrics.to_dict(),
                              end_of_turn=True if ev.end_of_turn else None)
            self.active_response_id = None
        else:
            if self.active_response_id is None:
                self.active_response_id = new_response_id()
            out = _output_delta(ev, self.session_id, input_id, self.active_response_id)
        if ev.chunk_usage is not None:  # the step's last event carries its usage
            out.chunk_index, out.chunk_usage = self.chunk_index, ev.chunk_usage
            out.usage = self.usage.add(ev.chunk_usage)
            self.chunk_index += 1
        return out

    def chat_event(self, turn_input_id: str | None, response_id: str, ev: StepEvent,
                   streaming: bool, audio: str | None = None) -> ServerEvent | None:
        """A turn_based turn: deltas when streaming, then `response.done` (with the audio when not)."""
        if ev.kind == "done":
            return ResponseDone(self.session_id, response_id, turn_input_id, ev.text, None if streaming else audio,
                                ev.reason, ev.metrics.to_dict(), ev.chunk_usage, self.usage.add(ev.chunk_usage or {}))
        if not streaming:
            return None
        return _output_delta(ev, self.session_id, turn_input_id, response_id)


def _output_delta(ev: StepEvent, session_id: str, input_id: str | None, response_id: str) -> OutputDelta:
    if ev.kind == "text":
        return OutputDelta("text", session_id, input_id, response_id, ev.metrics.to_dict(), text=ev.text)
    if ev.kind == "audio":
        return OutputDelta("audio", session_id, input_id, response_id, ev.metrics.to_dict(),
                           audio=encode_f32_base64(ev.audio),
                           sample_rate=OUTPUT_RATE, audio_samples=len(ev.audio))
    raise ValueError(f"unexpected step event kind {ev.kind!r}")

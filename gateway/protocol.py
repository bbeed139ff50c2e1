"""The MiniCPM-o backend protocol, as pure code: JSON text in, typed messages out, event dicts back.

Accepts the field aliases the reference server accepts (`audio` / `audio_base64` / `audio_data`,
`frames` / `video_frames` / `frame_base64_list`, `system_prompt` / `instructions`, `voice.*`).
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .audio import INPUT_RATE, AudioDecodeError, decode_f32_base64

MODES = ("full_duplex", "turn_based")
MAX_APPEND_SECONDS = 5
MAX_FRAMES = 4
MAX_IMAGE_BYTES = 8 << 20
VOICE_SECONDS = (0.5, 30.0)  # a voice reference's allowed duration

# WebSocket close codes
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server shutdown
CLOSE_UNSUPPORTED_DATA = 1003  # not JSON
CLOSE_POLICY = 1008  # a protocol violation by the client
CLOSE_SERVER_ERROR = 1011
CLOSE_TRY_AGAIN = 1013  # not ready, or no session slot


class ProtocolError(Exception):
    """A client error: answered with an `error` event; `close_code` says whether the socket closes."""

    def __init__(self, code: str, message: str, close_code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.close_code = close_code


@dataclass(frozen=True)
class SessionInit:
    mode: str
    system_prompt: str | None
    config: dict[str, Any]
    ref_audio_base64: str | None = None
    tts_ref_audio_base64: str | None = None
    voice_name: str = ""  # `voice.name`: a named voice of the server's voice folder


@dataclass(frozen=True)
class InputAppend:
    input_id: str | None
    audio: np.ndarray | None
    frames: list[bytes] = field(default_factory=list)  # encoded images, base64-decoded
    max_slice_nums: list[int] = field(default_factory=list)
    force_listen: bool = False
    hints: dict[str, Any] = field(default_factory=dict)


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
    messages: list[dict[str, Any]]  # {role, text, audio (base64 float32 16 kHz) or None}
    streaming: bool = True
    generate_audio: bool = False
    max_new_tokens: int = 256
    tts_ref_audio: str | None = None  # this turn's voice (base64 float32 16 kHz), else the session's


ClientMessage = InputAppend | InputContext | ChatTurn
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_CHAT_AUDIO_SECONDS = 60


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError("invalid_payload", f"{what} must be a JSON object")
    return value


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def loads(text: str | bytes) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError("invalid_json", f"message is not valid JSON: {exc}", CLOSE_UNSUPPORTED_DATA) from exc
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError("invalid_payload", "message must be a JSON object with a string `type`", CLOSE_POLICY)
    return data


def parse_init(message: dict[str, Any]) -> SessionInit:
    if message["type"] != "session.init":
        raise ProtocolError("invalid_first_message",
                            f"the first message must be session.init, got {message['type']!r}", CLOSE_POLICY)
    payload = message.get("payload")
    if not isinstance(payload, dict):
        raise ProtocolError("missing_field", "session.init must carry an object `payload`", CLOSE_POLICY)
    mode = payload.get("mode") or "full_duplex"
    if mode not in MODES:
        raise ProtocolError("invalid_mode", f"mode must be one of {', '.join(MODES)}", CLOSE_POLICY)
    prompt = _first(payload.get("system_prompt"), payload.get("instructions"))
    if prompt is not None and not isinstance(prompt, str):
        raise ProtocolError("invalid_payload", "system_prompt must be a string", CLOSE_POLICY)
    config = _first(payload.get("config"), payload.get("duplex")) or {}
    if not isinstance(config, dict):
        raise ProtocolError("invalid_payload", "config must be an object", CLOSE_POLICY)
    voice = _first(payload.get("voice"), payload.get("defaults")) or {}
    if not isinstance(voice, dict):
        raise ProtocolError("invalid_payload", "voice must be an object", CLOSE_POLICY)
    init = SessionInit(
        mode=mode,
        system_prompt=prompt,
        config=config,
        ref_audio_base64=_first(payload.get("ref_audio_base64"), voice.get("ref_audio_base64"), voice.get("ref_audio")),
        tts_ref_audio_base64=_first(payload.get("tts_ref_audio_base64"), voice.get("tts_ref_audio_base64"),
                                    voice.get("tts_ref_audio")),
        voice_name=str(voice.get("name") or ""),
    )
    voice_refs(init)  # refused now, not at the first step
    return init


def voice_refs(init: SessionInit) -> dict[str, np.ndarray]:
    """The session's voice references as 16 kHz float32, within VOICE_SECONDS (else `invalid_voice`)."""
    refs = (("ref_audio", init.ref_audio_base64), ("tts_ref_audio", init.tts_ref_audio_base64))
    return {name: voice_ref(name, data, CLOSE_POLICY) for name, data in refs if data is not None}


def voice_ref(name: str, data: Any, close_code: int | None) -> np.ndarray:
    """One voice reference (base64 float32 16 kHz), within VOICE_SECONDS, else `invalid_voice`."""
    if not isinstance(data, str):
        raise ProtocolError("invalid_voice", f"{name} must be base64 float32 16 kHz audio", close_code)
    try:
        audio = decode_f32_base64(data, int(VOICE_SECONDS[1] * INPUT_RATE))
    except AudioDecodeError as exc:
        raise ProtocolError("invalid_voice", f"{name}: {exc}", close_code) from exc
    if len(audio) < VOICE_SECONDS[0] * INPUT_RATE:
        raise ProtocolError("invalid_voice", f"{name} must be at least {VOICE_SECONDS[0]} s", close_code)
    return audio


def _audio_field(payload: dict[str, Any]) -> str | None:
    for key in ("audio_base64", "audio_data"):
        if isinstance(payload.get(key), str) and payload[key]:
            return payload[key]
    audio = payload.get("audio")
    if isinstance(audio, dict):
        audio = _first(audio.get("data"), audio.get("base64"), audio.get("audio_base64"))
    return audio if isinstance(audio, str) and audio else None


def _image_bytes(data: str) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError("bad_image", f"an image is not valid base64: {exc}") from exc
    if not raw or len(raw) > MAX_IMAGE_BYTES:
        raise ProtocolError("bad_image", f"an image must be 1 byte to {MAX_IMAGE_BYTES // (1 << 20)} MiB")
    return raw


def _frames(payload: dict[str, Any]) -> list[bytes]:
    frames = _first(payload.get("frame_base64_list"), payload.get("video_frames"), payload.get("frames")) or []
    if not isinstance(frames, list):
        raise ProtocolError("invalid_payload", "frames must be a list")
    out = []
    for frame in frames:
        data = _first(frame.get("data"), frame.get("base64")) if isinstance(frame, dict) else frame
        if not isinstance(data, str) or not data:
            raise ProtocolError("invalid_payload", "each frame must be a base64 JPEG string or {data}")
        out.append(_image_bytes(data))
    if len(out) > MAX_FRAMES:
        raise ProtocolError("invalid_payload", f"at most {MAX_FRAMES} frames per input")
    return out


def _slices(value: Any, n_frames: int) -> list[int]:
    if value is None:
        return [1] * n_frames
    values = value if isinstance(value, list) else [value] * max(n_frames, 1)
    if isinstance(value, list) and n_frames and len(values) != n_frames:
        raise ProtocolError("invalid_payload", "max_slice_nums as a list needs one entry per frame")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 9 for v in values):
        raise ProtocolError("invalid_payload", "max_slice_nums must be an integer 1..9 or a list of them")
    return values


def parse_input_append(message: dict[str, Any]) -> ClientMessage:
    payload = _object(message.get("input"), "input.append's `input`")
    if isinstance(payload.get("context"), dict) and payload["context"].get("text"):
        return parse_input_context({"input_id": payload.get("input_id"), "context": payload["context"]})
    hints = payload.get("hints") or {}
    if not isinstance(hints, dict):
        raise ProtocolError("invalid_payload", "hints must be an object")
    encoded = _audio_field(payload)
    audio = None
    if encoded is not None:
        try:
            audio = decode_f32_base64(encoded, MAX_APPEND_SECONDS * INPUT_RATE)
        except AudioDecodeError as exc:
            raise ProtocolError("bad_audio", str(exc)) from exc
    frames = _frames(payload)
    if audio is None or len(audio) == 0:
        raise ProtocolError("missing_field", "full_duplex input.append requires audio (base64 float32 16 kHz)")
    force = _first(payload.get("force_listen"), hints.get("force_listen"), False)
    input_id = payload.get("input_id")
    return InputAppend(
        input_id=str(input_id) if input_id is not None else None,
        audio=audio,
        frames=frames,
        max_slice_nums=_slices(_first(payload.get("max_slice_nums"), hints.get("max_slice_nums")), len(frames)),
        force_listen=bool(force),
        hints=hints,
    )


def parse_input_context(message: dict[str, Any]) -> InputContext:
    context = _object(message.get("context"), "input.context's `context`")
    text = context.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ProtocolError("missing_field", "input.context requires a non-empty context.text")
    input_id = message.get("input_id")
    return InputContext(
        input_id=str(input_id) if input_id is not None else None,
        text=text.strip(),
        kind=str(context.get("kind") or "tool_result"),
        operation_id=context.get("operation_id"),
        respond=bool(context.get("respond", True)),
    )


def _chat_message(raw: Any) -> dict[str, Any]:
    m = _object(raw, "each message")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise ProtocolError("invalid_payload", f"message role must be one of {', '.join(CHAT_ROLES)}")
    content = m.get("content", "")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise ProtocolError("invalid_payload", "message content must be a string or a list of parts")
    text, audio, images = [], m.get("audio"), []
    for part in parts:
        part = _object(part, "each content part")
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("audio", "input_audio"):
            audio = _first(part.get("audio"), part.get("data"), part.get("audio_base64"))
        elif kind in ("image", "image_url", "input_image"):
            data = _first(part.get("image"), part.get("data"), part.get("base64"), part.get("image_url"))
            if isinstance(data, dict):
                data = data.get("url")
            if isinstance(data, str) and data.startswith("data:"):
                data = data.split(",", 1)[-1]  # a data URL
            if not isinstance(data, str):
                raise ProtocolError("bad_image", "image content must be base64 (or a base64 data URL)")
            _image_bytes(data)
            images.append(data)
        else:
            raise ProtocolError("invalid_payload", f"unknown content part {kind!r}")
    if audio is not None:
        if not isinstance(audio, str):
            raise ProtocolError("bad_audio", "message audio must be base64 float32 16 kHz")
        try:
            decode_f32_base64(audio, MAX_CHAT_AUDIO_SECONDS * INPUT_RATE)
        except AudioDecodeError as exc:
            raise ProtocolError("bad_audio", str(exc)) from exc
    return {"role": role, "text": "".join(text), "audio": audio, "images": images}


def parse_chat_turn(message: dict[str, Any]) -> ChatTurn:
    payload = _object(message.get("input"), "input.append's `input`")
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("missing_field", "turn_based input.append requires a non-empty `messages` list")
    generation = payload.get("generation") or {}
    tts = payload.get("tts") or {}
    if not isinstance(generation, dict) or not isinstance(tts, dict):
        raise ProtocolError("invalid_payload", "generation and tts must be objects")
    max_new = _first(payload.get("max_new_tokens"), generation.get("max_new_tokens"), 256)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or not 1 <= max_new <= 4096:
        raise ProtocolError("invalid_payload", "max_new_tokens must be an integer 1..4096")
    input_id = payload.get("input_id")
    image_opts = payload.get("image") if isinstance(payload.get("image"), dict) else {}
    slices = _slices(_first(payload.get("max_slice_nums"), image_opts.get("max_slice_nums")), 1)[0]
    parsed = [_chat_message(m) for m in messages]
    for m in parsed:
        m["max_slice_nums"] = slices
    tts_ref = _first(payload.get("tts_ref_audio"), tts.get("ref_audio_data"), tts.get("ref_audio"))
    if tts_ref is not None:
        voice_ref("tts_ref_audio", tts_ref, None)  # refused now, the session goes on
    return ChatTurn(
        input_id=str(input_id) if input_id is not None else None,
        messages=parsed,
        streaming=bool(_first(payload.get("streaming"), True)),
        generate_audio=bool(_first(payload.get("generate_audio"), tts.get("enabled"), False)),
        max_new_tokens=max_new,
        tts_ref_audio=tts_ref,
    )


def parse_client_message(message: dict[str, Any], mode: str = "full_duplex") -> ClientMessage:
    kind = message["type"]
    if kind == "input.append":
        return parse_chat_turn(message) if mode == "turn_based" else parse_input_append(message)
    if kind == "input.context" and mode == "turn_based":
        raise ProtocolError("unsupported_event", "input.context is for full_duplex; add a message instead")
    if kind == "input.context":
        return parse_input_context(message)
    if kind == "session.init":
        raise ProtocolError("already_initialized", "session.init may only be the first message")
    if kind == "session.close":
        raise ProtocolError("unsupported_event", "close a session with POST /sessions/{session_id}/close")
    raise ProtocolError("unknown_event", f"unknown message type {kind!r}")


def event(event_type: str, **fields: Any) -> dict[str, Any]:
    """A server event: `type`, the non-None fields, and `server_send_ts` (unix seconds)."""
    out: dict[str, Any] = {"type": event_type}
    out.update({k: v for k, v in fields.items() if v is not None})
    out["server_send_ts"] = time.time()
    return out


def error_event(code: str, message: str, session_id: str | None = None) -> dict[str, Any]:
    return event("error", session_id=session_id, error={"code": code, "message": message})

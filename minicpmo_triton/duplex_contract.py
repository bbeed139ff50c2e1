"""The one contract between the gateway and the `duplex` Triton model, used by both sides (numpy only).

A request is one duplex step (`StepInput`), one turn-based turn (`ChatInput`) or a `Cancel` of the step
in flight; a step answers with `StepEvent`s, the last of which may be a coded `error`. Each side encodes
and decodes here, so the tensors (names in model_repository/duplex/config.pbtxt) are written down once:

    audio, ref_audio, tts_ref_audio, replay_audio  FP32 [n]   16 kHz float32
    force_listen, cancel                           BOOL [1]
    rollback_to                                    INT64 [1]
    context, options, chat                         BYTES [1]  JSON of Context (+ say, answer_tokens), DuplexOptions,
                                                              ChatInput
    frames                                         BYTES [n]  encoded images;  max_slice_nums INT64 [n]
    -> event BYTES [1] (JSON of StepEvent without its audio), audio FP32 [n] (24 kHz float32)

Tensors here carry no batch dimension: each side adds or strips it.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from .errors import Code, StepError, as_code
from .model_config import DuplexDefaults
from .rules.duplex_options import DuplexOptions, InvalidOptions

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True)
class VoiceRefs:
    """A session's voice (16 kHz references): the LLM's in its system prompt, the TTS's as token2wav's prompt."""

    ref_audio: np.ndarray | None = None
    tts_ref_audio: np.ndarray | None = None  # falls back to a named voice, then to ref_audio
    name: str = ""  # a voice of the model server's voice folder (MINICPMO_VOICES_DIR)

    @property
    def tts(self) -> np.ndarray | None:
        """The TTS's reference: its voice in token2wav."""
        return self.tts_ref_audio if self.tts_ref_audio is not None else self.ref_audio


@dataclass(frozen=True)
class Context:
    """Text put into a duplex session's context (a tool result, an instruction), answered or not."""

    text: str
    kind: str = "tool_result"
    respond: bool = True


# A chat message's images: HD slices as MiniCPM-o's processor slices them by default (MiniCPM-o-Demo
# processing_minicpmo.py:128, its chat worker passes None through); a duplex step's frames stay at 1, as its worker's
CHAT_MAX_SLICE_NUMS = 9


@dataclass(frozen=True)
class ChatMessage:
    role: str
    text: str = ""
    audio: np.ndarray | None = None  # 16 kHz float32
    images: tuple[bytes, ...] = ()  # encoded images
    max_slice_nums: int = CHAT_MAX_SLICE_NUMS

    def key(self) -> tuple[str, str, bytes]:
        """What identifies a message already in the context (audio and images by their bytes)."""
        media = (b"" if self.audio is None else self.audio.tobytes()) + b"".join(self.images)
        return (self.role, self.text, media)


@dataclass
class ChatInput:
    """One turn-based turn: the whole conversation so far; the prefix already in context is reused."""

    messages: list[ChatMessage]
    max_new_tokens: int = 256
    generate_audio: bool = False
    options: DuplexOptions | None = None  # at START
    voice: VoiceRefs | None = None  # at START
    tts_ref_audio: np.ndarray | None = None  # this turn's voice (16 kHz), else the session's
    say: bool = False  # the last message is the assistant's: voice it as is (teacher-forced), generate nothing


@dataclass
class StepInput:
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # 16 kHz float32
    force_listen: bool = False
    context_text: str = ""
    context_kind: str = "tool_result"
    respond: bool = True
    options: DuplexOptions | None = None  # at START
    frames: list[bytes] = field(default_factory=list)  # JPEG, seen with this second of audio
    max_slice_nums: list[int] = field(default_factory=list)  # one per frame
    voice: VoiceRefs | None = None  # at START
    # Barge-in: cut the LLM's context back to what the listener heard (a kv length from an earlier step),
    # then hear again the seconds of caller audio that came after that point (whole seconds, 16 kHz).
    rollback_to: int = -1
    replay_audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    # A spoken turn now, whatever the caller says: `say` voices this text as the assistant's turn (the
    # LLM is teacher-forced through it, so the TTS has its hidden states); `answer_tokens` > 0 makes the
    # model answer the context in voice, in at most that many LLM tokens. Both ride in `context`.
    say: str = ""
    answer_tokens: int = 0

    @classmethod
    def of_context(cls, context: Context) -> StepInput:
        return cls(context_text=context.text, context_kind=context.kind, respond=context.respond)


@dataclass(frozen=True)
class Cancel:
    """Stop the step in flight (sent beside it; answers nothing)."""


Request = StepInput | ChatInput | Cancel


@dataclass
class StepMetrics:
    """What a step measured so far (times in ms, counts); a field is None until measured, and the client is
    sent the measured ones (`to_dict`). A step's events share one as it grows: each event carries a copy."""

    backend: str | None = None  # "triton"
    # the LLM's KV cache after the step's decode (the sliding window's slides shrink it), as MiniCPM-o's worker reports
    # `kv_cache_length` (its decoder's `get_cache_length()` after streaming_generate, before finalize_unit)
    kv_cache_length: int | None = None
    kv_tokens_total: int | None = None  # ... counted from the call's start (what the window dropped included): a
    # point in the call that stays valid across slides (the OpenAI dialect's rollback points)
    llm_wait_ms: float | None = None  # held at the batch window before the LLM
    cost_llm_ms: float | None = None
    cost_audio_encoder_ms: float | None = None
    cost_vision_ms: float | None = None
    vision_slices: int | None = None
    vision_tokens: int | None = None
    prefill_ms: float | None = None
    generate_ms: float | None = None
    n_tokens: int | None = None  # tokens the LLM generated
    n_prefill: int | None = None  # turn-based: tokens prefilled (after the cached prefix)
    cached_tokens: int | None = None  # turn-based: the prefix reused from the previous turn
    cost_tts_ms: float | None = None
    n_tts_tokens: int | None = None
    cost_token2wav_ms: float | None = None
    wall_clock_ms: float | None = None

    def to_dict(self) -> dict[str, str | float]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def of(cls, value: StepMetrics | dict[str, Any] | None) -> StepMetrics:
        """Metrics as decoded from the wire (a JSON object: keys this build does not know are dropped)."""
        if isinstance(value, StepMetrics):
            return value
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in (value or {}).items() if k in known})


EventKind = Literal["listen", "text", "audio", "done", "error"]  # done: a turn-based turn's end


@dataclass
class StepEvent:
    kind: EventKind
    text: str = ""
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # 24 kHz float32
    end_of_turn: bool = False
    metrics: StepMetrics = field(default_factory=StepMetrics)
    chunk_usage: dict[str, int] | None = None  # on the last event of a step only
    reason: str = ""  # done: turn_end | length
    code: Code | None = None  # error
    message: str = ""  # error

    def __post_init__(self) -> None:
        self.metrics = StepMetrics.of(self.metrics)  # a plain object (tests, the wire) becomes the dataclass

    @classmethod
    def error(cls, err: StepError) -> StepEvent:
        return cls("error", code=err.code, message=err.message)


# ---- request: gateway -> duplex ----

def _json(value: Any) -> np.ndarray:
    return np.array([json.dumps(value).encode("utf-8")], dtype=np.object_)


def _f32(audio: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(audio, np.float32).reshape(-1)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _voice(out: Tensors, voice: VoiceRefs | None) -> None:
    for name in ("ref_audio", "tts_ref_audio"):
        ref = getattr(voice, name) if voice is not None else None
        if ref is not None:
            out[name] = _f32(ref)
    if voice is not None and voice.name:
        out["voice_name"] = np.array([voice.name.encode("utf-8")], dtype=np.object_)


def _chat_json(chat: ChatInput) -> dict[str, Any]:
    def audio(a: np.ndarray | None) -> str | None:
        return None if a is None else _b64(_f32(a).astype("<f4").tobytes())

    return {"messages": [{"role": m.role, "text": m.text, "audio": audio(m.audio),
                          "images": [_b64(i) for i in m.images], "max_slice_nums": m.max_slice_nums}
                         for m in chat.messages],
            "max_new_tokens": chat.max_new_tokens, "generate_audio": chat.generate_audio,
            "tts_ref_audio": audio(chat.tts_ref_audio), "say": chat.say}


def encode_request(req: Request) -> Tensors:
    out: Tensors = {}
    if isinstance(req, Cancel):
        return {"cancel": np.array([True])}
    if req.options is not None:
        out["options"] = _json(req.options.to_dict())
    _voice(out, req.voice)
    if isinstance(req, ChatInput):
        out["chat"] = _json(_chat_json(req))
        return out
    if len(req.audio):
        out["audio"] = _f32(req.audio)
    if len(req.replay_audio):
        out["replay_audio"] = _f32(req.replay_audio)
    if req.force_listen:
        out["force_listen"] = np.array([True])
    if req.rollback_to >= 0:
        out["rollback_to"] = np.array([req.rollback_to], np.int64)
    if req.context_text or req.say or req.answer_tokens:
        out["context"] = _json({"text": req.context_text, "kind": req.context_kind, "respond": req.respond,
                                "say": req.say, "answer_tokens": req.answer_tokens})
    if req.frames:
        out["frames"] = np.array(req.frames, dtype=np.object_)
        out["max_slice_nums"] = np.array(req.max_slice_nums or [1] * len(req.frames), np.int64)
    if not out:  # an END-only request still needs one tensor
        out["force_listen"] = np.array([False])
    return out


def _json_input(rows: Tensors, name: str) -> dict[str, Any]:
    raw = rows.get(name)
    if raw is None:
        return {}
    value = raw.reshape(-1)[0]
    try:
        data = json.loads(value.decode("utf-8") if isinstance(value, bytes) else str(value))
    except (ValueError, RecursionError) as exc:
        raise StepError(Code.INVALID_INPUT, f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise StepError(Code.INVALID_INPUT, f"{name} must be a JSON object")
    return data


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _audio_row(rows: Tensors, name: str) -> np.ndarray | None:
    raw = rows.get(name)
    return None if raw is None else raw.reshape(-1).astype(np.float32)


def _audio_or_empty(rows: Tensors, name: str) -> np.ndarray:
    """A step's audio row; none sent is no audio (an empty row)."""
    audio = _audio_row(rows, name)
    return np.zeros(0, np.float32) if audio is None else audio


def _flag(rows: Tensors, name: str) -> bool:
    raw = rows.get(name)
    return bool(raw is not None and raw.reshape(-1)[0])


def _audio_b64(data: str | None) -> np.ndarray | None:
    return np.frombuffer(base64.b64decode(data), "<f4").astype(np.float32) if data else None


def _chat_input(chat: dict[str, Any], options: DuplexOptions | None, voice: VoiceRefs | None) -> ChatInput:
    try:
        messages = [ChatMessage(str(m["role"]), str(m.get("text") or ""), _audio_b64(m.get("audio")),
                                tuple(base64.b64decode(i) for i in m.get("images") or ()),
                                int(m.get("max_slice_nums") or CHAT_MAX_SLICE_NUMS))
                    for m in chat["messages"]]
        return ChatInput(messages, int(chat.get("max_new_tokens", 256)), bool(chat.get("generate_audio", False)),
                         options, voice, tts_ref_audio=_audio_b64(chat.get("tts_ref_audio")), say=bool(chat.get("say")))
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise StepError(Code.INVALID_CHAT, f"malformed chat request: {exc}") from exc


def decode_request(rows: Tensors, start: bool, defaults: DuplexDefaults) -> Request:
    """A request's inputs (batch row 0, by name) as the request; options and voice are read at START only."""
    if _flag(rows, "cancel"):
        return Cancel()
    options = voice = None
    if start:
        try:
            options = DuplexOptions.from_config(_json_input(rows, "options"), defaults)
        except InvalidOptions as exc:
            raise StepError(Code.INVALID_CONFIG, str(exc)) from exc
        name = rows.get("voice_name")
        voice = VoiceRefs(_audio_row(rows, "ref_audio"), _audio_row(rows, "tts_ref_audio"),
                          "" if name is None else _text(name.reshape(-1)[0]))
    chat = _json_input(rows, "chat")
    if chat:
        return _chat_input(chat, options, voice)
    context = _json_input(rows, "context")
    frames, slices = rows.get("frames"), rows.get("max_slice_nums")
    rollback = rows.get("rollback_to")
    return StepInput(
        audio=_audio_or_empty(rows, "audio"),
        force_listen=_flag(rows, "force_listen"),
        context_text=str(context.get("text") or ""),
        context_kind=str(context.get("kind") or "tool_result"),
        respond=bool(context.get("respond", True)),
        options=options,
        frames=[bytes(f) for f in frames.reshape(-1)] if frames is not None else [],
        max_slice_nums=[int(n) for n in slices.reshape(-1)] if slices is not None else [],
        voice=voice,
        rollback_to=-1 if rollback is None else int(rollback.reshape(-1)[0]),
        replay_audio=_audio_or_empty(rows, "replay_audio"),
        say=str(context.get("say") or ""),
        answer_tokens=_count(context.get("answer_tokens")),
    )


def _count(value: Any) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise StepError(Code.INVALID_INPUT, f"context.answer_tokens must be a count, not {value!r}")
    return value


# ---- events: duplex -> gateway ----

def encode_event(event: StepEvent) -> Tensors:
    out: dict[str, Any] = {"kind": event.kind, "metrics": event.metrics.to_dict()}
    for name in ("reason", "text", "code", "message"):
        if getattr(event, name):
            out[name] = getattr(event, name)
    if event.end_of_turn:
        out["end_of_turn"] = True
    if event.chunk_usage is not None:
        out["chunk_usage"] = event.chunk_usage
    return {"event": _json(out), "audio": _f32(event.audio)}


def decode_event(event: np.ndarray, audio: np.ndarray | None) -> StepEvent:
    data = json.loads(event.reshape(-1)[0])
    return StepEvent(
        kind=data["kind"], text=data.get("text", ""),
        audio=np.zeros(0, np.float32) if audio is None else audio.reshape(-1),
        end_of_turn=bool(data.get("end_of_turn")), metrics=StepMetrics.of(data.get("metrics")),
        chunk_usage=data.get("chunk_usage"), reason=data.get("reason", ""),
        code=as_code(data["code"]) if data.get("code") else None, message=data.get("message", ""))

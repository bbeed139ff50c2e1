"""The OpenAI Realtime dialect's events, one dataclass per `type` (pure code): server events encode
themselves; client events decode from their JSON (field types checked here, meaning in the state).

Nested payloads (a session, an item, a response) are the JSON objects OpenAI's reference describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..wire import ProtocolError
from .realtime_events import RealtimeEvent

Json = dict[str, Any]


@dataclass
class SessionCreated(RealtimeEvent):
    type: ClassVar[str] = "session.created"
    session: Json
    capabilities: Json


@dataclass
class SessionUpdated(RealtimeEvent):
    type: ClassVar[str] = "session.updated"
    session: Json


@dataclass
class SpeechStarted(RealtimeEvent):
    type: ClassVar[str] = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str | None


@dataclass
class SpeechStopped(RealtimeEvent):
    type: ClassVar[str] = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str | None


@dataclass
class BufferCommitted(RealtimeEvent):
    type: ClassVar[str] = "input_audio_buffer.committed"
    item_id: str | None
    previous_item_id: str | None = None


@dataclass
class BufferCleared(RealtimeEvent):
    type: ClassVar[str] = "input_audio_buffer.cleared"


@dataclass
class OverlapDecision(RealtimeEvent):
    """Extension: what the overlap policy made of caller audio heard while the assistant speaks."""

    type: ClassVar[str] = "overlap.decision"
    policy: str
    action: str
    reason: str
    speech_ms: int
    response_id: str | None
    epoch: int


@dataclass
class ItemAdded(RealtimeEvent):
    type: ClassVar[str] = "conversation.item.added"
    previous_item_id: str | None
    item: Json


@dataclass
class ItemDone(RealtimeEvent):
    type: ClassVar[str] = "conversation.item.done"
    item: Json


@dataclass
class ItemRetrieved(RealtimeEvent):
    type: ClassVar[str] = "conversation.item.retrieved"
    item: Json


@dataclass
class ItemDeleted(RealtimeEvent):
    type: ClassVar[str] = "conversation.item.deleted"
    item_id: str


@dataclass
class ItemTruncated(RealtimeEvent):
    type: ClassVar[str] = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass
class OutputBufferCleared(RealtimeEvent):
    type: ClassVar[str] = "output_audio_buffer.cleared"
    response_id: str | None


@dataclass
class PlaybackAcknowledged(RealtimeEvent):
    """Extension: the client's `playback.ack`, as the server took it."""

    type: ClassVar[str] = "playback.acknowledged"
    response_id: str
    played_ms: int
    history_committed: bool


@dataclass
class ResponseSpeak(RealtimeEvent):
    """Extension (duplex): the model decided to speak."""

    type: ClassVar[str] = "response.speak"
    response_id: str
    epoch: int


@dataclass
class ResponseListen(RealtimeEvent):
    """Extension (duplex): the model listens again."""

    type: ClassVar[str] = "response.listen"
    response_id: str
    epoch: int
    end_of_turn: bool


@dataclass
class ResponseCreated(RealtimeEvent):
    type: ClassVar[str] = "response.created"
    response: Json


@dataclass
class ResponseDone(RealtimeEvent):
    type: ClassVar[str] = "response.done"
    response: Json


@dataclass
class RateLimitsUpdated(RealtimeEvent):
    type: ClassVar[str] = "rate_limits.updated"
    rate_limits: list[Json]


@dataclass
class OutputItemAdded(RealtimeEvent):
    type: ClassVar[str] = "response.output_item.added"
    response_id: str
    output_index: int
    item: Json


@dataclass
class OutputItemDone(OutputItemAdded):
    type: ClassVar[str] = "response.output_item.done"


@dataclass
class ContentEvent(RealtimeEvent):
    """An event about the one content part of a response's one output item."""

    response_id: str
    item_id: str
    output_index: int
    content_index: int


@dataclass
class ContentPartAdded(ContentEvent):
    type: ClassVar[str] = "response.content_part.added"
    part: Json


@dataclass
class ContentPartDone(ContentPartAdded):
    type: ClassVar[str] = "response.content_part.done"


@dataclass
class OutputAudioDelta(ContentEvent):
    type: ClassVar[str] = "response.output_audio.delta"
    delta: str  # base64 audio/pcm at the session's output rate
    metadata: Json


@dataclass
class OutputAudioDone(ContentEvent):
    type: ClassVar[str] = "response.output_audio.done"


@dataclass
class TranscriptDelta(ContentEvent):
    type: ClassVar[str] = "response.output_audio_transcript.delta"
    delta: str


@dataclass
class TranscriptDone(ContentEvent):
    type: ClassVar[str] = "response.output_audio_transcript.done"
    transcript: str


@dataclass
class TextDelta(TranscriptDelta):
    type: ClassVar[str] = "response.output_text.delta"


@dataclass
class TextDone(ContentEvent):
    type: ClassVar[str] = "response.output_text.done"
    text: str


# ---- client events ----

def _number(msg: Json, name: str) -> float:
    value = msg.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ProtocolError("invalid_value", f"{name} must be a number >= 0", name)
    return float(value)


def _id(msg: Json, name: str) -> str | None:
    value = msg.get(name)
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ClientEvent:
    type: ClassVar[str] = ""

    @classmethod
    def decode(cls, msg: Json) -> ClientEvent:
        return cls()


@dataclass(frozen=True)
class SessionUpdate(ClientEvent):
    type: ClassVar[str] = "session.update"
    session: Any  # checked by openai_config.apply_update

    @classmethod
    def decode(cls, msg: Json) -> SessionUpdate:
        return cls(msg.get("session"))


@dataclass(frozen=True)
class AudioAppend(ClientEvent):
    type: ClassVar[str] = "input_audio_buffer.append"
    audio: str  # base64 audio/pcm at the session's input rate
    hint: str | None = None  # extension: what the caller said, if the client knows (a backchannel?)

    @classmethod
    def decode(cls, msg: Json) -> AudioAppend:
        data = msg.get("audio")
        if not isinstance(data, str) or not data:
            raise ProtocolError("missing_field", "input_audio_buffer.append needs `audio` (base64 audio/pcm)", "audio")
        hints = msg.get("hints") if isinstance(msg.get("hints"), dict) else {}
        hint = msg.get("transcript_hint") or hints.get("transcript")
        return cls(data, hint if isinstance(hint, str) else None)


@dataclass(frozen=True)
class BufferCommit(ClientEvent):
    type: ClassVar[str] = "input_audio_buffer.commit"


@dataclass(frozen=True)
class BufferClear(ClientEvent):
    type: ClassVar[str] = "input_audio_buffer.clear"


@dataclass(frozen=True)
class ItemCreate(ClientEvent):
    type: ClassVar[str] = "conversation.item.create"
    item: Any  # a message item, checked as its parts are read

    @classmethod
    def decode(cls, msg: Json) -> ItemCreate:
        return cls(msg.get("item"))


@dataclass(frozen=True)
class ItemRetrieve(ClientEvent):
    type: ClassVar[str] = "conversation.item.retrieve"
    item_id: str | None

    @classmethod
    def decode(cls, msg: Json) -> ItemRetrieve:
        return cls(_id(msg, "item_id"))


@dataclass(frozen=True)
class ItemDelete(ItemRetrieve):
    type: ClassVar[str] = "conversation.item.delete"


@dataclass(frozen=True)
class ItemTruncate(ClientEvent):
    type: ClassVar[str] = "conversation.item.truncate"
    item_id: str | None
    audio_end_ms: float
    content_index: Any = 0  # echoed back

    @classmethod
    def decode(cls, msg: Json) -> ItemTruncate:
        return cls(_id(msg, "item_id"), _number(msg, "audio_end_ms"), msg.get("content_index", 0))


@dataclass(frozen=True)
class ResponseCreate(ClientEvent):
    type: ClassVar[str] = "response.create"
    instructions: Any = None
    max_output_tokens: Any = None  # checked by openai_config.max_output_tokens

    @classmethod
    def decode(cls, msg: Json) -> ResponseCreate:
        spec = msg.get("response") if isinstance(msg.get("response"), dict) else {}
        return cls(spec.get("instructions"), spec.get("max_output_tokens"))


@dataclass(frozen=True)
class ResponseCancel(ClientEvent):
    type: ClassVar[str] = "response.cancel"


@dataclass(frozen=True)
class OutputClear(ClientEvent):
    type: ClassVar[str] = "output_audio_buffer.clear"


@dataclass(frozen=True)
class PlaybackAck(ClientEvent):
    """Extension: how much of a response's audio the listener has heard."""

    type: ClassVar[str] = "playback.ack"
    response_id: str | None
    played_ms: float

    @classmethod
    def decode(cls, msg: Json) -> PlaybackAck:
        return cls(_id(msg, "response_id"), _number(msg, "played_ms"))


@dataclass(frozen=True)
class SessionClose(ClientEvent):
    type: ClassVar[str] = "session.close"


@dataclass(frozen=True)
class Heartbeat(ClientEvent):
    type: ClassVar[str] = "session.heartbeat"


CLIENT_EVENTS: dict[str, type[ClientEvent]] = {c.type: c for c in (
    SessionUpdate, AudioAppend, BufferCommit, BufferClear, ItemCreate, ItemRetrieve, ItemDelete, ItemTruncate,
    ResponseCreate, ResponseCancel, OutputClear, PlaybackAck, SessionClose, Heartbeat)}


def decode_client(msg: Json) -> ClientEvent:
    cls = CLIENT_EVENTS.get(msg["type"])
    if cls is None:
        raise ProtocolError("unknown_event", f"unknown event type {msg['type']!r}", "type")
    return cls.decode(msg)

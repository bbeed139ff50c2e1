"""The OpenAI Realtime dialect's events, one dataclass per `type` (pure code): server events encode
themselves; client events decode from their JSON (field types checked here, meaning in the state).

Nested payloads (a session, an item, a response) are typed as the spec types them (`openai_objects`).
"""

from __future__ import annotations

from typing import Any

from ..codes import ClientCode
from ..wire import JsonObject, ProtocolError, json_object
from .openai_objects import (
    AudioDeltaMetadata,
    AudioPart,
    Capabilities,
    MessageItem,
    RealtimeResponse,
    RealtimeSession,
    TextPart,
)
from .realtime_events import RealtimeEvent
from .state import EventFields


class SessionShown(RealtimeEvent):
    """The session, as `session.created | updated` show it; with `events`, the model's options as the client set
    them go among its keys (`model`: DuplexOptions' names, opaque to the spec)."""

    session: RealtimeSession
    model: dict[str, object] | None = None

    def fields(self) -> dict[str, Any]:
        out = super().fields()
        if out.pop("model", None):
            out["session"] = {**self.session, **(self.model or {})}
        return out


class SessionCreated(SessionShown, type="session.created"):
    capabilities: Capabilities | None = None  # extension (`events`): what this server offers


SessionUpdated = SessionShown.retyped("SessionUpdated", "session.updated")


class SpeechStarted(RealtimeEvent, type="input_audio_buffer.speech_started"):
    audio_start_ms: int
    item_id: str | None


class SpeechStopped(RealtimeEvent, type="input_audio_buffer.speech_stopped"):
    audio_end_ms: int
    item_id: str | None


class BufferCommitted(RealtimeEvent, type="input_audio_buffer.committed"):
    item_id: str
    previous_item_id: str | None = None


BufferCleared = RealtimeEvent.retyped("BufferCleared", "input_audio_buffer.cleared")


class OverlapDecision(RealtimeEvent, type="overlap.decision"):
    """Extension: what the overlap policy made of caller audio heard while the assistant speaks."""

    policy: str
    action: str
    reason: str
    speech_ms: int
    response_id: str | None
    epoch: int


class DuplexStep(RealtimeEvent, type="duplex.step"):
    """Extension (duplex): what the model decided for one second of the caller's audio, sent with the step's
    first event (a listen step has no other event a client could see it by)."""

    second: int
    decision: str  # listen | speak
    epoch: int
    kv_cache_length: int


class ItemAdded(RealtimeEvent, type="conversation.item.added"):
    previous_item_id: str | None
    item: MessageItem


class ItemDone(RealtimeEvent, type="conversation.item.done"):
    item: MessageItem


ItemRetrieved = ItemDone.retyped("ItemRetrieved", "conversation.item.retrieved")


class ItemDeleted(RealtimeEvent, type="conversation.item.deleted"):
    item_id: str


class ItemTruncated(RealtimeEvent, type="conversation.item.truncated"):
    item_id: str
    content_index: int
    audio_end_ms: int


class OutputBufferCleared(RealtimeEvent, type="output_audio_buffer.cleared"):
    response_id: str | None


class PlaybackAcknowledged(RealtimeEvent, type="playback.acknowledged"):
    """Extension: the client's `playback.ack`, as the server took it."""

    response_id: str
    played_ms: int
    history_committed: bool


class TurnEvent(RealtimeEvent):
    """Extension (duplex): who has the turn, for a response in an epoch."""

    response_id: str
    epoch: int


ResponseSpeak = TurnEvent.retyped("ResponseSpeak", "response.speak")  # the model decided to speak


class ResponseListen(TurnEvent, type="response.listen"):
    """The model listens again."""

    end_of_turn: bool


class ResponseCreated(RealtimeEvent, type="response.created"):
    response: RealtimeResponse


ResponseDone = ResponseCreated.retyped("ResponseDone", "response.done")


class OutputItemAdded(RealtimeEvent, type="response.output_item.added"):
    response_id: str
    output_index: int
    item: MessageItem


OutputItemDone = OutputItemAdded.retyped("OutputItemDone", "response.output_item.done")


class ContentEvent(RealtimeEvent):
    """An event about the one content part of a response's one output item."""

    response_id: str
    item_id: str
    output_index: int
    content_index: int


class ContentPartAdded(ContentEvent, type="response.content_part.added"):
    part: AudioPart | TextPart


ContentPartDone = ContentPartAdded.retyped("ContentPartDone", "response.content_part.done")


class Delta(ContentEvent):
    """A piece of the content part as it is made: words, or base64 audio/pcm at the session's output rate."""

    delta: str


class OutputAudioDelta(Delta, type="response.output_audio.delta"):
    metadata: AudioDeltaMetadata | None = None  # extension (`events`): where the chunk sits in the reply


OutputAudioDone = ContentEvent.retyped("OutputAudioDone", "response.output_audio.done")
TranscriptDelta = Delta.retyped("TranscriptDelta", "response.output_audio_transcript.delta")


class TranscriptDone(ContentEvent, type="response.output_audio_transcript.done"):
    transcript: str


TextDelta = Delta.retyped("TextDelta", "response.output_text.delta")


class TextDone(ContentEvent, type="response.output_text.done"):
    text: str


# ---- client events ----

def _number(msg: JsonObject, name: str) -> float:
    value = msg.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ProtocolError(ClientCode.INVALID_VALUE, f"{name} must be a number >= 0", name)
    return float(value)


def _id(msg: JsonObject, name: str) -> str | None:
    value = msg.get(name)
    return value if isinstance(value, str) else None


class ClientEvent(EventFields):
    """A client event, decoded from its JSON object (field types checked here, meaning in the state)."""

    @classmethod
    def decode(cls, msg: JsonObject) -> ClientEvent:
        return cls()


class SessionUpdate(ClientEvent, type="session.update"):
    session: JsonObject  # its fields checked one by one by openai_config.apply_update

    @classmethod
    def decode(cls, msg: JsonObject) -> SessionUpdate:
        session = msg.get("session")
        if not isinstance(session, dict):
            raise ProtocolError(ClientCode.INVALID_VALUE, "session.update needs a `session` object", "session")
        return cls(session)


class AudioAppend(ClientEvent, type="input_audio_buffer.append"):
    audio: str  # base64 audio/pcm at the session's input rate
    hint: str | None = None  # extension: what the caller said, if the client knows (a backchannel?)

    @classmethod
    def decode(cls, msg: JsonObject) -> AudioAppend:
        data = msg.get("audio")
        if not isinstance(data, str) or not data:
            raise ProtocolError(ClientCode.MISSING_FIELD,
                                "input_audio_buffer.append needs `audio` (base64 audio/pcm)", "audio")
        hints = json_object(msg, "hints")
        hint = msg.get("transcript_hint") or hints.get("transcript")
        return cls(data, hint if isinstance(hint, str) else None)


BufferCommit = ClientEvent.retyped("BufferCommit", "input_audio_buffer.commit")


BufferClear = ClientEvent.retyped("BufferClear", "input_audio_buffer.clear")


class ItemCreate(ClientEvent, type="conversation.item.create"):
    item: object  # a message item's JSON, read into a `NewItem` with its parts (openai_input.read_item)
    previous_item_id: str | None = None  # where it goes: after that item ("root": first); none: last

    @classmethod
    def decode(cls, msg: JsonObject) -> ItemCreate:
        return cls(msg.get("item"), _id(msg, "previous_item_id"))


class ItemRetrieve(ClientEvent, type="conversation.item.retrieve"):
    item_id: str | None

    @classmethod
    def decode(cls, msg: JsonObject) -> ItemRetrieve:
        return cls(_id(msg, "item_id"))


ItemDelete = ItemRetrieve.retyped("ItemDelete", "conversation.item.delete")


class ItemTruncate(ClientEvent, type="conversation.item.truncate"):
    item_id: str | None
    audio_end_ms: float
    content_index: int = 0  # echoed back

    @classmethod
    def decode(cls, msg: JsonObject) -> ItemTruncate:
        index = msg.get("content_index", 0)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ProtocolError(ClientCode.INVALID_VALUE, "content_index must be an integer >= 0", "content_index")
        return cls(_id(msg, "item_id"), _number(msg, "audio_end_ms"), index)


class ResponseCreate(ClientEvent, type="response.create"):
    instructions: str | None = None  # this response's, in place of the session's
    max_output_tokens: object = None  # checked by openai_config.max_output_tokens, once the phase takes the event
    metadata: dict[str, str] | None = None  # echoed on the response (clients match their request by it)

    @classmethod
    def decode(cls, msg: JsonObject) -> ResponseCreate:
        spec = json_object(msg, "response")
        instructions = spec.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ProtocolError(ClientCode.INVALID_VALUE,
                                "response.instructions must be a string", "response.instructions")
        return cls(instructions or None, spec.get("max_output_tokens"), _metadata(spec.get("metadata")))


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata: up to 16 string pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise ProtocolError(ClientCode.INVALID_VALUE,
                            "response.metadata holds up to 16 strings (keys up to 64 characters, "
                            "values up to 512)", "response.metadata")
    return dict(value)


ResponseCancel = ClientEvent.retyped("ResponseCancel", "response.cancel")


OutputClear = ClientEvent.retyped("OutputClear", "output_audio_buffer.clear")


class PlaybackAck(ClientEvent, type="playback.ack"):
    """Extension: how much of a response's audio the listener has heard."""

    response_id: str | None
    played_ms: float

    @classmethod
    def decode(cls, msg: JsonObject) -> PlaybackAck:
        return cls(_id(msg, "response_id"), _number(msg, "played_ms"))


SessionClose = ClientEvent.retyped("SessionClose", "session.close")


Heartbeat = ClientEvent.retyped("Heartbeat", "session.heartbeat")


CLIENT_EVENTS: dict[str, type[ClientEvent]] = {c.type: c for c in (
    SessionUpdate, AudioAppend, BufferCommit, BufferClear, ItemCreate, ItemRetrieve, ItemDelete, ItemTruncate,
    ResponseCreate, ResponseCancel, OutputClear, PlaybackAck, SessionClose, Heartbeat)}


def decode_client(msg: JsonObject) -> ClientEvent:
    cls = CLIENT_EVENTS.get(msg["type"])
    if cls is None:
        raise ProtocolError(ClientCode.UNKNOWN_EVENT, f"unknown event type {msg['type']!r}", "type")
    return cls.decode(msg)

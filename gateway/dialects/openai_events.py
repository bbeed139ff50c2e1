"""The OpenAI Realtime dialect's server events, one dataclass per `type` (pure code).

Nested payloads (a session, an item, a response) are the JSON objects OpenAI's reference describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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

"""The objects the OpenAI Realtime dialect's server events carry, typed as the spec types them (pure code): a
session, a conversation item and its content, a response with its status and usage (an error's is the envelope's,
`realtime_events.ErrorObject`).

A field the spec makes optional is left out when there is nothing to say (`NotRequired`), never sent as `null`
unless the spec's own type allows null (a response's `metadata`, an error's `param`): the official JS clients'
types reject the rest (`tests/test_js_types.py` checks every event against `openai`'s TypeScript types and the
Agents SDK's schemas). Extension keys (sent only to a client that opted in, `openai_extensions`) are marked.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict


class AudioFormat(TypedDict):
    type: Literal["audio/pcm"]
    rate: int


# ---- a conversation item (`realtime.item`) ----

class InputText(TypedDict):
    type: Literal["input_text"]
    text: str


class InputAudio(TypedDict):
    """The caller's audio: not sent back; its `transcript` is left out (no transcription runs)."""

    type: Literal["input_audio"]


class InputImage(TypedDict):
    type: Literal["input_image"]


class OutputAudio(TypedDict):
    type: Literal["output_audio"]
    transcript: str


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str


ItemContent = InputText | InputAudio | InputImage | OutputAudio | OutputText


class MessageItem(TypedDict):
    id: str
    object: Literal["realtime.item"]
    type: Literal["message"]
    role: str  # user | assistant | system
    status: str  # completed | in_progress | incomplete
    content: list[ItemContent]


# ---- a response's content part (`response.content_part.*`) ----

class AudioPart(TypedDict):
    type: Literal["audio"]
    transcript: str


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


# ---- a response (`realtime.response`) ----

class ErrorDetails(TypedDict):
    type: str
    code: str
    message: str


class StatusDetails(TypedDict):
    type: str  # the response's status: cancelled | incomplete | failed
    reason: NotRequired[str]  # the spec's: turn_detected | client_cancelled | max_output_tokens
    cause: NotRequired[str]  # extension (`events`): the reason in our words
    error: NotRequired[ErrorDetails]  # failed


class InputTokenDetails(TypedDict):
    text_tokens: int
    audio_tokens: int
    image_tokens: int
    cached_tokens: int


class OutputTokenDetails(TypedDict):
    text_tokens: int
    audio_tokens: int


class ResponseUsage(TypedDict):
    total_tokens: int
    input_tokens: int
    output_tokens: int
    input_token_details: InputTokenDetails
    output_token_details: OutputTokenDetails


class AudioOutput(TypedDict):
    format: AudioFormat
    voice: str


class ResponseAudio(TypedDict):
    output: AudioOutput


class ContextWindow(TypedDict):
    """Extension (`events`): the LLM context the session has, and what is left of it."""

    limit: int
    remaining: int


class RealtimeResponse(TypedDict):
    id: str
    object: Literal["realtime.response"]
    status: str  # in_progress | completed | cancelled | incomplete | failed
    status_details: NotRequired[StatusDetails]  # once it ended otherwise than completed
    output: list[MessageItem]
    output_modalities: list[str]
    audio: ResponseAudio
    metadata: dict[str, str] | None  # the client's, from its response.create (the spec allows null)
    usage: NotRequired[ResponseUsage]  # once it ended
    context_window: NotRequired[ContextWindow]  # extension (`events`), once it ended


class ContentIds(TypedDict):
    """Where a content event's part is: a response's one output item's one content part."""

    response_id: str
    item_id: str
    output_index: int
    content_index: int


class AudioDeltaMetadata(TypedDict):
    """Extension (`events`): where an audio delta sits in its reply."""

    epoch: int
    audio_start_ms: int
    audio_ms: int
    kv_cache_length: int


# ---- a session (`realtime.session`) ----

class ServerVadObject(TypedDict):
    type: Literal["server_vad"]
    threshold: float
    prefix_padding_ms: int
    silence_duration_ms: int
    create_response: bool
    interrupt_response: bool


class SemanticVadObject(TypedDict):
    type: Literal["semantic_vad"]
    eagerness: str
    create_response: bool
    interrupt_response: bool


class AudioInput(TypedDict):
    format: AudioFormat
    turn_detection: ServerVadObject | SemanticVadObject | None  # null: none (the client commits; duplex)


class SessionAudio(TypedDict):
    input: AudioInput
    output: AudioOutput


class RealtimeSession(TypedDict):
    id: str
    object: Literal["realtime.session"]
    type: Literal["realtime"]
    model: str
    instructions: str
    output_modalities: list[str]
    audio: SessionAudio
    max_output_tokens: int
    duplex: NotRequired[bool]  # extension (`duplex`): the model's own turns
    # extension (`events`): the session's vendor keys (the model's options ride beside them: `SessionShown`)
    overlap_policy: NotRequired[str]
    overlap_short_ack_ms: NotRequired[int]
    overlap_barge_in_ms: NotRequired[int]
    overlap_silence_rms: NotRequired[float]
    playback_commit_policy: NotRequired[str]
    epoch: NotRequired[int]


class Capabilities(TypedDict):
    """Extension (`events`), on `session.created`: what this server offers."""

    duplex: bool
    barge_in: bool
    truncate: bool
    playback_ack: bool
    resume: bool
    server_vad: bool
    semantic_vad: bool
    chunk_period_ms: int
    input_rates: list[int]


"""One response of the OpenAI Realtime dialect and the server events that tell its story (pure code): what
opening it says, each delta, what ending it says. Whether it may open or end is `openai_states`' business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minicpmo_triton.duplex_contract import StepEvent
from minicpmo_triton.model_config import DuplexDefaults

from ..audio import OUTPUT_RATE, encode_pcm16_base64, resample
from ..wire import Usage
from . import openai_events as oe
from .openai_config import RealtimeConfig
from .openai_conversation import Item
from .openai_duplex import Mark
from .openai_extensions import Extensions
from .openai_objects import (
    AudioDeltaMetadata,
    AudioPart,
    ContentIds,
    RealtimeResponse,
    ResponseUsage,
    StatusDetails,
    TextPart,
)
from .state import ServerEvent

# The LLM context a session has (what `response.context_window` reports left, with `events`). Not told as
# `rate_limits.updated`: the spec's rate limits are requests and tokens per minute, which this is not.
CONTEXT_TOKENS = DuplexDefaults().context_tokens


@dataclass
class Response:
    id: str
    item: Item
    epoch: int
    before: Mark = Mark()  # duplex: where to roll back to if nothing of it was heard
    usage: Usage = field(default_factory=Usage)
    first_audio_at: float | None = None
    ack_ms: float = 0.0
    ack_at: float | None = None
    done: bool = False
    kv_length: int = 0
    metadata: dict[str, str] | None = None  # the client's, from its response.create: echoed

    def ids(self) -> ContentIds:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def count(self, ev: StepEvent) -> None:
        if ev.chunk_usage:
            self.usage.add(ev.chunk_usage)


def response_dict(r: Response, config: RealtimeConfig, ext: Extensions, status: str = "in_progress",
                  details: StatusDetails | None = None) -> RealtimeResponse:
    """The response as `response.created | done` show it: an open one says nothing of its end (no status details,
    no usage: left out, not null)."""
    out: RealtimeResponse = {
        "id": r.id, "object": "realtime.response", "status": status,
        "output": [r.item.to_dict()] if status != "in_progress" else [],
        "output_modalities": list(config.output_modalities),
        "audio": {"output": {"format": {"type": "audio/pcm", "rate": config.output_rate}, "voice": config.voice}},
        "metadata": r.metadata,
    }
    if details is not None:
        out["status_details"] = details
    if status != "in_progress":
        out["usage"] = usage_block(r.usage.counts)
        if ext.events:
            out["context_window"] = {"limit": CONTEXT_TOKENS, "remaining": max(0, CONTEXT_TOKENS - r.kv_length)}
    return out


def content_part(config: RealtimeConfig, text: str) -> AudioPart | TextPart:
    """The part as `response.content_part.*` name it (`audio` / `text`; the item itself says `output_audio`)."""
    return {"type": "audio", "transcript": text} if config.audio_out else {"type": "text", "text": text}


def opened(r: Response, previous: str | None, config: RealtimeConfig, ext: Extensions) -> list[ServerEvent]:
    """What a response says as it opens (its item just added after `previous`)."""
    item = r.item
    return [
        oe.ResponseCreated(response_dict(r, config, ext)),
        oe.ItemAdded(previous, item.to_dict()),
        oe.OutputItemAdded(r.id, 0, item.to_dict()),
        oe.ContentPartAdded(r.id, item.id, 0, 0, content_part(config, "")),
    ]


def finished(r: Response, config: RealtimeConfig, ext: Extensions, status: str,
             details: StatusDetails | None = None) -> list[ServerEvent]:
    """What a response says as it ends with `status` (its item's status already set)."""
    item = r.item
    ids = r.ids()
    if config.audio_out:
        events: list[ServerEvent] = [oe.OutputAudioDone(**ids), oe.TranscriptDone(**ids, transcript=item.text)]
    else:
        events = [oe.TextDone(**ids, text=item.text)]
    return [
        *events,
        oe.ContentPartDone(**ids, part=content_part(config, item.text)),
        oe.OutputItemDone(r.id, 0, item.to_dict()),
        oe.ItemDone(item.to_dict()),
        oe.ResponseDone(response_dict(r, config, ext, status, details)),
    ]


def deltas(r: Response, ev: StepEvent, config: RealtimeConfig, ext: Extensions, epoch: int, now: float,
           point: int = -1, second: int = -1) -> list[ServerEvent]:
    """A step event's words or voice added to the reply, and said; `point`: where the LLM's context stands once
    they are in it, counted from the call's start (a rollback point, StepMetrics.kv_tokens_total)."""
    ids = r.ids()
    if ev.kind == "text" and ev.text:
        r.item.add_text(ev.text, voiced=config.audio_out)
        delta = oe.TranscriptDelta if config.audio_out else oe.TextDelta
        return [delta(**ids, delta=ev.text)]
    if ev.kind == "audio" and len(ev.audio) and config.audio_out:
        dur_ms = len(ev.audio) * 1000 / OUTPUT_RATE
        mark = r.item.add_audio(dur_ms, point, second)
        if r.first_audio_at is None:
            r.first_audio_at = now
        pcm = encode_pcm16_base64(resample(ev.audio, OUTPUT_RATE, config.output_rate))
        kv = ev.metrics.kv_cache_length
        metadata: AudioDeltaMetadata | None = {
            "epoch": epoch, "audio_start_ms": round(mark.start_ms), "audio_ms": round(dur_ms),
            "kv_cache_length": -1 if kv is None else int(kv),
        } if ext.events else None
        return [oe.OutputAudioDelta(**ids, delta=pcm, metadata=metadata)]
    return []


def usage_block(counts: dict[str, int]) -> ResponseUsage:
    """The stages' token counts in OpenAI's `usage` shape."""
    text_in, audio_in = counts.get("input_text_tokens", 0), counts.get("input_audio_tokens", 0)
    image_in = counts.get("input_vision_tokens", 0)
    text_out, audio_out = counts.get("output_text_tokens", 0), counts.get("output_speech_tokens", 0)
    return {
        "total_tokens": text_in + audio_in + image_in + text_out + audio_out,
        "input_tokens": text_in + audio_in + image_in,
        "output_tokens": text_out + audio_out,
        "input_token_details": {"text_tokens": text_in, "audio_tokens": audio_in, "image_tokens": image_in,
                                "cached_tokens": 0},
        "output_token_details": {"text_tokens": text_out, "audio_tokens": audio_out},
    }

"""Reading an OpenAI Realtime client frame: its CPU work, done before the state machine is touched.

`CallerAudio.read(text, plan)` parses the event, decodes its base64 audio and images, resamples the caller's
audio to 16 kHz and, when `plan.vad` says so, runs the VAD over it. It reads nothing of the session's state
but `plan` and writes only the caller audio stream's own state (its resampler, its VAD's), so the shell may
run it in a worker thread while step events wait: an append costs per second of audio 5-9 ms of Silero VAD,
0.2 ms of resampling, 0.1 ms of decoding (`python -m bench.frame_cost`, docs/realtime.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..audio import INPUT_RATE, AudioDecodeError, StreamResampler, decode_pcm16_base64, resample
from ..codes import ClientCode
from ..inputs import image_bytes
from ..limits import Limits
from ..wire import ProtocolError
from . import openai_events as oe
from .realtime_events import MAX_EVENT_BYTES, answering, event_id, parse_event

# Work that is not protocol comes in as callables (tests give stand-ins):
SpeechProbabilities = Callable[[np.ndarray], list[float]]  # 16 kHz audio -> one speech probability per VAD window
Resampling = Callable[[int, int], Callable[[np.ndarray], np.ndarray]]  # (rate in, rate out) -> a stream resampler

# One append may be as long as OpenAI takes: what base64 audio/pcm a 15 MiB event holds (245 s at 24 kHz). The
# state takes it in pieces (`Heard.pieces`), as if streamed; in duplex its seconds wait to be steps in turn.
MAX_APPEND_SAMPLES = MAX_EVENT_BYTES * 3 // 4 // 2
MAX_ITEM_ID = 64  # characters of a client's item id
PIECE = INPUT_RATE  # a long append is taken a second at a time, as a client streaming seconds sends it


@dataclass(frozen=True)
class ReadPlan:
    """What reading a frame needs to know of the session's state, taken just before."""

    input_rate: int  # of the caller's audio/pcm
    vad: bool  # run the VAD over appended audio: server VAD, or judging the caller's speech under a reply
    limits: Limits = field(default_factory=Limits.default)  # the session's cost model (fixed for its life)


@dataclass(frozen=True)
class Heard:
    """`input_audio_buffer.append`, read: the caller's audio at 16 kHz and its speech probabilities."""

    audio: np.ndarray  # float32, 16 kHz
    probs: list[float]  # one per VAD window; empty when the VAD did not run (or there is none)
    hint: str | None = None  # extension: what the caller said, if the client knows (a backchannel?)

    def pieces(self) -> list[Heard]:
        """The audio in pieces of a second, each with its share of the probabilities (to a window): a long append is
        turn-detected, judged and buffered as the same audio streamed would be."""
        n = max(1, -(-len(self.audio) // PIECE))
        if n == 1:
            return [self]
        cut = [round(k * len(self.probs) / n) for k in range(n + 1)]
        return [Heard(self.audio[k * PIECE:(k + 1) * PIECE], self.probs[cut[k]:cut[k + 1]], self.hint)
                for k in range(n)]


@dataclass(frozen=True)
class NewItem:
    """`conversation.item.create`, read: a message item's role and its content, decoded."""

    role: str  # user | assistant | system
    id: str | None = None  # the client's, kept (else the server makes one)
    after: str | None = None  # previous_item_id: where it goes ("root": first; None: last)
    text: str = ""
    audio: np.ndarray | None = None  # 16 kHz float32, in whole tenths of a second (what the audio encoder takes)
    images: list[bytes] = field(default_factory=list)  # encoded images


ClientInput = oe.ClientEvent | Heard | NewItem  # an event as the state machine takes it


@dataclass(frozen=True)
class ReadEvent:
    event: ClientInput
    event_id: str | None  # the client's, so a refusal names the event it answers


class CallerAudio:
    """The caller's audio stream as it arrives: resampled to 16 kHz chunk after chunk (no seams), and, when asked,
    its speech probabilities (a VAD keeps its recurrent state per stream)."""

    def __init__(self, vad: SpeechProbabilities | None, resampling: Resampling = StreamResampler) -> None:
        self.vad = vad
        self.resampling = resampling
        self._resampler: Callable[[np.ndarray], np.ndarray] | None = None
        self._rate = 0

    def read(self, text: str, plan: ReadPlan) -> ReadEvent:
        return self.read_event(parse_event(text, None), plan)  # not JSON: an error, the session goes on

    def read_event(self, msg: dict[str, Any], plan: ReadPlan) -> ReadEvent:
        with answering(client_event_id := event_id(msg)):
            return ReadEvent(self._read(oe.decode_client(msg), plan), client_event_id)

    def _read(self, event: oe.ClientEvent, plan: ReadPlan) -> ClientInput:
        if isinstance(event, oe.AudioAppend):
            return self.hear(event.audio, plan, event.hint)
        if isinstance(event, oe.ItemCreate):
            return read_item(event.item, plan.input_rate, event.previous_item_id, plan.limits)
        return event

    def hear(self, data: str, plan: ReadPlan, hint: str | None = None) -> Heard:
        rate = plan.input_rate
        try:
            pcm = decode_pcm16_base64(data, MAX_APPEND_SAMPLES)
        except AudioDecodeError as exc:
            raise ProtocolError(ClientCode.BAD_AUDIO, str(exc), "audio") from exc
        if self._resampler is None or self._rate != rate:
            self._resampler, self._rate = self.resampling(rate, INPUT_RATE), rate
        audio = self._resampler(pcm)
        probs = self.vad(audio) if self.vad is not None and plan.vad else []
        return Heard(audio, probs, hint)


def whole_tenths(audio: np.ndarray) -> np.ndarray:
    """Zero-padded to whole tenths of a second: what the audio encoder takes."""
    return np.pad(audio, (0, -len(audio) % (INPUT_RATE // 10)))


def read_item(raw: Any, input_rate: int, after: str | None = None, limits: Limits | None = None) -> NewItem:
    """A message item's content, checked and decoded (what the session's state has no say in), within the
    cost model's bounds: its text, its images (how many, their pixels, their format), its audio."""
    limits = limits or Limits.default()
    if not isinstance(raw, dict) or raw.get("type", "message") != "message":
        raise ProtocolError(ClientCode.INVALID_VALUE, "item must be a message", "item")
    item_id = raw.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not 0 < len(item_id) <= MAX_ITEM_ID):
        raise ProtocolError(ClientCode.INVALID_VALUE,
                            f"item.id must be a string of 1 to {MAX_ITEM_ID} characters", "item.id")
    role = raw.get("role")
    if role not in ("user", "assistant", "system"):
        raise ProtocolError(ClientCode.INVALID_VALUE, "item.role must be user, assistant or system", "item.role")
    content = raw.get("content") or []
    if not isinstance(content, list):
        raise ProtocolError(ClientCode.INVALID_VALUE, "item.content must be a list", "item.content")
    text, audio, images = "", None, []
    for part in content:
        if not isinstance(part, dict):
            raise ProtocolError(ClientCode.INVALID_VALUE, "each content part must be an object", "item.content")
        kind = part.get("type")
        if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
            text += part["text"]
        elif kind == "input_audio" and isinstance(part.get("audio"), str):
            audio = whole_tenths(_item_audio(part["audio"], input_rate, limits.audio_samples(input_rate)))
        elif kind == "input_image":
            images.append(_item_image(part))
        else:
            raise ProtocolError(ClientCode.INVALID_VALUE, f"unsupported content part {kind!r}", "item.content")
    if not text and audio is None and not images:
        raise ProtocolError(ClientCode.MISSING_FIELD, "the item has no text, audio or image content", "item.content")
    limits.text(text, "item.content.text")
    limits.images(images, "item.content")
    return NewItem(role, item_id, after, text, audio, images)


def _item_audio(data: str, rate: int, most: int) -> np.ndarray:
    try:
        return resample(decode_pcm16_base64(data, most), rate, INPUT_RATE)
    except AudioDecodeError as exc:
        raise ProtocolError(ClientCode.BAD_AUDIO, str(exc), "item.content.audio") from exc


def _item_image(part: dict[str, Any]) -> bytes:
    url = part.get("image_url")
    data = url.split(",", 1)[-1] if isinstance(url, str) else part.get("image")
    if not isinstance(data, str):
        raise ProtocolError(ClientCode.BAD_IMAGE, "input_image needs a base64 image or data URL", "item.content")
    return image_bytes(data)  # valid base64, its size, a format the server decodes

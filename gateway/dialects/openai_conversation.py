"""The conversation a Realtime session keeps: its items, and for spoken replies which words went with
which stretch of audio, so a cut at `audio_end_ms` leaves exactly the words the listener heard; and the caller's
audio not made an item yet (turn-based: the input buffer) (pure code).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..audio import INPUT_RATE
from ..codes import ClientCode
from ..wire import ProtocolError, new_id
from .openai_objects import ItemContent, MessageItem


@dataclass
class AudioMark:
    """One stretch of a reply's audio and the words voiced in it."""

    start_ms: float
    dur_ms: float
    text: str
    kv_after: int = -1  # duplex: the LLM's kv length once this step's words were in its context
    second: int = -1  # duplex: the second of caller audio whose step made it


@dataclass
class Item:
    id: str
    role: str  # user | assistant | system
    text: str = ""
    audio: np.ndarray | None = None  # user audio, 16 kHz float32
    images: list[bytes] = field(default_factory=list)  # encoded images
    status: str = "completed"
    # assistant replies
    spoken: bool = True  # an audio reply (else text only)
    marks: list[AudioMark] = field(default_factory=list)
    unvoiced: str = ""  # words not voiced yet (text leads audio)
    audio_ms: float = 0.0  # audio sent
    truncated_ms: float | None = None

    def add_text(self, text: str, voiced: bool) -> None:
        self.text += text
        if voiced:
            self.unvoiced += text

    def add_audio(self, dur_ms: float, kv_after: int = -1, second: int = -1) -> AudioMark:
        mark = AudioMark(self.audio_ms, dur_ms, self.unvoiced, kv_after, second)
        self.marks.append(mark)
        self.unvoiced = ""
        self.audio_ms += dur_ms
        return mark

    def heard_text(self, end_ms: float) -> str:
        """The words voiced before `end_ms`; a stretch cut in its middle keeps that share of its words."""
        out = []
        for m in self.marks:
            if m.start_ms >= end_ms:
                break
            share = 1.0 if m.dur_ms <= 0 else min(1.0, (end_ms - m.start_ms) / m.dur_ms)
            out.append(m.text[: round(len(m.text) * share)])
        return "".join(out)

    def heard_marks(self, end_ms: float) -> list[AudioMark]:
        return [m for m in self.marks if m.start_ms < end_ms]

    def truncate(self, end_ms: float) -> float:
        """Cut the reply to what was heard, clamped to the audio sent; returns the cut point."""
        end_ms = max(0.0, min(float(end_ms), self.audio_ms))
        if self.truncated_ms is not None:
            end_ms = min(end_ms, self.truncated_ms)  # a cut can only move earlier
        self.truncated_ms = end_ms
        self.text = self.heard_text(end_ms)
        self.unvoiced = ""
        return end_ms

    @property
    def nbytes(self) -> int:
        """What the item holds in memory (and ships with a turn-based response): text, audio, images."""
        audio = 0 if self.audio is None else self.audio.nbytes
        return len(self.text.encode("utf-8")) + audio + sum(len(i) for i in self.images)

    def to_dict(self) -> MessageItem:
        content: list[ItemContent]
        if self.role == "assistant":
            content = [{"type": "output_audio", "transcript": self.text} if self.spoken
                       else {"type": "output_text", "text": self.text}]
        else:
            content = []
            if self.text:
                content.append({"type": "input_text", "text": self.text})
            if self.audio is not None:
                content.append({"type": "input_audio"})  # no transcription runs: no `transcript` to say
            content += [{"type": "input_image"} for _ in self.images]
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": content}


@dataclass
class Conversation:
    items: list[Item] = field(default_factory=list)

    def add(self, item: Item, after: str | None = None) -> str | None:
        """Put `item` after the item `after` ("root": first; None: last); returns the id it now follows. Ids are
        unique among the items there (a deleted item's id may come back: LiveKit re-creates an item it edits)."""
        if any(i.id == item.id for i in self.items):
            raise ProtocolError(ClientCode.ITEM_CREATE_DUPLICATE_ITEM_ID,
                                f"the conversation already has an item {item.id!r}",
                                "item.id")
        if after is None:
            index = len(self.items)
        elif after == "root":
            index = 0
        else:
            try:
                index = self.items.index(self.get(after)) + 1
            except ProtocolError as err:
                err.param = "previous_item_id"
                raise
        self.items.insert(index, item)
        return self.items[index - 1].id if index else None

    def get(self, item_id: Any) -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise ProtocolError(ClientCode.ITEM_NOT_FOUND, f"no conversation item {item_id!r}", "item_id")

    def delete(self, item_id: Any) -> None:
        self.items.remove(self.get(item_id))

    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)

    def trim(self, most_items: int, most_bytes: int, keep: tuple[Item | None, ...]) -> list[str]:
        """Forget the oldest items (but those in `keep`) until at most `most_items` items of `most_bytes` are
        left; the ids forgotten."""
        gone: list[str] = []
        held = self.nbytes()
        for item in list(self.items):
            if len(self.items) <= most_items and held <= most_bytes:
                break
            if any(item is k for k in keep):
                continue
            self.items.remove(item)
            held -= item.nbytes
            gone.append(item.id)
        return gone

    def new_item(self, role: str, **kw: Any) -> Item:
        return Item(new_id("item"), role, **kw)


@dataclass
class InputBuffer:
    """The caller's audio since the last commit (turn-based), 16 kHz float32: the next user item's."""

    most_s: float = 60.0  # as a message item may hold (the session's limits.item_audio_s)
    chunks: list[np.ndarray] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(len(c) for c in self.chunks)

    def room(self, samples: int) -> bool:
        return self.samples + samples <= self.most_s * INPUT_RATE

    def full(self) -> ProtocolError:
        return ProtocolError(ClientCode.INPUT_AUDIO_BUFFER_FULL, f"the input buffer holds at most {self.most_s:.0f} s; "
                             "commit or clear it (this append was dropped)")

    def add(self, audio: np.ndarray) -> None:
        self.chunks.append(audio)

    def keep_last(self, samples: int) -> None:
        """Only the last `samples` (before speech starts, its prefix padding is all worth keeping)."""
        tail = np.concatenate(self.chunks)[-samples:] if samples and self.chunks else np.zeros(0, np.float32)
        self.chunks = [tail] if len(tail) else []

    def take(self) -> np.ndarray:
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        self.chunks = []
        return audio

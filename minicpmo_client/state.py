"""A conversation's client-side state (pure code): the server's events in, typed client events out.

It keeps what a resume needs (session id, resume token, the last `server_event_seq`), drops events a
replay repeats, counts the seqs that never came, and follows each reply: its id, transcript, whether
audio came and how long after the caller's last input the first audio arrived. Time comes in as `now`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .events import (
    RETRYABLE_CODES,
    AudioChunk,
    BargeIn,
    ClientEvent,
    Closed,
    Error,
    Listening,
    ReplyStarted,
    TranscriptDelta,
    TurnFinal,
    UserTurn,
)
from .wire import decode_pcm16

# Per-attachment events: they carry the current seq but are not journaled, so replays never repeat them.
CONTROL_EVENTS = frozenset({"session.resumed", "session.resync_required", "session.replaced"})


@dataclass
class Reply:
    id: str
    input_at: float | None  # the caller's last input when the reply opened
    transcript: str = ""
    first_audio_at: float | None = None
    item_id: str | None = None  # its conversation item (what a truncate names)


@dataclass
class ConversationState:
    output_rate: int = 24_000
    session_id: str | None = None
    resume_token: str | None = None
    last_seq: int = 0
    missed: int = 0  # seqs that never arrived (a journal gap)
    reply: Reply | None = None  # in progress
    last_reply: Reply | None = None  # in progress or done (its audio may still be playing)
    closed: str | None = None  # the reason, once the session ended
    _last_input_at: float | None = None

    @property
    def replying(self) -> bool:
        return self.reply is not None

    def note_input(self, now: float) -> None:
        """The client sent the caller's input (audio, text): a reply's latency counts from the last one."""
        self._last_input_at = now

    def on_server(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        kind = ev.get("type", "")
        if kind in CONTROL_EVENTS:
            return self._control(kind, ev)
        seq = ev.get("server_event_seq")
        if isinstance(seq, int) and seq > 0:  # 0: a refusal before any session
            if seq <= self.last_seq:
                return []  # a replay repeating what we have
            self.missed += seq - self.last_seq - 1
            self.last_seq = seq
        handler = _HANDLERS.get(kind)
        return handler(self, ev, now) if handler is not None else []

    def _control(self, kind: str, ev: dict[str, Any]) -> list[ClientEvent]:
        if ev.get("resume_token"):
            self.resume_token = ev["resume_token"]
        if kind == "session.replaced":
            self.closed = "replaced"
            return [Closed("replaced")]
        return []

    def _created(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        self.session_id = ev.get("session", {}).get("id")
        self.resume_token = ev.get("resume_token")
        return []

    def _user(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        kind = ev["type"].rsplit(".", 1)[1]
        return [UserTurn(kind, ev.get("item_id"), ev.get("audio_start_ms", ev.get("audio_end_ms")))]

    def _item_added(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        item = ev.get("item") or {}
        if item.get("role") != "user":
            return []
        text = "".join(p.get("text") or "" for p in item.get("content", []) if p.get("type") == "input_text")
        return [UserTurn("committed", item.get("id"), text=text)]

    def _created_response(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        rid = ev["response"]["id"]
        self.reply = self.last_reply = Reply(rid, self._last_input_at)
        return [ReplyStarted(rid)]

    def _output_item(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        if self.reply is not None and ev.get("response_id") == self.reply.id:
            self.reply.item_id = (ev.get("item") or {}).get("id")
        return []

    def _transcript(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        if self.reply is None or ev.get("response_id") != self.reply.id:
            return []
        self.reply.transcript += ev.get("delta", "")
        return [TranscriptDelta(self.reply.id, ev.get("delta", ""))]

    def _audio(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        if self.reply is None or ev.get("response_id") != self.reply.id:
            return []
        if self.reply.first_audio_at is None:
            self.reply.first_audio_at = now
        return [AudioChunk(self.reply.id, decode_pcm16(ev.get("delta", "")), self.output_rate)]

    def _done(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        response = ev.get("response") or {}
        rid: str = response.get("id", "")
        status: str = response.get("status", "completed")
        reply, self.reply = self.reply, None
        if reply is None or reply.id != rid:
            reply = Reply(rid, None)
        out: list[ClientEvent] = []
        if status == "cancelled":  # why, in the server's words (`cause`), else the spec's
            details = response.get("status_details") or {}
            out.append(BargeIn(rid, details.get("cause") or details.get("reason") or "cancelled"))
        had_audio = reply.first_audio_at is not None
        if had_audio:
            out.append(AudioChunk(rid, np.zeros(0, np.float32), self.output_rate, is_final=True))
        latency = None
        if reply.first_audio_at is not None and reply.input_at is not None:
            latency = (reply.first_audio_at - reply.input_at) * 1000
        kept = _transcript(response)
        out.append(TurnFinal(rid, reply.transcript if kept is None else kept, had_audio, status, latency))
        return out

    def _listen(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        return [Listening(ev.get("response_id"), bool(ev.get("end_of_turn")))]

    def _error(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        err = ev.get("error") or {}
        code = err.get("code") or "unknown_error"
        return [Error(code, err.get("message", ""), code in RETRYABLE_CODES)]

    def _closed(self, ev: dict[str, Any], now: float) -> list[ClientEvent]:
        self.closed = ev.get("reason") or "closed"
        return [Closed(self.closed)]


def _transcript(response: dict[str, Any]) -> str | None:
    """The reply's words as the server kept them (cut to what was heard after a barge-in)."""
    for item in response.get("output") or []:
        for part in item.get("content") or []:
            text = part.get("transcript", part.get("text"))
            if isinstance(text, str):
                return text
    return None


_HANDLERS = {
    "session.created": ConversationState._created,
    "input_audio_buffer.speech_started": ConversationState._user,
    "input_audio_buffer.speech_stopped": ConversationState._user,
    "conversation.item.added": ConversationState._item_added,
    "response.created": ConversationState._created_response,
    "response.output_item.added": ConversationState._output_item,
    "response.output_audio_transcript.delta": ConversationState._transcript,
    "response.output_text.delta": ConversationState._transcript,
    "response.output_audio.delta": ConversationState._audio,
    "response.done": ConversationState._done,
    "response.listen": ConversationState._listen,
    "error": ConversationState._error,
    "session.closed": ConversationState._closed,
}

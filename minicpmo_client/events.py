"""What a conversation yields: typed events (dataclasses), and the one error type the client raises."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Error codes worth retrying: the server is busy or still loading, or an input was dropped under load.
RETRYABLE_CODES = frozenset({"too_many_sessions", "not_ready", "queue_full", "input_backpressure",
                             "backend_unavailable", "connection_lost"})


class ClientError(Exception):
    """Every failure the client reports: a server error code or one of its own
    (`connection_lost`, `resume_failed`, `handshake_failed`, `voice_check_unavailable`)."""

    def __init__(self, code: str, message: str, retryable: bool | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = code in RETRYABLE_CODES if retryable is None else retryable


@dataclass(frozen=True)
class ReplyEvent:
    """An event about one reply of the assistant, named by its response id."""

    response_id: str


@dataclass(frozen=True)
class AudioChunk(ReplyEvent):
    """Reply audio: float32 mono in [-1, 1] at `sample_rate`. Each reply ends with an empty chunk
    whose `is_final` is set (only for replies that had audio)."""

    pcm: np.ndarray
    sample_rate: int
    is_final: bool = False

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / self.sample_rate


@dataclass(frozen=True)
class ReplyStarted(ReplyEvent):
    """The assistant opened a reply (it is about to speak)."""


@dataclass(frozen=True)
class TranscriptDelta(ReplyEvent):
    """Words of the assistant's reply, as they are made (they lead their audio)."""

    text: str


@dataclass(frozen=True)
class Listening:
    """The assistant listens again (model-native duplex: `end_of_turn` when it finished its turn)."""

    response_id: str | None
    end_of_turn: bool


@dataclass(frozen=True)
class UserTurn:
    """The caller's side of a turn: `speech_started`, `speech_stopped` (server VAD) or `committed`
    (a user item entered the conversation: committed audio or a typed query)."""

    kind: str
    item_id: str | None
    audio_ms: int | None = None
    text: str = ""


@dataclass(frozen=True)
class BargeIn(ReplyEvent):
    """A reply was cut: by the caller's speech (`barge_in`), `interrupt()` (`client_cancelled`), ..."""

    reason: str


@dataclass(frozen=True)
class TurnFinal(ReplyEvent):
    """A reply ended. `transcript` is what was said (cut to what was heard after a barge-in);
    `latency_ms`: from the caller's last input before the reply to its first audio (None without audio)."""

    transcript: str
    had_audio: bool
    status: str  # completed | cancelled | incomplete | failed
    latency_ms: float | None = None


@dataclass(frozen=True)
class Error:
    """An error the server reported; the session goes on (fatal ones end `converse` with a ClientError)."""

    code: str
    message: str
    retryable: bool


@dataclass(frozen=True)
class Resumed:
    """The socket dropped and the client reattached to the same session. `gap`: some server events were
    lost for good (the server's journal no longer held them)."""

    attempt: int
    replayed: int
    gap: bool


@dataclass(frozen=True)
class Closed:
    """The session ended (the last event of a conversation)."""

    reason: str


ClientEvent = AudioChunk | ReplyStarted | TranscriptDelta | Listening | UserTurn | BargeIn | TurnFinal | Error \
    | Resumed | Closed

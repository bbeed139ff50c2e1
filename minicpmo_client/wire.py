"""The client's side of the OpenAI Realtime dialect on `/v1/realtime` (pure code): the events it sends,
and audio/pcm (base64 16-bit little-endian mono) both ways."""

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import numpy as np

MAX_APPEND_S = 5  # a long recording goes in appends of this (the server takes up to a 15 MiB event)
RATES = (16_000, 24_000)
# What this client opts into on /v1/realtime (a stock OpenAI client gets the spec alone): the model's own turns,
# and the extension events and fields it reads (`response.listen`, `session.closed`, seqs and a resume token).
EXTENSIONS = "duplex,events"
TURN_DETECTION = ("duplex", "server_vad", "semantic_vad", None)


def encode_pcm16(audio: np.ndarray) -> str:
    pcm = np.clip(np.round(np.asarray(audio, np.float32) * 32768.0), -32768, 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode("ascii")


def decode_pcm16(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), "<i2").astype(np.float32) / 32768.0


def event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


def session_update(*, instructions: str | None, voice: str | None, turn_detection: str | None,
                   input_rate: int, output_rate: int, extra: dict[str, Any] | None = None) -> str:
    """`turn_detection`: "duplex" (the model decides when to speak: `duplex: true`), "server_vad", "semantic_vad",
    or None (manual); the spec's `turn_detection` beside it (null for duplex, which has no VAD turns)."""
    td = None if turn_detection in (None, "duplex") else {"type": turn_detection}
    session: dict[str, Any] = {"audio": {
        "input": {"format": {"type": "audio/pcm", "rate": input_rate}, "turn_detection": td},
        "output": {"format": {"type": "audio/pcm", "rate": output_rate}},
    }, "duplex": turn_detection == "duplex", **(extra or {})}
    if voice is not None:
        session["audio"]["output"]["voice"] = voice
    if instructions is not None:
        session["instructions"] = instructions
    return event("session.update", session=session)


def appends(audio: np.ndarray, rate: int) -> list[str]:
    """`input_audio_buffer.append` events for float32 audio at the session's input rate (split at 5 s)."""
    step = MAX_APPEND_S * rate
    return [event("input_audio_buffer.append", audio=encode_pcm16(audio[i:i + step]))
            for i in range(0, len(audio), step)]


def user_text(text: str) -> list[str]:
    """A typed query: a user item, then a response (every turn-detection mode)."""
    return [event("conversation.item.create", item={"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": text}]}),
            event("response.create")]


def assistant_text(text: str) -> list[str]:
    """A welcome line: an assistant item the server voices as the assistant's turn."""
    return [event("conversation.item.create", item={"type": "message", "role": "assistant",
                                                    "content": [{"type": "output_text", "text": text}]}),
            event("response.create")]


def truncate(item_id: str, played_ms: float) -> str:
    """The reply was heard up to `played_ms`: the server stops it if it is still going and keeps only that."""
    return event("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=max(0, round(played_ms)))


def resume(session_id: str, token: str, last_seq: int) -> str:
    return event("session.resume", session_id=session_id, resume_token=token, last_received_server_event_seq=last_seq)


def with_query(url: str, **params: str) -> str:
    """`url` with query parameters added (kept: those it has)."""
    parts = urlsplit(url)
    query = "&".join(q for q in (parts.query, urlencode(params)) if q)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


def with_extensions(url: str) -> str:
    """`url` opting into this client's extensions, unless it names some itself."""
    return url if "extensions" in parse_qs(urlsplit(url).query) else with_query(url, extensions=EXTENSIONS)


def redirected(url: str, target: object) -> str:
    """Where a `session_elsewhere` redirect sends a resume: the target's scheme, host and path, with this URL's
    own query kept (the dialect's mode, a key given in the query). ValueError for a target that is no ws(s)
    URL, or that would move a wss:// session to plain ws:// (its key would then travel in clear)."""
    if not isinstance(target, str):
        raise ValueError("the redirect names no URL")
    to, here = urlsplit(target), urlsplit(url)
    if to.scheme not in ("ws", "wss") or not to.netloc:
        raise ValueError(f"not a ws:// or wss:// URL: {target!r}")
    if here.scheme == "wss" and to.scheme != "wss":
        raise ValueError(f"refused: {target} would drop TLS")
    query = "&".join(q for q in (to.query, here.query) if q)
    return urlunsplit((to.scheme, to.netloc, to.path or here.path, query, ""))


def http_base(ws_url: str) -> str:
    """`ws://host:port/v1/realtime?...` -> `http://host:port`."""
    parts = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "", "", ""))

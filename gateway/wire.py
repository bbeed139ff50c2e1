"""What every dialect shares on the wire: close codes, the one client-error type, ids and usage (pure code)."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .codes import ClientCode

T = TypeVar("T")

# A JSON object as parsed from a client: opaque until a parse function reads its fields into typed values (a
# dialect's client event; `session.update`'s `session`, read field by field by `openai_config`).
JsonObject = dict[str, Any]

# WebSocket close codes
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server shutdown
CLOSE_UNSUPPORTED_DATA = 1003  # not JSON
CLOSE_POLICY = 1008  # a protocol violation by the client
CLOSE_SERVER_ERROR = 1011
CLOSE_TRY_AGAIN = 1013  # not ready, or no session slot


class ProtocolError(Exception):
    """A client error, answered with the dialect's `error` event; `close_code` set when the socket closes too.
    `param` and `error_type` are what the Realtime dialects report beside the code; `http_status` what an
    HTTP endpoint answers with it (else 400)."""

    def __init__(self, code: ClientCode, message: str, param: str | None = None, close_code: int | None = None,
                 error_type: str = "invalid_request_error", retryable: bool = False,
                 http_status: int | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable  # the same request may succeed later (a new session, after a backoff)
        self.code = ClientCode(code)  # a string that is no member fails here, where it is raised
        self.message = message
        self.param = param
        self.close_code = close_code
        self.error_type = error_type
        self.http_status = http_status
        self.event_id: str | None = None  # the client event it answers (the Realtime dialects report it)
        self.redirect_url: str | None = None  # session_elsewhere: where the session is (gateway.peers)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


def new_session_id() -> str:
    return f"sess_{uuid.uuid4().hex[:12]}"


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex[:12]}"


USAGE_KEYS = ("input_text_tokens", "input_audio_tokens", "input_vision_tokens", "output_text_tokens",
              "output_speech_tokens")


@dataclass
class Usage:
    """Token counts as the stages report them, summed."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE_KEYS, 0))

    def add(self, chunk: dict[str, int]) -> dict[str, int]:
        for key in USAGE_KEYS:
            self.counts[key] += int(chunk.get(key, 0))
        return self.snapshot()

    def snapshot(self) -> dict[str, int]:
        snap = dict(self.counts)
        snap["total_tokens"] = sum(self.counts.values())
        return snap


# ---- JSON limits: every client frame is parsed here, by every dialect ----
JSON_MAX_DEPTH = 32  # arrays/objects inside one another; no event of any dialect needs more than 6
JSON_MAX_NUMBER_CHARS = 100  # characters of one number literal (a float64 needs under 25)
# Commas and opening brackets outside strings, counted before the parser runs: a frame holds at most about twice as
# many values. Parsing costs per value (16 MiB of `[0,0,...]` is 8 M of them: seconds of the one event loop's time),
# and no event of any dialect comes near it (a turn of 256 messages with images is under 3,000; audio and images
# travel as base64 strings).
JSON_MAX_ITEMS = 8192
_SURROGATE = re.compile("[\ud800-\udfff]")
# A frame this long is read (parsed, its base64 decoded) in a worker thread, off the event loop (`off_loop`); a
# step's append of a second of audio (85 kB of base64 float32 at 16 kHz) stays on it, where a hand-off would only
# make it later.
LARGE_FRAME_BYTES = 1 << 20
_COMMA, _OPEN_ARRAY, _OPEN_OBJECT, _QUOTE, _BACKSLASH = (ord(c) for c in ',[{"\\')


def _items(data: bytes) -> int:
    """Commas and opening brackets of a JSON text outside its strings (or a number past JSON_MAX_ITEMS), in a few
    passes of numpy over its bytes, each of which leaves the GIL to the event loop: a string holds any of them as
    text. Where the text is not JSON the count may be off past the first error, where the parser stops."""
    arr = np.frombuffer(data, np.uint8)
    structural = (arr == _COMMA) | (arr == _OPEN_ARRAY) | (arr == _OPEN_OBJECT)
    items = int(np.count_nonzero(structural))
    if items <= JSON_MAX_ITEMS:
        return items  # strings and all: under the bound anyway
    if b"\\" in data:  # escaped backslashes, then escaped quotes: every quote left opens or closes a string
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        arr = np.frombuffer(data, np.uint8)
        structural = (arr == _COMMA) | (arr == _OPEN_ARRAY) | (arr == _OPEN_OBJECT)
        items = int(np.count_nonzero(structural))
    is_quote = arr == _QUOTE
    if (n_quotes := int(np.count_nonzero(is_quote))) > 2 * (2 * JSON_MAX_ITEMS + 1):
        return n_quotes // 4  # k strings stand apart by a comma or a colon: at least k / 2 items
    if not n_quotes:
        return items
    quotes = np.flatnonzero(is_quote)
    # from each quote to the next: even spans are inside strings (an unterminated one runs to the end)
    spans = np.add.reduceat(structural.view(np.uint8), quotes, dtype=np.uint32)
    return items - int(spans[0::2].sum())


def check_items(text: str | bytes) -> None:
    """ValueError when a JSON text holds more than JSON_MAX_ITEMS commas and opening brackets outside its strings
    (its cost to parse), found before it is parsed."""
    if len(text) <= JSON_MAX_ITEMS:
        return  # cannot hold more
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    if (items := _items(data)) > JSON_MAX_ITEMS:
        raise ValueError(f"{items} values (commas and brackets) in one message (at most {JSON_MAX_ITEMS})")


# The worker large frames are read on: one, so that at most one reading at a time holds the GIL in a long C call
# (a JSON string's scan, a base64 decode) while the event loop waits for it; 12 callers' 5 MB voice references read in
# as many threads at once held the loop up to 250 ms.
LARGE_READS = ThreadPoolExecutor(1, thread_name_prefix="large-frames")


async def off_loop(size: int, read: Callable[..., T], *args: Any) -> T:
    """`read(*args)`, on the large-frame worker when what it reads is LARGE_FRAME_BYTES or more (its parsing and
    decoding would hold every session's event loop), else here. What it raises is raised here."""
    if size < LARGE_FRAME_BYTES:
        return read(*args)
    return await asyncio.get_running_loop().run_in_executor(LARGE_READS, functools.partial(read, *args))


def _number(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(literal: str) -> Any:
        if len(literal) > JSON_MAX_NUMBER_CHARS:
            raise ValueError(f"a number of {len(literal)} characters (at most {JSON_MAX_NUMBER_CHARS})")
        return kind(literal)
    return parse


def _check_tree(value: Any) -> None:
    """Depth and text: no deeper than JSON_MAX_DEPTH, no lone UTF-16 surrogate in a string (`"\\ud800"` is
    accepted by Python's parser but is not Unicode text: it would fail later, where it is encoded)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):  # isascii is O(1): a 16 MiB base64 is not searched
                raise ValueError("a string holds a lone UTF-16 surrogate (not Unicode text)")
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= JSON_MAX_DEPTH:
            raise ValueError(f"nested deeper than {JSON_MAX_DEPTH} levels")
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)


def json_object(message: JsonObject, key: str) -> JsonObject:
    """`message[key]` when it is a JSON object, else an empty one (absent, null, or another type)."""
    value = message.get(key)
    return value if isinstance(value, dict) else {}


def parse_json(text: str | bytes) -> Any:
    """A client frame's JSON within the limits above; ValueError (its message for the client) otherwise.
    Its values are counted before it is parsed (`check_items`); the parser's own recursion guard stops very deep
    input early (RecursionError, reported as too deep); a frame's size is bounded before it gets here (the server's
    `ws_max_size`). A large frame is parsed off the event loop (`off_loop`)."""
    check_items(text)
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        # NaN and Infinity pass (Python's reading of them): the settings' range checks refuse them by name.
        value = json.loads(text, parse_int=_number(int), parse_float=_number(float))
    except RecursionError:
        raise ValueError(f"nested deeper than {JSON_MAX_DEPTH} levels") from None
    _check_tree(value)
    return value

"""Who may come in (pure code): API keys, the browser Origin allow-list, per-key session counts, and the
rate of resume attempts. Checked by routes before any model work.

A caller's *principal* is a short fingerprint of the key it presented (never the key: it goes into logs
and ownership checks), or ANONYMOUS when the server has no keys configured.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from urllib.parse import unquote_plus

from .codes import ClientCode
from .wire import CLOSE_POLICY, CLOSE_TRY_AGAIN, ProtocolError

ANONYMOUS = "anonymous"


def unauthorized() -> ProtocolError:
    return ProtocolError(ClientCode.UNAUTHORIZED,
                         "a valid API key is required (Authorization: Bearer KEY, or ?key=KEY)",
                         close_code=CLOSE_POLICY, http_status=401)


def presented_key(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer KEY`, else the `key` query parameter (browsers cannot set headers on a WebSocket)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return query.get("key")


def fingerprint(key: str) -> str:
    return "key_" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def principal(keys: tuple[str, ...], key: str | None) -> str | None:
    """The caller's principal, or None when keys are configured and `key` is none of them. Every configured
    key is compared, in constant time, whatever matched first."""
    if not keys:
        return ANONYMOUS
    if key is None:
        return None
    given = key.encode("utf-8", "surrogatepass")
    matched = False
    for k in keys:
        matched |= hmac.compare_digest(given, k.encode("utf-8"))
    return fingerprint(key) if matched else None


def origin_allowed(allowed: tuple[str, ...], origin: str | None) -> bool:
    """No Origin header (not a browser) passes; a browser's Origin must be on the list when there is one."""
    return origin is None or not allowed or origin in allowed or "*" in allowed


class SessionCounts:
    """Live sessions per holder (a principal, an address), against `limit` (0: no limit); past it `code`."""

    def __init__(self, limit: int, code: ClientCode = ClientCode.KEY_SESSION_LIMIT, holder: str = "this key") -> None:
        self.limit = limit
        self.code = code
        self.holder = holder
        self._counts: dict[str, int] = {}

    def take(self, who: str) -> None:
        held = self._counts.get(who, 0)
        if self.limit and held >= self.limit:
            raise ProtocolError(self.code, f"{self.holder} holds {held} sessions, its limit; close one first",
                                close_code=CLOSE_TRY_AGAIN, error_type="server_error", retryable=True)
        self._counts[who] = held + 1

    @contextlib.contextmanager
    def held(self, who: str) -> Iterator[None]:
        self.take(who)
        try:
            yield
        finally:
            self.give_back(who)

    def give_back(self, who: str) -> None:
        held = self._counts.get(who, 0) - 1
        if held > 0:
            self._counts[who] = held
        else:
            self._counts.pop(who, None)


class RateLimit:
    """At most `count` attempts per `window_s` per caller (a sliding window); past it, `rate_limited`."""

    def __init__(self, count: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.count = count
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[str, deque[float]] = {}

    def check(self, who: str) -> None:
        now = self.clock()
        seen = self._seen.setdefault(who, deque())
        while seen and now - seen[0] > self.window_s:
            seen.popleft()
        if len(seen) >= self.count:
            raise ProtocolError(ClientCode.RATE_LIMITED,
                                f"at most {self.count} resume attempts per {self.window_s:.0f} s",
                                close_code=CLOSE_POLICY)
        seen.append(now)
        for other in [w for w, s in self._seen.items() if not s or now - s[-1] > self.window_s]:
            del self._seen[other]  # callers gone quiet: the table stays bounded


# A request line's query runs to the next whitespace, whatever it holds (a quote is a character of it, as Starlette
# reads it: `?x='&key=KEY` hands the gateway key=KEY)
_QUERY = re.compile(r"\?(\S*)")


def _redacted_query(match: re.Match[str]) -> str:
    """A query string with the value of every parameter that Starlette would read as `key` (split on `&` as
    `parse_qsl` does, its name percent- or plus-decoded: `?%6Bey=` is `?key=`) replaced by `***`; a closing quote
    of the log line's own (`"WebSocket /path?key=K"`) is kept."""
    parts = []
    for part in match[1].split("&"):
        name, sep, value = part.partition("=")
        if sep and unquote_plus(name) == "key":
            part = f"{name}=***" + ('"' if value.endswith('"') else "")
        parts.append(part)
    return "?" + "&".join(parts)


def redact(text: str) -> str:
    """A logged line without the value of any `key` query parameter, however its name is encoded."""
    return _QUERY.sub(_redacted_query, text)


class RedactKeys(logging.Filter):
    """For uvicorn's loggers: its access and WebSocket lines carry the query string, where browsers put keys."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True

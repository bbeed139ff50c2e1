"""Fair sharing of the session slots (pure code): no one caller holds them all, or holds one it does not use.

- `Quotas`: concurrent sessions per key (when keys are configured: with none, every caller is the one
  anonymous principal, and a per-key limit would be a server-wide one) and per client address.
- `Activity`: the idle clock of a session. Heartbeats keep a socket open but are not activity: a session that
  only sends heartbeats is closed once `idle_timeout_s` passed since its last real event, and one that has sent
  no real event yet at its first-event deadline (a heartbeat is no first event).
- `paced`: a step's budget is per event: work split into chunks (a long text spoken chunk by chunk) goes on
  as long as each chunk comes within the budget; a step that stalls is cut.
- `VoiceBudget`: seconds of new voice references per caller (principal and address) per window: each new one
  costs the shared token2wav stage a voice prompt (about 3 s of compute for 30 s of reference on 2 CPU cores,
  every session's audio waiting behind it); a reference the caller sent within the window is free (cached).
- `ResumeFailures`: only a resume that fails (a redirect to another gateway included) counts against the caller's
  resume rate, so bogus attempts by one
  caller never refuse another caller's real resume from the same address; and a failed one is answered late, so
  a caller's loop of bogus resumes makes a few connections a second, not hundreds.
- `EventRate`: client events per connection, a token bucket: a flood of small events (create/cancel pairs) costs
  the gateway's one event loop; past the rate each event is refused `rate_limited`, unread.
- `ByteRate`, `ByteBudgets`: client bytes per caller (key and address; loopback per connection), a token bucket:
  past it the caller's next frame is read only once the bucket has room again (its sender held back by TCP
  meanwhile), so a flood of 15 MiB frames costs the server at most the rate's worth of receiving and parsing,
  whatever the link carries and however often the caller reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from minicpmo_triton.stage_io import audio_key

from .audio import INPUT_RATE
from .auth import ANONYMOUS, RateLimit, SessionCounts
from .codes import ClientCode
from .wire import ProtocolError, parse_json

T = TypeVar("T")
HEARTBEAT = "session.heartbeat"  # both Realtime dialects' keep-alive
_HEARTBEAT_MAX_CHARS = 512  # a heartbeat is a small frame; a big one is read as activity without parsing it


class Quotas:
    """Per-key and per-address session counts, both held for a session's life. Loopback is not counted per
    address: it is this machine (a benchmark, or a reverse proxy that does not say whose request it forwards; one
    that does, with X-Forwarded-For, has each client counted)."""

    def __init__(self, per_key: int, per_address: int) -> None:
        self.keys = SessionCounts(per_key)
        self.addresses = SessionCounts(per_address, ClientCode.ADDRESS_SESSION_LIMIT, "this client address")

    @contextlib.contextmanager
    def held(self, who: str, address: str) -> Iterator[None]:
        with contextlib.ExitStack() as held:
            if not _loopback(address):
                held.enter_context(self.addresses.held(address))
            if who != ANONYMOUS:  # no keys configured: the address is the only way to tell callers apart
                held.enter_context(self.keys.held(who))
            yield


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def is_heartbeat(text: str) -> bool:
    if len(text) > _HEARTBEAT_MAX_CHARS or HEARTBEAT not in text:
        return False
    try:
        msg = parse_json(text)
    except ValueError:
        return False
    return isinstance(msg, dict) and msg.get("type") == HEARTBEAT


class Activity:
    """When the session last did something other than a heartbeat; how long it may still wait for a frame. With
    `first_within_s`, until it hears a real event it waits that long from its start, heartbeats or not."""

    def __init__(self, idle_timeout_s: float, first_within_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._last = clock()
        self.started = first_within_s is None  # a real event heard (or none awaited)
        self._window_s = idle_timeout_s if first_within_s is None else first_within_s

    def remaining_s(self) -> float:
        return max(0.0, self._window_s - (self.clock() - self._last))

    def heard(self, text: str) -> None:
        if not is_heartbeat(text):
            self._last = self.clock()
            self.started = True
            self._window_s = self.idle_timeout_s


ChargeVoice = Callable[[np.ndarray], None]  # a 16 kHz voice reference a caller sends: refused past its budget


class VoiceBudget:
    def __init__(self, seconds: float, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.window_s = window_s
        self.clock = clock
        self._spent: dict[str, deque[tuple[float, bytes, float]]] = {}  # caller -> (when, which, seconds)

    def charge(self, caller: str, audio: np.ndarray) -> None:
        now = self.clock()
        for who in [w for w, spent in self._spent.items() if spent and now - spent[-1][0] > self.window_s]:
            del self._spent[who]  # callers gone quiet: the table stays bounded
        spent = self._spent.setdefault(caller, deque())
        while spent and now - spent[0][0] > self.window_s:
            spent.popleft()
        key = audio_key(audio)  # the identity token2wav caches the voice's prompt by
        if any(k == key for _, k, _ in spent):
            return  # sent within the window: its prompt is cached
        seconds = len(audio) / INPUT_RATE
        if sum(s for _, _, s in spent) + seconds > self.seconds:
            raise ProtocolError(ClientCode.RATE_LIMITED, f"new voice references: at most {self.seconds:.0f} s per "
                                f"{self.window_s:.0f} s per caller; reuse one, or wait", "voice",
                                error_type="server_error", retryable=True)
        spent.append((now, key, seconds))

    def charger(self, who: str, address: str) -> ChargeVoice:
        return lambda audio: self.charge(f"{who}@{address}", audio)


class ResumeFailures:
    """`session.resume` attempts: a valid one always goes through; failed ones are counted per caller
    (principal and address), and past `attempts` per `window_s` they are answered `rate_limited`."""

    # a redirect to the gateway a token names too: a loop of bogus tokens naming another one is no faster
    RESUME_FAILURES = ("session_resume_expired", "invalid_resume_token", "invalid_value", "session_elsewhere")

    def __init__(self, attempts: int, window_s: float, delay_s: float = 0.0) -> None:
        self.rate = RateLimit(attempts, window_s)
        self.delay_s = delay_s

    @contextlib.asynccontextmanager
    async def counted(self, who: str, address: str) -> Any:
        try:
            yield
        except ProtocolError as err:
            if err.code in self.RESUME_FAILURES:
                # a real client's resume rarely fails, and it may wait a second; a loop of bogus ones is slowed
                # to one attempt per delay per socket (and the sockets per address are bounded)
                await asyncio.sleep(self.delay_s)
                self.rate.check(f"{who}@{address}")  # raises rate_limited past the limit
            raise


class TokenBucket:
    """`per_s` tokens a second, at most `burst` saved up; per_s <= 0: no limit."""

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def _refilled(self) -> float:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
        self._at = now
        return self._tokens


class EventRate(TokenBucket):
    """Client events on one connection: `per_s` a second on average, `burst` at once; past that, refused."""

    def refusal(self) -> ProtocolError | None:
        """None when this event may go on (it is counted); else the refusal to answer it with. per_s <= 0: no limit."""
        if self.per_s <= 0:
            return None
        if self._refilled() >= 1:
            self._tokens -= 1
            return None
        return ProtocolError(ClientCode.RATE_LIMITED, f"at most {self.per_s:g} events per second per connection "
                             f"(bursts of {self.burst}); this one was dropped", error_type="server_error",
                             retryable=True)


class ByteRate(TokenBucket):
    """Client bytes on one connection: `per_s` a second on average, `burst` at once; `delay` says how long to wait
    before reading on (a frame already read is taken whole: the bucket goes into debt)."""

    def delay(self, size: int) -> float:
        """A frame of `size` bytes came: the seconds until the next one may be read (0: now)."""
        if self.per_s <= 0:
            return 0.0
        self._tokens = self._refilled() - size
        return max(0.0, -self._tokens / self.per_s)

    @property
    def idle(self) -> bool:
        """Refilled whole: as good as a new one."""
        return self.per_s <= 0 or self._refilled() >= self.burst


class ByteBudgets:
    """Each caller's `ByteRate` (key and address), shared by its connections: one that hangs up after each flooded
    frame and comes back gets no fresh burst. Loopback's is per connection (this machine: a benchmark, or a reverse
    proxy that does not say whose request it forwards, where a shared one would be the server's)."""

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self.burst = burst
        self.clock = clock
        self._rates: dict[str, ByteRate] = {}

    def of(self, who: str, address: str) -> ByteRate:
        if _loopback(address):
            return ByteRate(self.per_s, self.burst, self.clock)
        for caller in [c for c, rate in self._rates.items() if rate.idle]:
            del self._rates[caller]  # callers gone quiet: the table stays bounded
        return self._rates.setdefault(f"{who}@{address}", ByteRate(self.per_s, self.burst, self.clock))


async def paced(events: AsyncIterator[T], gap_s: float) -> AsyncIterator[T]:
    """`events`, each within `gap_s` of the one before (the first within `gap_s` of the start); past it,
    asyncio.TimeoutError."""
    it = aiter(events)
    while True:
        try:
            event = await asyncio.wait_for(anext(it), gap_s)
        except StopAsyncIteration:
            return
        yield event

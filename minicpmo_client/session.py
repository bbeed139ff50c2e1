"""A conversation with the server over `/v1/realtime` (the I/O shell around `ConversationState`).

One reader task owns the socket's receive side: it turns server events into client events through the
state machine and puts them on a bounded queue. When the socket goes while the session lives (no
`session.closed` came, and we did not close it) it reconnects with backoff and resumes the same session
(`session.resume` with the last seq); the sends wait meanwhile.

Slow consumer policy: the queue holds `max_queue` events. When it is full the reader stops reading the
socket until the consumer takes one, so the server's sends wait in TCP (nothing is dropped, the reply
arrives late). A consumer that stalls long enough for the server's keepalive to fail loses the socket;
the client then resumes and the server replays what it missed from its journal (60 s / 8 MiB).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from . import wire
from .backoff import Backoff
from .events import AudioChunk, ClientError, ClientEvent, Closed, Resumed
from .state import ConversationState

MAX_MESSAGE = 64 << 20
HANDSHAKE_TIMEOUT_S = 30.0
DEFAULT_BACKOFF = Backoff()
FATAL_RESUME = frozenset({"session_resume_expired", "invalid_resume_token"})
REDIRECT = "session_elsewhere"  # another gateway holds the session: its URL comes with the error
MAX_REDIRECTS = 3  # per attempt: a loop between misconfigured gateways ends

ServerHook = Callable[[dict[str, Any]], None]


class Session:
    """Use `connect()` to make one."""

    def __init__(self, url: str, headers: dict[str, str], input_rate: int, output_rate: int, backoff: Backoff,
                 max_queue: int, on_server_event: ServerHook | None) -> None:
        self.url = url
        self.input_rate = input_rate
        self.state = ConversationState(output_rate)
        self._headers = headers
        self._backoff = backoff
        self._hook = on_server_event
        self._queue: asyncio.Queue[ClientEvent | ClientError] = asyncio.Queue(max_queue)
        self._ws: ClientConnection | None = None
        self._online = asyncio.Event()
        self._failure: ClientError | None = None
        self._closing = False
        self._cut: set[str] = set()  # replies interrupt() cut: their audio still queued is not yielded
        self._reader: asyncio.Task[None] | None = None

    @property
    def session_id(self) -> str | None:
        return self.state.session_id

    @property
    def backlog(self) -> int:
        """Events waiting for the consumer (at most `max_queue`)."""
        return self._queue.qsize()

    # ---- opening ----
    async def _open(self, url: str, resume: bool) -> ClientConnection:
        # a fresh session opts into the extensions this client reads (a resume is an extension itself)
        url = wire.with_query(url, resume="1") if resume else wire.with_extensions(url)
        return await ws_connect(url, additional_headers=self._headers, max_size=MAX_MESSAGE,
                                open_timeout=HANDSHAKE_TIMEOUT_S)

    async def _recv(self, ws: ClientConnection) -> dict[str, Any]:
        ev = json.loads(await asyncio.wait_for(ws.recv(), HANDSHAKE_TIMEOUT_S))
        if self._hook is not None:
            self._hook(ev)
        return ev

    async def _start(self, setup: str) -> None:
        """A new session: `session.created`, then our `session.update` answered by `session.updated`.
        Busy or unreachable servers are retried with the backoff; other refusals are final."""
        last: ClientError | None = None
        for delay in (0.0, *self._backoff.delays()):
            await asyncio.sleep(delay)
            ws: ClientConnection | None = None
            try:
                ws = await self._open(self.url, resume=False)
                await self._expect(ws, "session.created")
                await ws.send(setup)
                await self._expect(ws, "session.updated")
            except ClientError as exc:
                if not exc.retryable:
                    raise
                last = exc
                continue
            except (TimeoutError, OSError, InvalidHandshake, ConnectionClosed) as exc:
                if ws is not None:
                    await ws.close()
                last = ClientError("connection_failed", f"{type(exc).__name__}: {exc}", retryable=True)
                continue
            self._ws = ws
            self._online.set()
            self._reader = asyncio.create_task(self._read())
            return
        raise ClientError(last.code if last else "connection_failed",
                          f"no session after {self._backoff.attempts + 1} attempts: {last}", retryable=True)

    async def _expect(self, ws: ClientConnection, kind: str) -> dict[str, Any]:
        while True:
            ev = await self._recv(ws)
            if ev.get("type") == "error":
                err = ev.get("error") or {}
                await ws.close()
                raise ClientError(err.get("code", "handshake_failed"), err.get("message", ""))
            self.state.on_server(ev, time.monotonic())
            if ev.get("type") == kind:
                return ev

    def _socket(self) -> ClientConnection:
        """The socket of the session: set before the reader starts and `_online` is set, and by each resume."""
        assert self._ws is not None, "the session is connected"
        return self._ws

    # ---- reading ----
    async def _read(self) -> None:
        while True:
            try:
                raw = await self._socket().recv()
            except ConnectionClosed:
                if self._closing or self.state.closed:  # we, or the server (`session.closed`), ended it
                    await self._put(Closed(self.state.closed or "socket_closed"))
                    return
                try:
                    resumed = await self._resume()
                except ClientError as err:
                    self._failure = err
                    self._online.set()  # wake the senders: they raise
                    await self._queue.put(err)
                    return
                await self._put(resumed)
                continue
            ev = json.loads(raw)
            if self._hook is not None:
                self._hook(ev)
            for out in self.state.on_server(ev, time.monotonic()):
                await self._put(out)
            if self.state.closed:
                await self._socket().close()
                return

    async def _put(self, ev: ClientEvent) -> None:
        await self._queue.put(ev)  # blocks when full: see the slow consumer policy above

    async def _resume_once(self) -> tuple[ClientConnection, dict[str, Any]]:
        """One resume attempt: the socket and the server's answer. A gateway that does not hold the session
        names the one that does (`session_elsewhere`): followed at once. The session's URL becomes that one
        once it answers; an attempt that cannot reach it leaves the URL as it was (the next goes there)."""
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            ws = await self._open(url, resume=True)
            await ws.send(wire.resume(self.state.session_id or "", self.state.resume_token or "",
                                      self.state.last_seq))
            answer = await self._recv(ws)
            err = answer.get("error") or {}
            if answer.get("type") != "error" or err.get("code") != REDIRECT:
                self.url = url
                return ws, answer
            await ws.close()
            try:
                url = wire.redirected(url, err.get("redirect_url"))
            except ValueError as exc:
                raise ClientError("resume_failed", f"{REDIRECT}: {exc}", retryable=False) from None
        raise ClientError("resume_failed", f"more than {MAX_REDIRECTS} redirects", retryable=False)

    async def _resume(self) -> Resumed:
        self._online.clear()
        last: Exception | None = None
        for attempt, delay in enumerate(self._backoff.delays(), 1):
            await asyncio.sleep(delay)
            try:
                ws, answer = await self._resume_once()
            except (TimeoutError, OSError, InvalidHandshake, ConnectionClosed) as exc:
                last = exc
                continue
            kind = answer.get("type")
            if kind == "error":
                await ws.close()
                err = answer.get("error") or {}
                if err.get("code") in FATAL_RESUME:
                    raise ClientError("resume_failed", f"{err.get('code')}: {err.get('message')}", retryable=False)
                last = ClientError(err.get("code", "resume_failed"), err.get("message", ""))
                continue
            self.state.on_server(answer, time.monotonic())
            self._ws = ws
            self._online.set()
            if kind == "session.resumed":
                return Resumed(attempt, int(answer.get("replayed", 0)), gap=False)
            return Resumed(attempt, 0, gap=True)  # session.resync_required: some events are lost
        raise ClientError("connection_lost", f"could not resume session {self.state.session_id} after "
                          f"{self._backoff.attempts} attempts: {last}", retryable=False)

    async def events(self) -> AsyncIterator[ClientEvent]:
        """The conversation's events until it ends (`Closed`); a lost connection that cannot be resumed
        raises ClientError."""
        while True:
            ev = await self._queue.get()
            if isinstance(ev, ClientError):
                raise ev
            if isinstance(ev, AudioChunk) and not ev.is_final and ev.response_id in self._cut:
                continue
            yield ev
            if isinstance(ev, Closed):
                return

    # ---- sending ----
    async def _send(self, *messages: str, is_input: bool = True) -> None:
        for text in messages:
            while True:
                await self._online.wait()
                if self._failure is not None:
                    raise self._failure
                if self._closing and is_input:
                    return
                try:
                    await self._socket().send(text)
                    break
                except ConnectionClosed:  # the reader resumes (clearing _online); send it again on the new socket
                    await asyncio.sleep(0.05)
            if is_input:
                self.state.note_input(time.monotonic())

    async def send_audio(self, audio: np.ndarray) -> None:
        """Caller audio: float32 mono at the session's input rate (any length; split at 5 s)."""
        await self._send(*wire.appends(np.asarray(audio, np.float32), self.input_rate))

    async def converse(self, input_audio: AsyncIterable[np.ndarray] | None = None) -> AsyncIterator[ClientEvent]:
        """Stream `input_audio` (float32 chunks at the input rate, paced by the caller) and yield the
        conversation's events until the session ends."""
        feeder = asyncio.create_task(self._feed(input_audio)) if input_audio is not None else None
        try:
            async for ev in self.events():
                yield ev
        finally:
            if feeder is not None:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError, ClientError):
                    await feeder

    async def _feed(self, input_audio: AsyncIterable[np.ndarray]) -> None:
        async for chunk in input_audio:
            await self.send_audio(chunk)

    async def interrupt(self, played_ms: float | None = None) -> str | None:
        """Cut the reply in progress (the server cancels it: `BargeIn` then `TurnFinal(cancelled)`); its
        audio still queued here is dropped. Without `played_ms` the server takes the reply as heard up to
        real-time playback from its first audio (`response.cancel`); a player that knows better says how
        much of the latest reply it played, and that reply, in progress or done, is cut there
        (`conversation.item.truncate`). Returns the cut reply's id (None if there was nothing to cut)."""
        reply = self.state.reply if played_ms is None else self.state.last_reply
        if reply is None:
            return None
        if played_ms is None:
            message = wire.event("response.cancel")
        elif reply.item_id is not None:
            message = wire.truncate(reply.item_id, played_ms)
        else:
            return None
        if self.state.reply is reply:
            self._cut.add(reply.id)
        await self._send(message, is_input=False)
        return reply.id

    async def say_hello(self, text: str) -> None:
        """The assistant speaks `text` as its turn (docs/realtime.md: speaking a given text)."""
        await self._send(*wire.assistant_text(text))

    async def send_text(self, text: str) -> None:
        """A typed question, answered in voice like a spoken one."""
        await self._send(*wire.user_text(text))

    def drop_connection(self) -> None:
        """Abort the TCP connection without a close frame, as a network failure would (the client resumes)."""
        if self._ws is not None and self._ws.transport is not None:
            self._ws.transport.abort()

    async def close(self, timeout_s: float = 10.0) -> None:
        """End the session (not only the socket) and wait for the server to confirm."""
        if self._reader is None:
            return
        with contextlib.suppress(ClientError, ConnectionClosed):
            if not self.state.closed and self._failure is None:
                await asyncio.wait_for(self._send(wire.event("session.close"), is_input=False), timeout_s)
        self._closing = True
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
        self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect(url: str, *, api_key: str | None = None, key_in_query: bool = False, voice: str | None = None,
                  instructions: str | None = None, turn_detection: str | None = "duplex", input_rate: int = 24_000,
                  output_rate: int = 24_000, session: dict[str, Any] | None = None, backoff: Backoff = DEFAULT_BACKOFF,
                  max_queue: int = 256, on_server_event: ServerHook | None = None) -> Session:
    """Open a session on `ws://HOST:PORT/v1/realtime`.

    `api_key` goes in an `Authorization: Bearer` header (or as `?key=` with `key_in_query`, as browsers
    must); `turn_detection`: "duplex" (the model decides when to speak), "server_vad", "semantic_vad" or None
    (manual); the session opts into the extensions this client reads (`?extensions=duplex,events`);
    `session`: more `session.update` keys (sampling, overlap policy, ...). `on_server_event` sees every
    server event as it arrives (a trace). Retries a busy or unreachable server with `backoff`."""
    if input_rate not in wire.RATES or output_rate not in wire.RATES:
        raise ValueError(f"rates must be one of {wire.RATES}")
    if turn_detection not in wire.TURN_DETECTION:
        raise ValueError(f"turn_detection must be one of {wire.TURN_DETECTION}")
    headers: dict[str, str] = {}
    if api_key and key_in_query:
        url = wire.with_query(url, key=api_key)
    elif api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conv = Session(url, headers, input_rate, output_rate, backoff, max_queue, on_server_event)
    await conv._start(wire.session_update(instructions=instructions, voice=voice, turn_detection=turn_detection,
                                          input_rate=input_rate, output_rate=output_rate, extra=session))
    return conv

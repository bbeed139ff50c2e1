"""A Realtime session's I/O shell: its Triton stream, the socket it is attached to (if any), its journal.

Everything a dialect decides comes back as `Effects`; this carries them out. Each server event gets the
next `server_event_seq` and goes into the journal before it is sent, so a client that reconnects with
`session.resume` is replayed what it missed. A dropped socket leaves the session alive for the
disconnect grace; then the Triton sequence is ended and the slot freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketState

from ..journal import Journal
from ..protocol import CLOSE_NORMAL, CLOSE_POLICY, CLOSE_UNSUPPORTED_DATA
from ..session_core import SessionCore
from ..settings import Settings
from ..triton_stream import TritonSession
from .engine import Effects, EngineState, PlannedStep
from .events import MAX_EVENT_BYTES, RealtimeError, error_event, server_event

log = logging.getLogger("gateway")


class RealtimeSession(SessionCore):
    def __init__(self, session_id: str, triton: TritonSession, settings: Settings, state: EngineState,
                 on_closed: Callable[[RealtimeSession], None], close_on_bad_json: bool = False) -> None:
        super().__init__(session_id, triton, settings)
        self.state = state
        self.ws: WebSocket | None = None
        self.seq = 0
        self.journal = Journal(settings.journal_s, settings.journal_bytes)
        self.resume_token = secrets.token_urlsafe(24)
        self.close_on_bad_json = close_on_bad_json  # MiniCPM-o's dialect closes with 1003; OpenAI's goes on
        self._on_closed = on_closed
        self._send_lock = asyncio.Lock()
        self._grace: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- out ----
    async def emit(self, events: list[dict[str, Any]]) -> None:
        async with self._send_lock:
            for ev in events:
                if ev["type"] == "session.created":
                    ev["resume_token"] = self.resume_token
                self.seq += 1
                ev["server_event_seq"] = self.seq
                text = json.dumps(ev)
                self.journal.add(self.seq, text)
                await self._send_text(text)

    async def _send_text(self, text: str) -> None:
        ws = self.ws
        if ws is None:
            return
        try:
            await ws.send_text(text)
        except Exception:  # noqa: BLE001 (a send to a closed socket is a disconnect)
            self.detach(ws)

    def _control(self, event_type: str, **fields: Any) -> str:
        """A per-attachment event: it carries the current seq but is not journaled (replays do not repeat it)."""
        return json.dumps({**server_event(event_type, **fields), "server_event_seq": self.seq})

    async def apply(self, fx: Effects) -> None:
        if fx.cancel:
            self._spawn(self.triton.cancel())  # beside the step in flight, not behind it
        await self.emit(fx.events)
        for step in fx.steps:
            if not self.enqueue(step):
                await self.emit([error_event(RealtimeError(
                    "input_backpressure", f"{self.settings.max_pending_steps} steps are already waiting; "
                    "this input was dropped"))])
        if fx.close:
            self._spawn(self.close(fx.close))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a cancel that met the sequence's end
            log.info("session %s: background task failed: %s", self.session_id, task.exception())

    # ---- in ----
    async def handle(self, text: str) -> None:
        """One client event: answered, applied, or refused with a coded error."""
        msg: dict[str, Any] = {}
        try:
            if len(text.encode("utf-8")) > MAX_EVENT_BYTES:
                raise RealtimeError("event_too_large", f"an event may be at most {MAX_EVENT_BYTES >> 20} MiB")
            try:
                msg = json.loads(text)
            except json.JSONDecodeError as exc:
                raise RealtimeError("invalid_json", f"event is not valid JSON: {exc}",
                                    close_code=CLOSE_UNSUPPORTED_DATA if self.close_on_bad_json else None) from exc
            if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                raise RealtimeError("invalid_event", "an event is a JSON object with a string `type`", "type")
            fx = self.state.on_client(msg)
        except RealtimeError as err:
            await self.emit([error_event(err, msg.get("event_id") if isinstance(msg, dict) else None)])
            if err.close_code is not None:
                await self.close("protocol_error", message=err.message, ws_code=err.close_code)
            return
        except Exception as exc:  # noqa: BLE001 (our bug: say so, keep the session)
            log.exception("session %s: event %r failed", self.session_id, msg.get("type"))
            await self.emit([error_event(RealtimeError("internal_error", f"{type(exc).__name__}: {exc}",
                                                       error_type="server_error"), msg.get("event_id"))])
            return
        await self.apply(fx)

    # ---- steps ----
    async def run_step(self, step: PlannedStep) -> None:
        if not self.state.wanted(step):
            return
        request = self.state.prepare(step)
        async for ev in self.triton.step(request):
            if ev.kind == "error":
                if self.step_failed(ev.code, ev.message):
                    await self.apply(self.state.on_step_error(step, ev.code, ev.message))
                return
            await self.apply(self.state.on_step_event(step, ev))

    # ---- attachment ----
    async def attach(self, ws: WebSocket, after_seq: int | None = None) -> None:
        """Attach a socket; with `after_seq` (a resume), first replay what came after it, or ask for a resync."""
        old = self.ws
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        async with self._send_lock:
            self.ws = ws
            if old is not None and old is not ws:
                with contextlib.suppress(Exception):
                    await old.send_text(self._control("session.replaced", session_id=self.session_id))
                    await old.close(code=CLOSE_NORMAL, reason="replaced")
            if after_seq is None:
                return
            self.resume_token = secrets.token_urlsafe(24)
            missed = self.journal.since(after_seq)
            if missed is None:
                await ws.send_text(self._control("session.resync_required", session_id=self.session_id,
                                                 reason="journal_gap", resume_token=self.resume_token))
                return
            await ws.send_text(self._control("session.resumed", session_id=self.session_id,
                                             resume_token=self.resume_token, replayed=len(missed)))
            for text in missed:
                await ws.send_text(text)

    def detach(self, ws: WebSocket) -> None:
        """The socket went away: the session waits `disconnect_grace_s` for a resume, then ends."""
        if self.ws is not ws or self.closed:
            return
        self.ws = None
        self._grace = asyncio.get_running_loop().create_task(self._expire())

    async def _expire(self) -> None:
        await asyncio.sleep(self.settings.disconnect_grace_s)
        if self.ws is None:
            await self.close("disconnect_grace_expired")

    def check_token(self, token: Any) -> None:
        if not isinstance(token, str) or not secrets.compare_digest(token, self.resume_token):
            raise RealtimeError("invalid_resume_token", "the resume token does not match", "resume_token",
                                close_code=CLOSE_POLICY)

    # ---- close ----
    async def send_closed(self, reason: str, message: str | None) -> None:
        await self.emit(self.state.on_close(reason).events)
        await self.emit([server_event("session.closed", session_id=self.session_id, reason=reason,
                                      usage=self.state.usage.snapshot(),
                                      diagnostic={"message": message} if message else None)])

    async def close_transport(self, code: int, reason: str) -> None:
        ws, self.ws = self.ws, None
        if ws is not None and ws.application_state == WebSocketState.CONNECTED:
            await ws.close(code=code, reason=reason[:120])

    async def close(self, reason: str, *, message: str | None = None, emit: bool = True,
                    ws_code: int = CLOSE_NORMAL) -> None:
        first = not self.closed
        try:
            await super().close(reason, message=message, emit=emit, ws_code=ws_code)
        finally:
            if first:
                if self._grace is not None and self._grace is not asyncio.current_task():
                    self._grace.cancel()
                self._on_closed(self)

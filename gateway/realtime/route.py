"""WebSocket `/v1/realtime`: admit the caller (a slot, or MiniCPM-o's queue), make or resume a session,
then pass the socket's events to it until the socket goes.

- OpenAI dialect (default): `session.created` on connect. `?resume=1` makes no session: the first event
  must be `session.resume`. A fresh session whose first event is `session.resume` is dropped for the
  resumed one.
- MiniCPM-o's dialect (`?mode=audio|video`): `session.queued` / `queue_update` (every 3 s) while all
  slots are taken, `session.queue_done` always, then `session.update` (or `session.resume`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..protocol import CLOSE_POLICY, CLOSE_SERVER_ERROR, CLOSE_TRY_AGAIN
from ..registry import Gateway, QueueFull, SessionLimitReached
from ..session import new_session_id
from ..triton_stream import TritonSession
from ..vad import SileroVad, VadUnavailable
from .engine import EngineState
from .events import RealtimeError, error_event, new_id, server_event
from .minicpm_state import MODES, MiniCPMRealtimeState
from .openai_state import OpenAIRealtimeState
from .session import RealtimeSession

QUEUE_UPDATE_S = 3.0


class Disconnected(Exception):
    pass


async def receive_text(ws: WebSocket, timeout_s: float | None) -> str:
    """The next text (or UTF-8 binary) frame; Disconnected when the socket is gone."""
    try:
        message = await asyncio.wait_for(ws.receive(), timeout_s)
    except RuntimeError as exc:  # receiving on a socket that was closed
        raise Disconnected from exc
    if message["type"] == "websocket.disconnect":
        raise Disconnected
    if message.get("text") is not None:
        return message["text"]
    return (message.get("bytes") or b"").decode("utf-8", errors="replace")


async def _refuse(ws: WebSocket, err: RealtimeError, code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps({**error_event(err), "server_event_seq": 0}))
        await ws.close(code=code)


def _vad() -> SileroVad | None:
    try:
        return SileroVad()
    except VadUnavailable:
        return None  # the overlap policy falls back to loudness; server_vad is refused at session.update


def realtime_endpoint(gw: Gateway) -> Callable[[WebSocket], Awaitable[None]]:
    settings = gw.settings

    async def new_session(state: EngineState, close_on_bad_json: bool) -> RealtimeSession:
        started_at = time.monotonic()
        triton = TritonSession(settings.triton_url)
        await triton.open()

        def closed(s: RealtimeSession) -> None:
            gw.release(s.session_id, started_at)

        session = RealtimeSession(state.session_id, triton, settings, state, closed, close_on_bad_json)
        gw.realtime[state.session_id] = session
        return session

    async def resume(ws: WebSocket, msg: dict[str, Any]) -> RealtimeSession:
        session = gw.realtime.get(msg.get("session_id"))  # type: ignore[arg-type]
        if session is None or session.closed:
            raise RealtimeError("session_resume_expired", "no such session, or its disconnect grace is over",
                                "session_id", close_code=CLOSE_POLICY)
        session.check_token(msg.get("resume_token"))
        last = msg.get("last_received_server_event_seq", 0)
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise RealtimeError("invalid_value", "last_received_server_event_seq must be an integer >= 0",
                                "last_received_server_event_seq", close_code=CLOSE_POLICY)
        await session.attach(ws, after_seq=last)
        return session

    async def admit(ws: WebSocket, queue: bool) -> tuple[bool, str | None]:
        """A slot for this caller; MiniCPM-o's dialect waits in the FIFO, telling the caller where it stands.
        Returns whether it got one, and an event the caller sent before its turn (kept, not lost)."""
        try:
            gw.reserve()
            return True, None
        except SessionLimitReached:
            if not queue:
                await _refuse(ws, RealtimeError("too_many_sessions", f"all {settings.max_sessions} session slots "
                                                "are taken; retry later", error_type="server_error"), CLOSE_TRY_AGAIN)
                return False, None
        try:
            ticket = gw.enqueue()
        except QueueFull:
            await _refuse(ws, RealtimeError("queue_full", "the queue for a session is full; retry later",
                                            error_type="server_error"), CLOSE_TRY_AGAIN)
            return False, None
        ticket_id = new_id("ticket")
        early: str | None = None
        watcher: asyncio.Task[str] | None = asyncio.create_task(receive_text(ws, None))  # a caller who hangs up
        try:
            event = "session.queued"
            while not ticket.done():
                position = gw.position(ticket)
                await ws.send_text(json.dumps(server_event(
                    event, position=position, queue_length=gw.queue_length, ticket_id=ticket_id,
                    estimated_wait_s=round(position * gw.mean_session_s / max(1, settings.max_sessions), 1))))
                event = "session.queue_update"
                waiting = {ticket} if watcher is None else {ticket, watcher}
                await asyncio.wait(waiting, timeout=QUEUE_UPDATE_S, return_when=asyncio.FIRST_COMPLETED)
                if watcher is not None and watcher.done():
                    early, watcher = watcher.result(), None  # raises Disconnected for a caller who left
            return True, early
        except (Disconnected, WebSocketDisconnect, RuntimeError):
            gw.leave_queue(ticket)
            return False, None
        finally:
            if watcher is not None:
                watcher.cancel()

    async def serve(session: RealtimeSession, ws: WebSocket, pending: str | None = None) -> None:
        if pending is not None:
            await session.handle(pending)
        while not session.closed and session.ws is ws:
            try:
                text = await receive_text(ws, settings.idle_timeout_s)
            except asyncio.TimeoutError:
                await session.close("timeout")
                return
            except Disconnected:
                session.detach(ws)
                return
            if session.ws is not ws:
                return  # another socket took the session over
            await session.handle(text)

    async def first_event(ws: WebSocket, early: str | None = None) -> tuple[str, dict[str, Any]]:
        text = early if early is not None else await receive_text(ws, settings.init_timeout_s)
        return text, _as_event(text)

    async def endpoint(ws: WebSocket) -> None:
        mode = ws.query_params.get("mode")
        await ws.accept()
        if mode is not None and mode not in MODES:
            await _refuse(ws, RealtimeError("invalid_mode", f"mode must be one of {', '.join(MODES)}", "mode"),
                          CLOSE_POLICY)
            return
        if not gw.ready:
            await _refuse(ws, RealtimeError("not_ready", "the model is still loading", error_type="server_error"),
                          CLOSE_TRY_AGAIN)
            return
        try:
            if ws.query_params.get("resume") in ("1", "true"):
                text, msg = await first_event(ws)
                if msg.get("type") != "session.resume":
                    raise RealtimeError("invalid_first_message", "with ?resume=1 the first event is session.resume",
                                        "type", close_code=CLOSE_POLICY)
                await serve(await resume(ws, msg), ws)
                return
            admitted, early = await admit(ws, queue=mode is not None)
            if not admitted:
                return
            session_id = new_session_id()
            if mode is not None:
                state: EngineState = MiniCPMRealtimeState(session_id, mode=mode)
                try:
                    await ws.send_text(json.dumps(server_event("session.queue_done", session_id=session_id)))
                    text, msg = await first_event(ws, early)
                except BaseException:
                    gw.release(None)  # no session was made: the slot goes back
                    raise
            else:
                state = OpenAIRealtimeState(session_id, vad=_vad())
                text, msg = None, {}
            if msg.get("type") == "session.resume":
                gw.release(None)
                await serve(await resume(ws, msg), ws)
                return
            try:
                session = await new_session(state, close_on_bad_json=mode is not None)
            except Exception as exc:  # noqa: BLE001
                gw.release(None)
                await _refuse(ws, RealtimeError("backend_unavailable", str(exc), error_type="server_error"),
                              CLOSE_SERVER_ERROR)
                return
            await session.attach(ws)
            await session.emit(state.created())
            if mode is None and text is None:
                text = await _first_openai_event(session, ws, settings.idle_timeout_s)
                msg = _as_event(text) if text is not None else {}
                if msg.get("type") == "session.resume":
                    session.ws = None  # the socket goes on with the resumed session
                    await session.close("resumed_elsewhere", emit=False)
                    await serve(await resume(ws, msg), ws)
                    return
            await serve(session, ws, text)
        except RealtimeError as err:
            await _refuse(ws, err, err.close_code or CLOSE_POLICY)
        except (Disconnected, asyncio.TimeoutError):
            with contextlib.suppress(Exception):
                await ws.close(code=CLOSE_POLICY)

    return endpoint


def _as_event(text: str) -> dict[str, Any]:
    """A first event, to see what it is ({} when it is not a JSON object; the session then answers it)."""
    try:
        msg = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return msg if isinstance(msg, dict) else {}


async def _first_openai_event(session: RealtimeSession, ws: WebSocket, timeout_s: float) -> str | None:
    try:
        return await receive_text(ws, timeout_s)
    except asyncio.TimeoutError:
        await session.close("timeout")
    except Disconnected:
        session.detach(ws)
    return None

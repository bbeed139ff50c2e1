"""The Starlette app: `GET /health`, `POST /sessions/{session_id}/close`, `POST /v1/voices/check` (a voice
reference judged as a session would judge it), and the three dialects' sockets:

- `/backend`: the MiniCPM-o backend protocol; the first frame is `session.init`.
- `/v1/realtime` (OpenAI's Realtime dialect): `session.created` on connect. `?resume=1` makes no session:
  the first event must be `session.resume`. A fresh session whose first event is `session.resume` is
  dropped for the resumed one.
- `/v1/realtime?mode=audio|video` (MiniCPM-o's dialect): `session.queued` / `queue_update` (every 3 s)
  while all slots are taken, `session.queue_done` always, then `session.update` (or `session.resume`).

Each is a few lines over the shell: admission, a running session, the receive loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from . import inputs, page
from .dialects import backend, minicpm, openai
from .dialects.openai import SpeechProbabilities
from .dialects.realtime_events import error_event as realtime_error
from .registry import Gateway
from .settings import Settings
from .shell import Disconnected, admitted, receive_text, resume, running, serve
from .vad import SileroVad, VadUnavailable
from .wire import CLOSE_POLICY, CLOSE_SERVER_ERROR, CLOSE_TRY_AGAIN, ProtocolError, new_session_id

log = logging.getLogger("gateway")


async def _refuse(ws: WebSocket, event: dict[str, Any], code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps(event))
        await ws.close(code=code)


async def _close(ws: WebSocket, code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.close(code=code)


def _vad() -> SpeechProbabilities | None:
    try:
        return SileroVad().probabilities
    except VadUnavailable:
        return None  # the overlap policy falls back to loudness; server_vad is refused at session.update


def _as_event(text: str) -> dict[str, Any]:
    """A first event, to see what it is ({} when it is not a JSON object; the session then answers it)."""
    try:
        msg = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return msg if isinstance(msg, dict) else {}


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings.from_env()
    gw = Gateway(settings)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({
            "status": "ready" if gw.ready else "loading",
            "backend": "triton",
            "active_sessions": gw.active_sessions,
            "max_sessions": settings.max_sessions,
            "active_session_ids": sorted(gw.sessions),
            "queue_length": gw.queue_length,
            "stale_deltas_dropped": gw.stale_dropped,
        })

    async def close_session(request: Request) -> JSONResponse:
        session_id = request.path_params["session_id"]
        session = gw.sessions.get(session_id)
        if session is None:
            return JSONResponse({"ok": False, "error": "session not found", "session_id": session_id}, 404)
        reason = "client_closed"
        with contextlib.suppress(Exception):
            body = await request.json()
            if isinstance(body, dict) and body.get("reason"):
                reason = str(body["reason"])[:100]
        await session.close(reason)
        return JSONResponse({"ok": True, "session_id": session_id, "closed": True})

    async def voices_check(request: Request) -> JSONResponse:
        try:
            try:
                body = await request.json()
            except ValueError as exc:
                raise ProtocolError("invalid_payload", f"the body is not JSON: {exc}") from exc
            return JSONResponse(inputs.check_voice(body))
        except ProtocolError as err:
            return JSONResponse({"ok": False, "error": {"code": err.code, "message": err.message}}, 400)

    def check_ready() -> None:
        if not gw.ready:
            raise ProtocolError("not_ready", "the model is still loading", close_code=CLOSE_TRY_AGAIN,
                                error_type="server_error")

    async def backend_socket(ws: WebSocket) -> None:
        await ws.accept()
        try:
            check_ready()
            try:
                text = await receive_text(ws, settings.init_timeout_s, settings.test_faults)
            except (asyncio.TimeoutError, Disconnected):
                raise ProtocolError("init_timeout", "no session.init received", close_code=CLOSE_POLICY) from None
            init = backend.parse_init(backend.loads(text))
            state = backend.BackendState(new_session_id(), mode=init.mode, duplex=backend.init_options(init),
                                         voice=backend.voice_refs(init))
            async with admitted(gw, ws), running(gw, state, ws, resumable=False) as session:
                await serve(session, ws)
        except ProtocolError as err:
            await _refuse(ws, backend.error_event(err.code, err.message).encode(), err.close_code or CLOSE_POLICY)
        except Exception:  # noqa: BLE001 (our bug, before a session was made: the socket closes, the server goes on)
            log.exception("/backend: the opening failed")
            await _close(ws, CLOSE_SERVER_ERROR)

    async def realtime_socket(ws: WebSocket) -> None:
        mode = ws.query_params.get("mode")
        await ws.accept()
        try:
            if mode is not None and mode not in minicpm.MODES:
                raise ProtocolError("invalid_mode", f"mode must be one of {', '.join(minicpm.MODES)}", "mode",
                                    close_code=CLOSE_POLICY)
            check_ready()
            if ws.query_params.get("resume") in ("1", "true"):
                msg = _as_event(await receive_text(ws, settings.init_timeout_s, settings.test_faults))
                if msg.get("type") != "session.resume":
                    raise ProtocolError("invalid_first_message", "with ?resume=1 the first event is session.resume",
                                        "type", close_code=CLOSE_POLICY)
            elif mode is None:
                msg = await openai_session(ws)
            else:
                msg = await minicpm_session(ws, mode)
            if msg is not None:  # the first event resumed another session: this socket goes on with it
                await resume(gw, ws, msg)
        except ProtocolError as err:
            await _refuse(ws, {**realtime_error(err).encode(), "server_event_seq": 0}, err.close_code or CLOSE_POLICY)
        except (Disconnected, asyncio.TimeoutError):
            await _close(ws, CLOSE_POLICY)
        except Exception:  # noqa: BLE001 (our bug, before a session was made: the socket closes, the server goes on)
            log.exception("/v1/realtime: the opening failed")
            await _close(ws, CLOSE_SERVER_ERROR)

    async def openai_session(ws: WebSocket) -> dict[str, Any] | None:
        """Returns the first event when it is `session.resume` (this fresh session is then dropped)."""
        state = openai.OpenAIRealtimeState(new_session_id(), vad=_vad())
        async with admitted(gw, ws), running(gw, state, ws, resumable=True) as session:
            try:
                text = await receive_text(ws, settings.idle_timeout_s, settings.test_faults)
            except asyncio.TimeoutError:
                await session.close("timeout")
                return None
            except Disconnected:
                session.detach(ws)
                return None
            msg = _as_event(text)
            if msg.get("type") == "session.resume":
                session.ws = None  # the socket goes on with the resumed session
                await session.close("resumed_elsewhere", emit=False)
                return msg
            await serve(session, ws, text)
        return None

    async def minicpm_session(ws: WebSocket, mode: str) -> dict[str, Any] | None:
        """Returns the first event when it is `session.resume` (the slot is given back first)."""
        async with admitted(gw, ws, queue_event=minicpm.queue_position) as early:
            session_id = new_session_id()
            await ws.send_text(json.dumps(minicpm.QueueDone(session_id).encode()))
            if early is None:
                early = await receive_text(ws, settings.init_timeout_s, settings.test_faults)
            text = early
            msg = _as_event(text)
            if msg.get("type") == "session.resume":
                return msg
            state = minicpm.MiniCPMRealtimeState(session_id, mode=mode)
            async with running(gw, state, ws, resumable=True) as session:
                await serve(session, ws, text)
        return None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        watcher = asyncio.create_task(gw.watch_triton())
        try:
            yield
        finally:
            await gw.shutdown()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/sessions/{session_id}/close", close_session, methods=["POST"]),
            Route("/v1/voices/check", voices_check, methods=["POST"]),
            WebSocketRoute("/backend", backend_socket),
            WebSocketRoute("/v1/realtime", realtime_socket),
            *page.routes,
        ],
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return app

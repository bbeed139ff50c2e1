"""The Starlette app: `GET /health`, WebSocket `/backend`, `POST /sessions/{session_id}/close`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from minicpmo_triton.duplex_options import DuplexOptions, InvalidOptions

from .connection import Connection
from .protocol import (
    CLOSE_POLICY,
    CLOSE_SERVER_ERROR,
    CLOSE_TRY_AGAIN,
    ProtocolError,
    error_event,
    loads,
    parse_client_message,
    parse_init,
    voice_refs,
)
from .realtime.route import realtime_endpoint
from .registry import Gateway, SessionLimitReached
from .session import DuplexProtocolState, new_session_id
from .settings import Settings
from .triton_stream import TritonSession

log = logging.getLogger("gateway")


async def _send_and_close(ws: WebSocket, data: dict[str, Any], code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_json(data)
        await ws.close(code=code)


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings.from_env()
    gw = Gateway(settings)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({
            "status": "ready" if gw.ready else "loading",
            "backend": "triton",
            "active_sessions": gw.active_sessions,
            "max_sessions": settings.max_sessions,
            "active_session_ids": sorted([*gw.sessions, *gw.realtime]),
            "queue_length": gw.queue_length,
            "stale_deltas_dropped": gw.stale_dropped,
        })

    async def close_session(request: Request) -> JSONResponse:
        session_id = request.path_params["session_id"]
        conn = gw.sessions.get(session_id) or gw.realtime.get(session_id)
        if conn is None:
            return JSONResponse({"ok": False, "error": "session not found", "session_id": session_id}, 404)
        reason = "client_closed"
        with contextlib.suppress(Exception):
            body = await request.json()
            if isinstance(body, dict) and body.get("reason"):
                reason = str(body["reason"])[:100]
        await conn.close(reason)
        return JSONResponse({"ok": True, "session_id": session_id, "closed": True})

    async def backend(ws: WebSocket) -> None:
        await ws.accept()
        if not gw.ready:
            await _send_and_close(ws, error_event("not_ready", "the model is still loading"), CLOSE_TRY_AGAIN)
            return
        try:
            init = parse_init(loads(await asyncio.wait_for(ws.receive_text(), settings.init_timeout_s)))
            try:
                options = DuplexOptions.from_config(
                    {**init.config, **({"system_prompt": init.system_prompt} if init.system_prompt else {})})
            except InvalidOptions as exc:
                raise ProtocolError("invalid_config", str(exc), CLOSE_POLICY) from exc
        except ProtocolError as exc:
            await _send_and_close(ws, error_event(exc.code, exc.message), exc.close_code or CLOSE_POLICY)
            return
        except (asyncio.TimeoutError, WebSocketDisconnect, RuntimeError, KeyError):
            await _send_and_close(ws, error_event("init_timeout", "no session.init received"), CLOSE_POLICY)
            return
        try:
            gw.reserve()
        except SessionLimitReached:
            await _send_and_close(ws, error_event(
                "too_many_sessions", f"all {settings.max_sessions} session slots are taken; retry later"),
                CLOSE_TRY_AGAIN)
            return
        session_id = new_session_id()
        try:
            triton = TritonSession(settings.triton_url)
            await triton.open()
        except Exception as exc:  # noqa: BLE001
            gw.release(None)
            await _send_and_close(ws, error_event("backend_unavailable", str(exc)), CLOSE_SERVER_ERROR)
            return
        conn = Connection(ws, DuplexProtocolState(session_id, init.mode), triton, options, settings, voice_refs(init),
                          init.voice_name)
        gw.sessions[session_id] = conn
        try:
            await conn.send(conn.state.created())
            await _serve(conn, ws, settings)
        finally:
            gw.release(session_id)

    async def _serve(conn: Connection, ws: WebSocket, settings: Settings) -> None:
        while not conn.closed:
            try:
                text = await asyncio.wait_for(ws.receive_text(), settings.idle_timeout_s)
            except asyncio.TimeoutError:
                await conn.close("timeout")
                return
            except (WebSocketDisconnect, RuntimeError):  # RuntimeError: the socket was closed by us
                await conn.close("client_disconnected", emit=False)
                return
            try:
                message = parse_client_message(loads(text), conn.state.mode)
            except ProtocolError as exc:
                if exc.close_code is None:
                    await conn.reject(exc.code, exc.message)
                    continue
                await conn.send(error_event(exc.code, exc.message, conn.session_id))
                await conn.close("protocol_error", message=exc.message, ws_code=exc.close_code)
                return
            if not conn.submit(message):
                await conn.reject("input_backpressure",
                                  f"{settings.max_pending_steps} inputs are already waiting; this one was dropped")
        # closed from elsewhere (HTTP close, failure): wait for it to finish
        await conn.close("closed")

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
            WebSocketRoute("/backend", backend),
            WebSocketRoute("/v1/realtime", realtime_endpoint(gw)),
        ],
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return app

"""The gateway's routes (the endpoints are in `endpoints`, the browser page's in `page`) and the app that
serves them: `create_app(settings)` puts the one `Edge` the endpoints share on `app.state.edge`, and watches
Triton's readiness for as long as the app runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Route, WebSocketRoute

from . import admin, page
from .endpoints import Edge, backend_socket, close_session, health, realtime_socket, voices_check
from .settings import Settings

ROUTES: list[BaseRoute] = [
    Route("/health", health),
    Route("/sessions/{session_id}/close", close_session, methods=["POST"]),
    Route("/v1/voices/check", voices_check, methods=["POST"]),
    WebSocketRoute("/backend", backend_socket),
    WebSocketRoute("/v1/realtime", realtime_socket),
    *page.routes,
    *admin.routes,
]


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    gw = app.state.edge.gateway
    watcher = asyncio.create_task(gw.watch_triton())
    try:
        yield
    finally:
        await gw.shutdown()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def create_app(settings: Settings | None = None) -> Starlette:
    edge = Edge.of(settings or Settings.from_env())
    app = Starlette(routes=ROUTES, lifespan=lifespan)
    app.state.edge = edge
    app.state.gateway = edge.gateway  # serve.py's shutdown, tests
    app.state.quotas = edge.quotas
    return app

"""The browser page at `/` (plain ES modules under `static/`, no build step): microphone, playback,
transcript, interrupt and a timeline of the model's decisions, on `/v1/realtime`. `routes` goes into the
app's route list."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"


async def _index(request: Request) -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


routes = [Route("/", _index), Mount("/static", StaticFiles(directory=STATIC), name="static")]

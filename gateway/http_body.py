"""An HTTP request's body, refused by its size before it is read: by its Content-Length when it states one, else
as it streams in (a chunked body is cut at the bound): a caller cannot make the gateway hold more than the bound.
Its JSON is read with the limits every frame gets, a large one off the event loop; refusals are answered as JSON
with their code."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .codes import ClientCode
from .limits import TOO_LARGE
from .wire import ProtocolError, off_loop, parse_json


def too_large(most: int) -> ProtocolError:
    return ProtocolError(TOO_LARGE, f"the body is over {most} bytes", http_status=413)


async def bounded_body(request: Request, most: int) -> bytes:
    stated = request.headers.get("content-length")
    if stated is not None and (not stated.isdigit() or int(stated) > most):
        raise too_large(most)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > most:
            raise too_large(most)
        chunks.append(chunk)
    return b"".join(chunks)


def read_json(body: bytes) -> Any:
    """A body's JSON within the limits every frame gets; `invalid_json` (400) otherwise."""
    try:
        return parse_json(body)
    except ValueError as exc:
        raise ProtocolError(ClientCode.INVALID_JSON, f"the body is not valid JSON: {exc}") from exc


async def json_body(request: Request, most: int) -> Any:
    """The body's JSON, at most `most` bytes, within the JSON limits (`invalid_json`, 400), parsed off the event loop
    when it is large."""
    body = await bounded_body(request, most)
    return await off_loop(len(body), read_json, body)


def http_error(err: ProtocolError, status: int = 400) -> JSONResponse:
    return JSONResponse({"ok": False, "error": {"code": err.code, "message": err.message}}, err.http_status or status)

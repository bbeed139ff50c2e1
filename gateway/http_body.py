"""An HTTP request's body, refused by its size before it is read: by its Content-Length when it states one, else
as it streams in (a chunked body is cut at the bound): a caller cannot make the gateway hold more than the bound."""

from __future__ import annotations

from starlette.requests import Request

from .limits import TOO_LARGE
from .wire import ProtocolError


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

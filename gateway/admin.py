"""Operator routes (docs/deploy.md):

- `GET /ready`: 200 while some Triton endpoint takes new sessions, 503 otherwise (a load balancer's or
  Kubernetes' readiness check: it reads the status code only).
- `GET /metrics`: Prometheus text (gateway/metrics.py): step latency, first audio, barge-ins, refusals by code,
  sessions per dialect and per endpoint, room, state and queue time per endpoint; every worker's with `--workers`.
- `GET /admin/endpoints`: the endpoints as this gateway sees them.
- `POST /admin/endpoints/drain` `{"endpoint": "host:port", "drain": true}`: the endpoint takes no new sessions
  from this gateway while its live ones finish (`"drain": false` lifts it). Every gateway has its own view:
  several gateways are drained together through the endpoints file they all read.

`/metrics` names internal addresses: with API keys configured it needs one; with none (an open server) it is open.
The admin calls change what the gateway does: they take an operator key (`MINICPMO_OPERATOR_KEYS`, a key set apart
from the clients'), and with none configured answer loopback callers only; a client's API key never opens them.
Their bodies are small and bounded (`ADMIN_BODY_BYTES`), read with the JSON limits every frame gets, and a name is
never echoed past `ECHO_CHARS`.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .auth import presented_key, principal
from .codes import ClientCode
from .http_body import http_error, json_body
from .registry import Gateway
from .wire import ProtocolError

ADMIN_BODY_BYTES = 4096  # {"endpoint": "host:port", "drain": true}
ECHO_CHARS = 100  # of a name a refusal quotes


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.edge.gateway  # Starlette's State is untyped
    return gw


def _allowed(gw: Gateway, request: Request, admin: bool) -> bool:
    """`/metrics`: a client's API key (open without keys); an admin call: an operator key (loopback only without)."""
    keys = gw.settings.operator_keys if admin else gw.settings.api_keys
    if keys:
        return principal(keys, presented_key(request.headers, request.query_params)) is not None
    if not admin:
        return True
    try:
        return request.client is not None and ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:
        return False


def _refused(admin: bool) -> JSONResponse:
    need = "an operator key (MINICPMO_OPERATOR_KEYS; loopback only without)" if admin else "an API key"
    return http_error(ProtocolError(ClientCode.UNAUTHORIZED, f"{need} is required", http_status=401))


async def ready(request: Request) -> Response:
    gw = _gateway(request)
    return PlainTextResponse(gw.pool.status, 200 if gw.ready else 503)


async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    if not _allowed(gw, request, admin=False):
        return _refused(admin=False)
    gw.refresh_metrics()
    body, content_type = gw.metrics.exposition()
    return Response(body, media_type=content_type)


async def list_endpoints(request: Request) -> Response:
    gw = _gateway(request)
    if not _allowed(gw, request, admin=True):
        return _refused(admin=True)
    return JSONResponse({"ok": True, "status": gw.pool.status, "endpoints": gw.pool.describe()})


async def drain(request: Request) -> Response:
    gw = _gateway(request)
    if not _allowed(gw, request, admin=True):
        return _refused(admin=True)
    try:
        body: Any = await json_body(request, ADMIN_BODY_BYTES)  # too large: 413; not JSON, too deep: 400
        if not isinstance(body, dict) or not isinstance(body.get("endpoint"), str) \
                or not isinstance(body.get("drain", True), bool):
            raise ProtocolError(ClientCode.INVALID_PAYLOAD,
                                'the body is {"endpoint": "host:port", "drain": true|false}')
        name: str = body["endpoint"]
        if name not in gw.pool.endpoints:
            raise ProtocolError(ClientCode.UNKNOWN_ENDPOINT, f"{name[:ECHO_CHARS]!r} is not listed", http_status=404)
    except ProtocolError as err:
        return http_error(err)
    endpoint = gw.pool.drain(name, body.get("drain", True))
    return JSONResponse({"ok": True, **endpoint.describe(gw.sessions_per_endpoint()[endpoint.url])})


routes = [Route("/ready", ready), Route("/metrics", metrics), Route("/admin/endpoints", list_endpoints),
          Route("/admin/endpoints/drain", drain, methods=["POST"])]

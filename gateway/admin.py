"""Operator routes (docs/deploy.md):

- `GET /ready`: 200 while some Triton endpoint takes new sessions, 503 otherwise (a load balancer's or
  Kubernetes' readiness check: it reads the status code only).
- `GET /metrics`: Prometheus text (gateway/metrics.py): step latency, first audio, barge-ins, refusals by code,
  sessions per dialect and per endpoint, room, state and queue time per endpoint; every worker's with `--workers`.
- `GET /admin/endpoints`: the endpoints as this gateway sees them.
- `POST /admin/endpoints/drain` `{"endpoint": "host:port", "drain": true}`: the endpoint takes no new sessions
  from this gateway while its live ones finish (`"drain": false` lifts it). Every gateway has its own view:
  several gateways are drained together through the endpoints file they all read.

`/metrics` and the admin calls name internal addresses: with API keys configured they need one; with none
(an open server) `/metrics` is open and the admin calls answer loopback callers only.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .auth import presented_key, principal
from .registry import Gateway


def _gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.edge.gateway  # Starlette's State is untyped
    return gw


def _allowed(gw: Gateway, request: Request, admin: bool) -> bool:
    keys = gw.settings.api_keys
    if keys:
        return principal(keys, presented_key(request.headers, request.query_params)) is not None
    if not admin:
        return True
    try:
        return request.client is not None and ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:
        return False


def _refused() -> JSONResponse:
    return JSONResponse({"ok": False, "error": {"code": "unauthorized",
                                                "message": "an API key is required (loopback only without keys)"}},
                        401)


async def ready(request: Request) -> Response:
    gw = _gateway(request)
    return PlainTextResponse(gw.pool.status, 200 if gw.ready else 503)


async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    if not _allowed(gw, request, admin=False):
        return _refused()
    gw.refresh_metrics()
    body, content_type = gw.metrics.exposition()
    return Response(body, media_type=content_type)


async def list_endpoints(request: Request) -> Response:
    gw = _gateway(request)
    if not _allowed(gw, request, admin=True):
        return _refused()
    return JSONResponse({"ok": True, "status": gw.pool.status, "endpoints": gw.pool.describe()})


async def drain(request: Request) -> Response:
    gw = _gateway(request)
    if not _allowed(gw, request, admin=True):
        return _refused()
    try:
        body: Any = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("endpoint"), str) \
            or not isinstance(body.get("drain", True), bool):
        return JSONResponse({"ok": False, "error": {"code": "invalid_request", "message":
                             'the body is {"endpoint": "host:port", "drain": true|false}'}}, 400)
    try:
        endpoint = gw.pool.drain(body["endpoint"], body.get("drain", True))
    except KeyError:
        return JSONResponse({"ok": False, "error": {"code": "unknown_endpoint",
                                                    "message": f"{body['endpoint']} is not listed"}}, 404)
    return JSONResponse({"ok": True, **endpoint.describe(gw.sessions_per_endpoint()[endpoint.url])})


routes = [Route("/ready", ready), Route("/metrics", metrics), Route("/admin/endpoints", list_endpoints),
          Route("/admin/endpoints/drain", drain, methods=["POST"])]

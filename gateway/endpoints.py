"""The gateway's endpoints, each a module-level function of its request or socket (Starlette's endpoint shape),
importable and testable alone. What they share is one `Edge` on `app.state.edge` (made by `routes.create_app`).

- `GET /health`, `POST /sessions/{session_id}/close`, `POST /v1/voices/check` (a voice reference judged as a
  session would judge it);
- `/backend`: the MiniCPM-o backend protocol; the first frame is `session.init`.
- `/v1/realtime` (OpenAI's Realtime dialect): `session.created` on connect; `?extensions=duplex,events` opts into
  ours (`dialects/openai_extensions`). `?resume=1` makes no session: the first event must be `session.resume`.
  A fresh session whose first event is `session.resume` is dropped for the resumed one.
- `/v1/realtime?mode=audio|video` (MiniCPM-o's dialect): `session.queued` / `queue_update` (every 3 s)
  while all slots are taken, `session.queue_done` always, then `session.update` (or `session.resume`).

A socket goes through the same steps whatever its dialect: `admit` (who may come in: Origin, API key, before
any model work), `check_ready`, per-key session counts, then the shell: `admitted` (a slot), `running` (a
session on its Triton stream), `serve` (the receive loop).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket

from minicpmo_triton.errors import describe

from . import inputs
from .auth import origin_allowed, presented_key, principal, unauthorized
from .codes import ClientCode
from .dialects import backend, minicpm, openai
from .dialects.openai_extensions import ALL, QUERY, STOCK, Extensions
from .dialects.realtime_events import error_event as realtime_error
from .fairness import ByteBudgets, ByteRate, Quotas, ResumeFailures, VoiceBudget
from .http_body import bounded_body, http_error, json_body, read_json
from .limits import Limits
from .registry import Gateway
from .settings import Settings
from .shell import Disconnected, admitted, receive_text, resume, running, serve
from .vad import SileroVad, VadUnavailable
from .wire import (
    CLOSE_POLICY,
    CLOSE_SERVER_ERROR,
    CLOSE_TRY_AGAIN,
    ProtocolError,
    new_session_id,
    off_loop,
    parse_json,
)

log = logging.getLogger("gateway")


@dataclass(frozen=True)
class Edge:
    """What every endpoint reads: the gateway (slots, live sessions, readiness), its settings, the cost model per
    caller, the live sessions per key and per address, failed resume attempts, new voice references per caller, the
    bytes each caller sends."""

    gateway: Gateway
    settings: Settings
    limits: Limits
    quotas: Quotas
    resumes: ResumeFailures
    voices: VoiceBudget
    bytes_in: ByteBudgets

    @classmethod
    def of(cls, settings: Settings) -> Edge:
        return cls(Gateway(settings), settings, Limits.of(settings),
                   Quotas(settings.max_sessions_per_key, settings.max_sessions_per_address),
                   ResumeFailures(settings.resume_attempts, settings.resume_window_s,
                                  settings.resume_failure_delay_s),
                   VoiceBudget(settings.voice_budget_s, settings.voice_window_s),
                   ByteBudgets(settings.max_bytes_per_s, 2 * settings.ws_max_size))


CLOSE_BODY_BYTES = 4096  # POST /sessions/{id}/close: {"reason": ...}, the reason kept to 100 characters


def edge(conn: HTTPConnection) -> Edge:
    e: Edge = conn.app.state.edge  # Starlette's State is untyped
    return e


def address(conn: HTTPConnection) -> str:
    """The client's address (uvicorn takes it from X-Forwarded-For only when the peer is a trusted proxy)."""
    return conn.client.host if conn.client else "?"


# ---- admission: who may come in ----

def caller(conn: HTTPConnection) -> str | None:
    """The caller's principal; None when keys are configured and it presented none of them."""
    return principal(edge(conn).settings.api_keys, presented_key(conn.headers, conn.query_params))


def admit(conn: HTTPConnection) -> str:
    """Before any model work: a browser from an allowed Origin, with a valid key (when keys are set)."""
    if not origin_allowed(edge(conn).settings.allowed_origins, conn.headers.get("origin")):
        raise ProtocolError(ClientCode.ORIGIN_NOT_ALLOWED, "this Origin is not allowed", close_code=CLOSE_POLICY,
                            http_status=403)
    who = caller(conn)
    if who is None:
        raise unauthorized()
    return who


def check_ready(conn: HTTPConnection) -> None:
    if not edge(conn).gateway.ready:
        raise ProtocolError(ClientCode.NOT_READY, "the model is still loading", close_code=CLOSE_TRY_AGAIN,
                            error_type="server_error", retryable=True)


# ---- HTTP ----

async def health(request: Request) -> JSONResponse:
    """Counts for anyone; the ids of the caller's own sessions to a caller with a key (with no keys
    configured, every caller is the one anonymous principal)."""
    e = edge(request)
    gw = e.gateway
    body: dict[str, Any] = {
        "status": gw.pool.status,  # ready | draining | loading
        "backend": "triton",
        "backend_state": gw.backend_state,  # ready | loading | unresponsive | broken (gateway/stage_health.py)
        "active_sessions": gw.active_sessions,
        "max_sessions": e.settings.max_sessions,
        "queue_length": gw.queue_length,
        "stale_deltas_dropped": gw.stale_dropped,
        "frames_offloaded": gw.offloaded,  # client frames big enough to be read in a worker thread
    }
    who = caller(request)
    if who is not None:
        body["active_session_ids"] = sorted(sid for sid, s in gw.sessions.items() if s.owner == who)
        body["endpoints"] = gw.pool.describe()  # the Triton servers: internal addresses, for key holders
    return JSONResponse(body)


async def close_session(request: Request) -> JSONResponse:
    """Only by the principal that opened the session; another one is told it does not exist."""
    try:
        who = admit(request)
    except ProtocolError as err:
        return http_error(err)
    session_id = request.path_params["session_id"]
    session = edge(request).gateway.sessions.get(session_id)
    if session is None or session.owner != who:
        return JSONResponse({"ok": False, "error": "session not found", "session_id": session_id}, 404)
    reason = "client_closed"
    with contextlib.suppress(ProtocolError, ClientDisconnect):  # no body, too large, or not JSON: the default reason
        body = await json_body(request, CLOSE_BODY_BYTES)
        if isinstance(body, dict) and body.get("reason"):
            reason = str(body["reason"])[:100]
    await session.close(reason)
    return JSONResponse({"ok": True, "session_id": session_id, "closed": True})


async def voices_check(request: Request) -> JSONResponse:
    """A voice reference checked as a session would check it (same limits, same codes), before any session; a large
    one read and judged off the event loop."""
    try:
        admit(request)
        settings = edge(request).settings
        body = await bounded_body(request, settings.ws_max_size)  # refused by its size before it is read
        voices = Path(settings.voices_dir) if settings.voices_dir else None
        return JSONResponse(await off_loop(len(body), _check_voice, body, voices))
    except ProtocolError as err:
        return http_error(err)


def _check_voice(body: bytes, voices: Path | None) -> inputs.VoiceCheck:
    return inputs.check_voice(read_json(body), voices)  # the JSON limits every frame gets


# ---- sockets ----

async def backend_socket(ws: WebSocket) -> None:
    e = edge(ws)
    await ws.accept()
    try:
        who = admit(ws)
        check_ready(ws)
        rate = e.bytes_in.of(who, address(ws))
        try:
            text = await _first_frame(e, ws, rate)
        except (TimeoutError, Disconnected):
            raise ProtocolError(ClientCode.INIT_TIMEOUT, "no session.init received", close_code=CLOSE_POLICY) from None
        init = await off_loop(len(text), _read_init, text, e.limits)  # its voice references decoded too
        charge = e.voices.charger(who, address(ws))
        refs = backend.voice_refs(init)
        for ref in refs.values():
            charge(ref)
        state = backend.BackendState(new_session_id(), mode=init.mode, duplex=backend.init_options(init),
                                     voice=refs, named_voice=init.voice_name, limits=e.limits, charge_voice=charge)
        with e.quotas.held(who, address(ws)):
            async with admitted(e.gateway, ws), running(e.gateway, state, ws, resumable=False, owner=who,
                                                         awaiting_first=False, bytes_in=rate) as session:
                await serve(session, ws)
    except ProtocolError as err:
        e.gateway.metrics.refused(backend.BackendState.dialect, err.code)
        await _refuse(ws, backend.error_event(err.code, err.message, retryable=err.retryable).encode(),
                      err.close_code or CLOSE_POLICY)
    except Exception as exc:  # noqa: BLE001 (our bug, before a session was made: the socket closes, the server goes on)
        log.error("/backend: the opening failed: %s", describe(exc))
        await _close(ws, CLOSE_SERVER_ERROR)


def _read_init(text: str, limits: Limits) -> backend.SessionInit:
    return backend.parse_init(backend.loads(text), limits)


async def realtime_socket(ws: WebSocket) -> None:
    e = edge(ws)
    mode = ws.query_params.get("mode")
    ext = STOCK  # until the URL is read: a refusal shows a stock client nothing but the spec
    await ws.accept()
    try:
        who = admit(ws)
        if mode is not None and mode not in minicpm.MODES:
            raise ProtocolError(ClientCode.INVALID_MODE, f"mode must be one of {', '.join(minicpm.MODES)}", "mode",
                                close_code=CLOSE_POLICY)
        resuming = ws.query_params.get("resume") in ("1", "true")
        ext = Extensions.parse(ws.query_params.get(QUERY))
        if mode is not None or resuming:  # MiniCPM-o's dialect, and a resume, are ours throughout
            ext = ALL
        check_ready(ws)
        rate = e.bytes_in.of(who, address(ws))
        msg: dict[str, Any] | None  # a session.resume to go on with
        if resuming:
            msg = await _first_event(await _first_frame(e, ws, rate))
            if msg.get("type") != "session.resume":
                raise ProtocolError(ClientCode.INVALID_FIRST_MESSAGE,
                                    "with ?resume=1 the first event is session.resume",
                                    "type", close_code=CLOSE_POLICY)
        else:
            with e.quotas.held(who, address(ws)):
                msg = await (_openai_session(e, ws, who, ext, rate) if mode is None
                             else _minicpm_session(e, ws, mode, who, rate))
        if msg is not None:  # the first event resumed another session: this socket goes on with it
            # a resuming socket counts as a session of its address (bogus ones in parallel are bounded too)
            with e.quotas.held(who, address(ws)):
                async with e.resumes.counted(who, address(ws)):  # only a failed resume counts against the caller
                    await resume(e.gateway, ws, msg, who)
    except ProtocolError as err:
        dialect = minicpm.MiniCPMRealtimeState.dialect if mode is not None else openai.OpenAIRealtimeState.dialect
        e.gateway.metrics.refused(dialect, err.code)
        refusal = realtime_error(err).encode()
        if ext.events:  # a refusal before any session: seq 0
            refusal["server_event_seq"] = 0
        await _refuse(ws, refusal, err.close_code or CLOSE_POLICY)
    except (TimeoutError, Disconnected):
        await _close(ws, CLOSE_POLICY)
    except Exception as exc:  # noqa: BLE001 (our bug, before a session was made: the socket closes, the server goes on)
        log.error("/v1/realtime: the opening failed: %s", describe(exc))
        await _close(ws, CLOSE_SERVER_ERROR)


async def _openai_session(e: Edge, ws: WebSocket, who: str, ext: Extensions,
                          rate: ByteRate) -> dict[str, Any] | None:
    """Returns the first event when it is `session.resume` (this fresh session is then dropped). A stock client's
    session ends with its socket: only a client that opted into the extensions has the token and seqs to resume."""
    state = openai.OpenAIRealtimeState(new_session_id(), ext=ext, vad=_vad(), limits=e.limits)
    async with admitted(e.gateway, ws), running(e.gateway, state, ws, resumable=ext.events, owner=who,
                                                 bytes_in=rate) as session:
        try:  # the first-event deadline, as every dialect's
            text = await _first_frame(e, ws, rate)
        except TimeoutError:
            await session.close("init_timeout", ws_code=CLOSE_POLICY)
            return None
        except Disconnected:
            session.detach(ws)
            return None
        msg = await _first_event(text)
        if msg.get("type") == "session.resume":
            session.ws = None  # the socket goes on with the resumed session
            await session.close("resumed_elsewhere", emit=False)
            return msg
        await serve(session, ws, text)
    return None


async def _minicpm_session(e: Edge, ws: WebSocket, mode: str, who: str, rate: ByteRate) -> dict[str, Any] | None:
    """Returns the first event when it is `session.resume` (the slot is given back first)."""
    async with admitted(e.gateway, ws, queue_event=minicpm.queue_position) as early:
        session_id = new_session_id()
        await ws.send_text(json.dumps(minicpm.QueueDone(session_id).encode()))
        text = early if early is not None else await _first_frame(e, ws, rate)
        msg = await _first_event(text)
        if msg.get("type") == "session.resume":
            return msg
        state = minicpm.MiniCPMRealtimeState(session_id, mode=mode, limits=e.limits,
                                             charge_voice=e.voices.charger(who, address(ws)))
        async with running(e.gateway, state, ws, resumable=True, owner=who, bytes_in=rate) as session:
            await serve(session, ws, text)
    return None


async def _first_frame(e: Edge, ws: WebSocket, rate: ByteRate) -> str:
    """A socket's first frame, within the first-event deadline, paced as the caller's bytes are."""
    return await receive_text(ws, e.settings.init_timeout_s, e.settings.test_faults, rate)


def _vad() -> openai.SpeechProbabilities | None:
    try:
        return SileroVad().probabilities
    except VadUnavailable:
        return None  # the overlap policy falls back to loudness; server_vad is refused at session.update


def _as_event(text: str) -> dict[str, Any]:
    """A first event, to see what it is ({} when it is not a JSON object; the session then answers it)."""
    try:
        msg = parse_json(text)
    except ValueError:
        return {}
    return msg if isinstance(msg, dict) else {}


async def _first_event(text: str) -> dict[str, Any]:
    return await off_loop(len(text), _as_event, text)  # a large one off the event loop


async def _refuse(ws: WebSocket, event: dict[str, Any], code: int) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await ws.send_text(json.dumps(event))
        await ws.close(code=code)


async def _close(ws: WebSocket, code: int) -> None:
    with contextlib.suppress(Exception):  # the client may be gone already
        await ws.close(code=code)

"""Sessions leave nothing behind in the gateway: after rounds of sessions in every dialect (clean ones, hostile
frames, clients that vanish mid-step, a resume, a grace that expires), the gateway holds what it held idle:
no registry entry or slot, no per-key count, the same asyncio tasks, and no object of a session (its state,
its Triton stream and gRPC channel, its socket). What a leak would grow with sessions, counted, not RSS
(bench/soak.py prints the memory figures over hundreds of sessions).

The gateway runs in this process (uvicorn in the test's event loop) so its tables and objects can be counted;
Triton is the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.websockets import WebSocket
from tritonclient.grpc import aio as grpcaio

from gateway.audio import encode_f32_base64
from gateway.dialects.state import DialectState
from gateway.journal import Journal
from gateway.routes import create_app
from gateway.settings import Settings
from gateway.shell import Session
from gateway.triton import free_port
from gateway.triton.stream import TritonStream
from gateway.vad import SileroVad

from .helpers import append_message, open_session, recv_until
from .realtime_client import RealtimeClient, opted_in

ROUNDS = 3
# A session's objects: none may outlive it (the watcher of Triton holds one gRPC client for good; the VAD's
# model is shared and kept, SileroVad is its per-stream state).
PER_SESSION = (Session, TritonStream, grpcaio.InferenceServerClient, grpc.aio.Channel, WebSocket, DialectState, Journal,
               SileroVad)


@contextlib.asynccontextmanager
async def in_process_gateway(triton_url: str) -> AsyncIterator[tuple[Starlette, str]]:
    settings = Settings(triton_url=triton_url, disconnect_grace_s=0.5)
    app = create_app(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           ws_max_size=settings.ws_max_size))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(60):
            while not (server.started and app.state.gateway.ready):
                await asyncio.sleep(0.05)
        yield app, f"ws://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def held(app: Starlette) -> dict[str, Any]:
    """What a leak would grow: the gateway's tables, its tasks (by coroutine), and the sessions' objects."""
    gc.collect()
    gw = app.state.gateway
    tasks = Counter(task.get_coro().__qualname__ for task in asyncio.all_tasks())
    objects = Counter(cls.__name__ for obj in gc.get_objects() for cls in PER_SESSION if isinstance(obj, cls))
    quotas = app.state.quotas
    return {"sessions": len(gw.sessions), "reserved": gw._reserved, "queue": gw.queue_length,
            "per_key": len(quotas.keys._counts) + len(quotas.addresses._counts), "tasks": tasks, "objects": objects}


async def backend_clean(base: str, audio: np.ndarray) -> None:
    ws, _ = await open_session(base + "/backend")
    await ws.send(append_message(audio, "in_0"))
    await recv_until(ws, lambda ev: ev.get("chunk_usage") is not None, 60)
    await ws.close()


async def backend_vanishes_mid_step(base: str, audio: np.ndarray) -> None:
    ws, _ = await open_session(base + "/backend")
    await ws.send(append_message(audio, "in_0"))
    ws.transport.abort()  # no close frame, a step in flight


async def backend_binary_after_init(base: str, audio: np.ndarray) -> None:
    ws, _ = await open_session(base + "/backend")
    await ws.send(b"\xff\xfe garbage")
    await recv_until(ws, lambda ev: ev.get("type") == "error", 30)
    await ws.close()


# The OpenAI dialect's kinds opt into the extensions (duplex: a step per second; events: a resume and its grace),
# but for the stock one: no resume, its session ends with its socket.
async def realtime_clean(base: str, audio: np.ndarray) -> None:
    c = await RealtimeClient.connect(opted_in(base + "/v1/realtime"))
    await c.until("session.created")
    await c.append(audio)
    await c.close()


async def realtime_resumed_then_dropped(base: str, audio: np.ndarray) -> None:
    """Dropped, resumed on a new socket, dropped again: the grace expires."""
    c = await RealtimeClient.connect(opted_in(base + "/v1/realtime"))
    created = await c.until("session.created")
    await c.ws.close()
    r = await RealtimeClient.connect(base + "/v1/realtime?resume=1")
    await r.send("session.resume", session_id=created["session"]["id"], resume_token=created["resume_token"],
                 last_received_server_event_seq=created["server_event_seq"])
    assert (await r.recv())["type"] == "session.resumed"
    await r.append(audio)
    await r.ws.close()


async def realtime_stock_dropped_mid_turn(base: str, audio: np.ndarray) -> None:
    """A stock client (server VAD) drops its socket as its turn is answered: the session ends at once."""
    c = await RealtimeClient.connect(base + "/v1/realtime")
    await c.until("session.created")
    await c.append(np.concatenate([audio, np.zeros(16_000, np.float32)]))
    await c.until("response.created")
    await c.ws.close()


async def realtime_surrogate(base: str, audio: np.ndarray) -> None:
    c = await RealtimeClient.connect(opted_in(base + "/v1/realtime"))
    await c.until("session.created")
    await c.ws.send('{"type": "session.update", "session": {"instructions": "\\ud800"}}')
    await c.until("error")
    await c.ws.close()  # the session waits out its grace


async def minicpm_clean(base: str, audio: np.ndarray) -> None:
    c = await RealtimeClient.connect(base + "/v1/realtime?mode=audio")
    await c.until("session.queue_done")
    await c.send("session.update", session={"config": {"do_sample": False}})
    await c.until("session.created")
    await c.send("input_audio_buffer.append", audio=encode_f32_base64(audio))
    await c.until(lambda ev: ev["type"] in ("response.listen", "response.output_audio.delta"))
    await c.close()


async def minicpm_long_number(base: str, audio: np.ndarray) -> None:
    async with websockets.connect(base + "/v1/realtime?mode=audio") as ws:
        await ws.send('{"type": "x", "n": ' + "9" * 5000 + "}")
        with contextlib.suppress(websockets.ConnectionClosed):
            await recv_until(ws, lambda ev: ev.get("type") == "error", 30)


KINDS = (backend_clean, backend_vanishes_mid_step, backend_binary_after_init, realtime_clean,
         realtime_resumed_then_dropped, realtime_stock_dropped_mid_turn, realtime_surrogate, minicpm_clean,
         minicpm_long_number)


async def settled(app: Starlette, triton) -> None:
    live = await asyncio.to_thread(triton.wait_live, lambda lv: not any(lv.values()), 30)
    assert not any(live.values()), live
    async with asyncio.timeout(30):
        while app.state.gateway.sessions:
            await asyncio.sleep(0.1)


async def test_sessions_leave_nothing_behind(triton, speech) -> None:
    audio = speech("Hello there, how are you today?")[:16_000]
    async with in_process_gateway(triton.grpc_url) as (app, base):
        idle = held(app)
        assert idle["sessions"] == 0 and not idle["objects"].get("Session")
        for _ in range(ROUNDS):
            await asyncio.gather(*(kind(base, audio) for kind in KINDS))
            await settled(app, triton)
        # A socket's handler may still be finishing its close after its session was forgotten: a moment's grace.
        deadline = asyncio.get_running_loop().time() + 10
        while (after := held(app)) != idle and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
    assert after == idle, (idle, after)

"""Over the real servers, the LLM on the paged engine: a KV pool with no room for a new session refuses it with
`pool_full` before any step runs, and the client is told it may retry (the error says `retryable`, the socket
closes with 1013 Try Again Later); the refused sessions leave no stage state behind. A pool that live sessions
fill is a busy stage, not a dead one: the gateway's health watch (whose old `llm` probe, a START the pool refused,
called the stage broken, ended every session and reloaded the model) keeps the endpoint ready and every live
session speaking."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch  # noqa: F401 (the llm model serves the paged engine, torch, in tritonserver: the torch-less subset leaves this module out)
import websockets

from .conftest import RunningTriton, start_gateway, stop_gateway, triton_with
from .helpers import append_message, init_message, recv_until

pytestmark = pytest.mark.engines  # .ci/run step of its own (pyproject's markers)

# the paged engine on the CPU, every new session wanting more room than the pool has
FULL = {"MINICPMO_LLM_ENGINE": "paged", "MINICPMO_KV_POOL_SIZE": "0.001", "MINICPMO_ADMIT_TOKENS": "100000000"}


# the paged engine on the CPU, room for four sessions: the pool is 0.0011 of the memory plan's budget (8 GB less the
# margin and the stages: ~545 blocks of 16 tokens of tiny's 1 KiB), each session admitted with 2048 tokens of it (128
# blocks: a minute of speech and the system prompt fit)
FOUR = {"MINICPMO_LLM_ENGINE": "paged", "MINICPMO_KV_POOL_SIZE": "0.0011", "MINICPMO_ADMIT_TOKENS": "2048"}
SESSIONS = 4


@pytest.fixture(scope="module")
def full_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with(FULL, tmp_path_factory.mktemp("triton_full"))


@pytest.fixture(scope="module")
def four_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with(FOUR, tmp_path_factory.mktemp("triton_four"))


async def test_live_sessions_that_fill_the_pool_keep_speaking_while_health_runs(four_triton, tmp_path) -> None:
    gw = start_gateway(four_triton.endpoint, tmp_path / "gateway.log", health_period_s="0.25")
    sockets = []
    try:
        for _ in range(SESSIONS):
            ws = await websockets.connect(gw.ws, max_size=1 << 24)
            await ws.send(init_message())
            assert json.loads(await ws.recv())["type"] == "session.created"
            sockets.append(ws)
        # a second of audio a second, each answered: every session admitted and its pool share held
        for second in range(10):  # 40 health rounds
            for ws in sockets:
                await ws.send(append_message(np.full(16_000, 0.01, np.float32), f"in_{second}"))
            for i, ws in enumerate(sockets):
                events = await recv_until(ws, lambda e: e.get("chunk_usage") is not None or e["type"] in (
                    "error", "session.closed"), 60)
                assert events[-1]["type"] == "response.output.delta", (i, second, events[-3:])
            await asyncio.sleep(0.5)
        assert four_triton.stage_metric("kv_free_blocks", "llm") < 128  # no room for another session
        health = gw.health()
        assert health["status"] == "ready" and health["backend_state"] == "ready", health
        # a fifth session is refused, retryable, by the pool itself: the server is busy, not broken
        async with websockets.connect(gw.ws, max_size=1 << 24) as fifth:
            await fifth.send(init_message())
            assert json.loads(await fifth.recv())["type"] == "session.created"
            await fifth.send(append_message(np.zeros(16_000, np.float32), "in_0"))
            refused = await recv_until(fifth, lambda e: e["type"] == "error", 60)
            assert refused[-1]["error"]["code"] == "pool_full" and refused[-1]["error"]["retryable"], refused
        assert gw.health()["active_sessions"] == SESSIONS
        log = (tmp_path / "gateway.log").read_text()
        assert "reloading" not in log and "stages broken" not in log, log[-3000:]
    finally:
        for ws in sockets:
            await ws.close()
        stop_gateway(gw)


async def test_a_full_pool_refuses_a_session_as_retryable(full_triton, tmp_path) -> None:
    gw = start_gateway(full_triton.endpoint, tmp_path / "gateway.log")
    try:
        async with websockets.connect(gw.ws, max_size=1 << 24) as ws:
            await ws.send(init_message())
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(append_message(np.zeros(16_000, np.float32), "in_0"))
            events = []
            async with asyncio.timeout(60):
                while (ev := json.loads(await ws.recv()))["type"] != "session.closed":
                    events.append(ev)
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            assert ws.close_code == 1013, ws.close_code
        errors = [e for e in events if e["type"] == "error"]
        assert errors and errors[0]["error"]["code"] == "pool_full" and errors[0]["error"]["retryable"], events
        assert ev["reason"] == "pool_full", ev
        live = await asyncio.to_thread(full_triton.wait_live, lambda lv: not any(lv.values()), 10)
        assert not any(live.values()), live
    finally:
        stop_gateway(gw)

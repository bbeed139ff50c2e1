"""Over the real servers, the LLM on the paged engine: a KV pool with no room for a new session refuses it with
`pool_full` before any step runs, and the client is told it may retry (the error says `retryable`, the socket
closes with 1013 Try Again Later); the refused sessions leave no stage state behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch  # noqa: F401 (the llm model serves the paged engine, torch, in tritonserver: the torch-less subset leaves this module out)
import websockets

from .conftest import RunningTriton, start_gateway, stop_gateway, triton_with
from .helpers import append_message, init_message

pytestmark = pytest.mark.engines  # .ci/run step of its own (pyproject's markers)

# the paged engine on the CPU, every new session wanting more room than the pool has
FULL = {"MINICPMO_LLM_ENGINE": "paged", "MINICPMO_KV_POOL_SIZE": "0.001", "MINICPMO_ADMIT_TOKENS": "100000000"}


@pytest.fixture(scope="module")
def full_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with(FULL, tmp_path_factory.mktemp("triton_full"))


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

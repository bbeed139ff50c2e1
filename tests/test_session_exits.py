"""However a session's handling goes wrong, in each dialect, its Triton sequence ends and its slot is freed.

Faults are real frames the gateway does not expect (binary after init, JSON nested too deep, a number
of many thousand digits, garbage as the first frame) and, on gateways started with the test-only
MINICPMO_TEST_FAULTS phrase, a frame that raises wherever it is read (the receive loop, a first event).
After each: no live sequence in any stage (the `triton` fixture's metrics) and no active session. The tests share
one gateway (faults on, a resume grace of 1 s, so a session whose socket went ends within a second).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import numpy as np
import pytest
import websockets

from gateway.audio import encode_f32_base64
from gateway.settings import TEST_FAULTS_PHRASE
from gateway.shell import FAULT_FRAME

from .conftest import RunningGateway, RunningTriton, start_gateway, stop_gateway
from .helpers import GREEDY, append_message, open_session
from .realtime_client import RealtimeClient, opted_in

BAD_FRAMES = {
    "binary": b"\xff\xfe\x00\x9c garbage \x80",
    "deep_json": "[" * 200_000 + "]" * 200_000,
    "long_number": '{"type": "input.append", "input": {"input_id": ' + "7" * 20_000 + "}}",
}

# A session an earlier test module left on this Triton may still wait out its gateway's resume grace (30 s).
EARLIER_GRACE_S = 45.0


@pytest.fixture(scope="module")
def gw(triton: RunningTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    gw = start_gateway(triton.endpoint, tmp_path_factory.mktemp("exits") / "gateway.log", disconnect_grace_s="1",
                       test_faults=TEST_FAULTS_PHRASE)
    asyncio.run(settled(gw, triton, EARLIER_GRACE_S))  # each test then starts as the one before it ended: clean
    yield gw
    stop_gateway(gw)


def second(speech) -> np.ndarray:
    return speech("Hello there, how are you today?")[:16_000]


async def settled(gw, triton, timeout_s: float = 20.0) -> None:
    """Nothing of the session is left: every stage's live sequences back to zero, no active session."""
    live = await asyncio.to_thread(triton.wait_live, lambda lv: not any(lv.values()), timeout_s)
    assert not any(live.values()), live
    for _ in range(100):
        if gw.health()["active_sessions"] == 0:
            break
        await asyncio.sleep(0.1)
    health = gw.health()
    assert health["active_sessions"] == 0 and health["active_session_ids"] == [], health


async def started(triton) -> None:
    live = await asyncio.to_thread(triton.wait_live, lambda lv: lv["duplex"] >= 1)
    assert live["duplex"] >= 1, live


async def closed_by_server(ws: websockets.ClientConnection) -> int:
    async with asyncio.timeout(30):
        while True:
            try:
                await ws.recv()
            except websockets.ConnectionClosed as exc:
                return exc.rcvd.code if exc.rcvd else -1


@pytest.mark.parametrize("fault", [*BAD_FRAMES, "raise"])
async def test_backend(gw, triton, speech, fault: str) -> None:
    ws, _ = await open_session(gw.ws)
    await ws.send(append_message(second(speech), "in_0"))
    await started(triton)
    await ws.send(FAULT_FRAME if fault == "raise" else BAD_FRAMES[fault])
    code = await closed_by_server(ws)
    assert code == (1011 if fault == "raise" else 1003)
    await settled(gw, triton)


@pytest.mark.parametrize("fault", [*BAD_FRAMES, "raise"])
@pytest.mark.parametrize("first", [True, False], ids=["first_event", "after_a_step"])
async def test_openai_realtime(gw, triton, speech, fault: str, first: bool) -> None:
    c = await RealtimeClient.connect(opted_in(gw.realtime))  # duplex: each second is a step, in flight at the fault
    await c.until("session.created")
    if first:
        await c.ws.send(FAULT_FRAME if fault == "raise" else BAD_FRAMES[fault])
        if fault == "raise":  # raised while the shell looks at the first event: the session ends there
            assert await closed_by_server(c.ws) == 1011
            await settled(gw, triton)
            return
    await c.send("session.update", session={"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}})
    await c.append(second(speech), rate=16_000)
    await started(triton)
    if not first:
        await c.ws.send(FAULT_FRAME if fault == "raise" else BAD_FRAMES[fault])
    if fault == "raise":
        assert await closed_by_server(c.ws) == 1011
    else:  # a frame that is not an event is an error; the session goes on until its socket goes
        assert (await c.until("error"))["error"]["code"] == "invalid_json"
        await c.ws.close()
    await settled(gw, triton)


@pytest.mark.parametrize("fault", [*BAD_FRAMES, "raise"])
@pytest.mark.parametrize("first", [True, False], ids=["first_event", "after_a_step"])
async def test_minicpm_realtime(gw, triton, speech, fault: str, first: bool) -> None:
    c = await RealtimeClient.connect(gw.realtime + "?mode=audio")
    assert (await c.recv())["type"] == "session.queue_done"
    if not first:
        await c.send("session.update", session={"config": GREEDY})
        await c.until("session.created")
        await c.send("input_audio_buffer.append", audio=encode_f32_base64(second(speech)))
        await started(triton)
    await c.ws.send(FAULT_FRAME if fault == "raise" else BAD_FRAMES[fault])
    code = await closed_by_server(c.ws)
    assert code == (1011 if fault == "raise" else 1003)
    await settled(gw, triton)


async def test_an_operator_cannot_turn_the_fault_frame_on_by_accident(gateway, triton, speech) -> None:
    """Without the exact phrase the fault frame is just a frame that is not JSON."""
    ws, _ = await open_session(gateway.ws)
    await ws.send(FAULT_FRAME)
    err = json.loads(await ws.recv())
    assert err["type"] == "error" and err["error"]["code"] == "invalid_json"
    assert await closed_by_server(ws) == 1003
    await settled(gateway, triton)

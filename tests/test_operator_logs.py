"""What the operator is told: why Triton is not ready, a step that ends a session, a failing send, a dialect
that fails as its session closes; each with its type and place, never the caller's data.

The shell's `Session` is the code under test; Triton (outside it) is the stand-in of `test_shell_offload`.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from starlette.websockets import WebSocketState

from gateway.dialects.openai import OpenAIRealtimeState
from gateway.dialects.openai_extensions import ALL
from gateway.registry import Gateway
from gateway.settings import Settings
from gateway.shell import Session
from gateway.triton import free_port
from gateway.triton.pool import READY, EndpointPool
from minicpmo_triton.duplex_contract import StepEvent
from minicpmo_triton.errors import Code
from tests.test_shell_offload import FakeTriton, append, until


def gateway_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "gateway" and r.levelno == level]


async def test_readiness_changes_are_logged_once_with_why(caplog: pytest.LogCaptureFixture) -> None:
    gw = Gateway(Settings(triton_url=f"127.0.0.1:{free_port()}"))  # nothing listens there
    [endpoint] = gw.pool.endpoints.values()
    with caplog.at_level(logging.INFO, "gateway"):
        watcher = asyncio.create_task(gw.watch_triton())
        await asyncio.sleep(1.0)  # several checks
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        EndpointPool._set_state(endpoint, READY)
        EndpointPool._set_state(endpoint, READY)
    [line] = gateway_lines(caplog, logging.WARNING)
    assert "no new sessions" in line and "does not answer" in line and endpoint.url in line
    [ready] = gateway_lines(caplog, logging.INFO)
    assert ready.endswith("-> ready: new sessions are placed there") and endpoint.url in ready


async def session_with_a_step(triton: FakeTriton) -> tuple[Session, OpenAIRealtimeState]:
    state = OpenAIRealtimeState("sess_ops", ext=ALL, vad=None)  # duplex: a step per second
    session = Session(state, triton, Settings(), resumable=True)
    await session.handle(json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}}}))
    await session.handle(append(1.0, loud=False))  # a duplex step goes to "Triton"
    return session, state


@pytest.mark.parametrize(("code", "reason"), [(Code.STAGE_ERROR, "backend_error"),
                                              (Code.INVALID_VOICE, "invalid_voice")])
async def test_a_step_that_ends_the_session_is_logged_with_its_code(caplog: pytest.LogCaptureFixture, code: Code,
                                                                     reason: str) -> None:
    triton = FakeTriton()
    session, _ = await session_with_a_step(triton)
    with caplog.at_level(logging.INFO, "gateway"):
        triton.events.put_nowait(StepEvent("error", code=code, message="llm: IndexError: the caller's words"))
        await asyncio.wait_for(session.wait_closed(), 10)
    [line] = gateway_lines(caplog, logging.WARNING)
    assert f"failed with {code}" in line and f"closing ({reason})" in line and "caller" not in line


async def test_a_failing_send_and_a_failing_close_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenSocket:
        application_state = WebSocketState.CONNECTED

        async def send_text(self, text: str) -> None:
            raise ConnectionResetError("the caller's socket")

    triton = FakeTriton()
    session, state = await session_with_a_step(triton)
    session.ws = BrokenSocket()  # a stand-in for the client's socket

    def on_close(reason: str, message: str | None) -> list:
        raise KeyError("a bug in the dialect")

    state.on_close = on_close
    with caplog.at_level(logging.INFO, "gateway"):
        await session.emit(state.created())
        await until(lambda: session.ws is None, "the broken socket was let go")
        await session.close("test")
    sent = [line for line in gateway_lines(caplog, logging.INFO) if "a send failed" in line]
    assert sent and "ConnectionResetError" in sent[0] and "caller" not in sent[0]
    [failed] = gateway_lines(caplog, logging.ERROR)
    assert "close failed" in failed and "KeyError" in failed and "on_close" in failed

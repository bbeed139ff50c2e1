"""The client's handshake against a scripted local WebSocket server (a stand-in for what is outside the
code under test): how the API key travels, which refusals are retried and which are final."""

from __future__ import annotations

import json

import pytest
from websockets.asyncio.server import serve

import minicpmo_client as mc

pytestmark = pytest.mark.asyncio(loop_scope="function")
FAST = mc.Backoff(base_s=0.01, attempts=3)


class Scripted:
    """Each connection gets the next answer: "ok" (session.created, then session.updated) or an error code."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[str, str | None]] = []

    async def handler(self, ws) -> None:
        self.requests.append((ws.request.path, ws.request.headers.get("Authorization")))
        answer = self.answers.pop(0)
        if answer == "too_many_sessions":
            await ws.send(json.dumps({"type": "error", "server_event_seq": 0, "error": {"code": answer}}))
            await ws.close(1013)
            return
        await ws.send(json.dumps({"type": "session.created", "server_event_seq": 1, "resume_token": "t",
                                  "session": {"id": "sess_x"}}))
        json.loads(await ws.recv())  # session.update
        if answer == "ok":
            await ws.send(json.dumps({"type": "session.updated", "server_event_seq": 2, "session": {}}))
        else:
            await ws.send(json.dumps({"type": "error", "server_event_seq": 2, "error": {"code": answer,
                                                                                        "message": "no"}}))
        async for message in ws:
            if json.loads(message)["type"] == "session.close":
                await ws.send(json.dumps({"type": "session.closed", "server_event_seq": 3, "reason": "client_closed"}))


async def start(script: Scripted) -> tuple[object, str]:
    server = await serve(script.handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"ws://127.0.0.1:{port}/v1/realtime"


async def test_the_api_key_goes_in_a_bearer_header_or_the_query() -> None:
    script = Scripted("ok", "ok")
    server, url = await start(script)
    async with server:
        s = await mc.connect(url, api_key="sk-1", backoff=FAST)
        await s.close()
        s = await mc.connect(url, api_key="sk 2", key_in_query=True, backoff=FAST)
        await s.close()
    # the client opts into the extensions it reads (a stock OpenAI client gets the spec alone)
    assert script.requests == [("/v1/realtime?extensions=duplex%2Cevents", "Bearer sk-1"),
                               ("/v1/realtime?key=sk+2&extensions=duplex%2Cevents", None)]
    assert s.state.closed == "client_closed"


async def test_a_busy_server_is_retried_and_a_refused_setting_is_final() -> None:
    script = Scripted("too_many_sessions", "too_many_sessions", "ok", "invalid_value")
    server, url = await start(script)
    async with server:
        s = await mc.connect(url, backoff=FAST)
        assert s.session_id == "sess_x" and len(script.requests) == 3
        await s.close()
        with pytest.raises(mc.ClientError) as err:
            await mc.connect(url, backoff=FAST)
    assert err.value.code == "invalid_value" and not err.value.retryable and len(script.requests) == 4

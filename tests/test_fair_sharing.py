"""Fair sharing over the real servers: a caller cannot hold the session slots with silent or heartbeat-only
sockets, is bounded per address and per key, and cannot spoil another caller's resume; `/v1/voices/check`
refuses a body by its size before reading it and judges the server's own voices. (Client addresses: uvicorn
takes X-Forwarded-For from a proxy on loopback, as the tests' clients are.)"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time

import httpx
import numpy as np
import pytest
import websockets

from gateway.audio import write_wav

from .helpers import GREEDY, append_message, init_message

pytestmark = pytest.mark.asyncio(loop_scope="function")


def at(address: str) -> dict[str, str]:
    return {"X-Forwarded-For": address}


async def opened(url: str, address: str = "10.0.0.9", **connect) -> websockets.ClientConnection:
    ws = await websockets.connect(url, additional_headers=at(address), **connect)
    first = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert first["type"] == "session.created", first
    return ws


async def leave(*sockets: websockets.ClientConnection) -> None:
    """End the sessions (not only their sockets: a Realtime session would wait for a resume)."""
    for ws in sockets:
        await ws.send(json.dumps({"type": "session.close"}))
        await closed(ws, 10)


async def refusal(url: str, address: str = "10.0.0.9", first: dict | None = None, **connect) -> tuple[str, int]:
    """The error a socket gets (after sending `first`, if given), and its close code."""
    async with websockets.connect(url, additional_headers=at(address), **connect) as ws:
        if first is not None:
            await ws.send(json.dumps(first))
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
    assert err["type"] == "error", err
    return err["error"]["code"], info.value.rcvd.code


async def closed(ws: websockets.ClientConnection, within_s: float, heartbeat_s: float | None = None) -> dict:
    """The server's last event before it closed the socket (heartbeats sent meanwhile, if asked)."""
    last: dict = {}

    async def beat() -> None:
        while heartbeat_s is not None:
            await asyncio.sleep(heartbeat_s)
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(json.dumps({"type": "session.heartbeat"}))

    beating = asyncio.create_task(beat())
    try:
        async with asyncio.timeout(within_s):
            while True:
                last = json.loads(await ws.recv())
    except websockets.ConnectionClosed:
        return last
    finally:
        beating.cancel()


async def test_silent_sockets_are_cut_off_and_leave_room(gateway_factory) -> None:
    """max_sessions silent sockets (each from its own address) fill the server; the first-event deadline cuts
    them off (not the 300 s idle timeout), and a caller that was refused gets in."""
    gw = gateway_factory(max_sessions="3", init_timeout_s="2")
    # a stock client (told nothing but the close) and clients that opted into session.closed; the last one sends
    # heartbeats only: they keep a socket open, but are no first event
    silent = [await opened(gw.realtime + ("?extensions=events" if i else ""), f"10.0.1.{i}") for i in range(3)]
    assert (await refusal(gw.realtime, "10.0.2.1")) == ("too_many_sessions", 1013)
    started = time.monotonic()
    ends = await asyncio.gather(*(closed(ws, 10, heartbeat_s=0.5 if i == 2 else None) for i, ws in enumerate(silent)))
    assert all(e.get("type") == "session.closed" and e["reason"] == "init_timeout" for e in ends[1:]), ends
    assert [ws.close_code for ws in silent] == [1008] * 3
    assert time.monotonic() - started < 6
    # one that hangs up before saying anything: its slot waits for a resume only until its first-event deadline (it
    # used to be held for the 30 s grace)
    hung_up = await opened(gw.realtime + "?extensions=events", "10.0.1.9")
    await hung_up.close()
    started = time.monotonic()
    while gw.health()["active_sessions"] and time.monotonic() - started < 10:
        await asyncio.sleep(0.2)
    assert gw.health()["active_sessions"] == 0 and time.monotonic() - started < 4
    clean = await opened(gw.realtime, "10.0.2.1")
    await leave(clean)


async def test_heartbeats_alone_do_not_hold_a_session(gateway_factory) -> None:
    """A socket that sends one event and then only heartbeats is cut off at the idle timeout, however often it
    beats."""
    gw = gateway_factory(idle_timeout_s="3")
    ws = await opened(gw.realtime + "?extensions=events")  # session.closed says why
    await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
    assert json.loads(await ws.recv())["type"] == "session.updated"
    started = time.monotonic()
    end = await closed(ws, 15, heartbeat_s=0.5)
    assert end.get("reason") == "timeout" and time.monotonic() - started < 6, end
    assert gw.health()["active_sessions"] == 0


async def test_sessions_per_address_and_per_key_by_default(gateway_factory) -> None:
    gw = gateway_factory(max_sessions_per_address="2", api_keys="alpha,beta")
    held = [await opened(gw.realtime + "?key=alpha", "10.0.3.1") for _ in range(2)]
    assert await refusal(gw.realtime + "?key=alpha", "10.0.3.1") == ("address_session_limit", 1013)
    other = await opened(gw.realtime + "?key=beta", "10.0.3.2")  # another address has room
    await leave(*held, other)
    # The default per-key limit (16) with keys configured: alpha from many addresses still holds at most 16.
    many = [await opened(gw.realtime + "?key=alpha", f"10.0.4.{i}") for i in range(16)]
    assert await refusal(gw.realtime + "?key=alpha", "10.0.4.99") == ("key_session_limit", 1013)
    beta = await opened(gw.realtime + "?key=beta", "10.0.4.99")
    await leave(*many, beta)


async def test_bogus_resumes_never_refuse_another_callers_real_resume(gateway_factory) -> None:
    """Keys off: two callers behind one address. One sends bogus resumes past the limit; the other's resume of
    its own session (right id, right token) still goes through."""
    gw = gateway_factory(resume_attempts="2", disconnect_grace_s="30", resume_failure_delay_s="0.3")
    # resuming is an extension (the token, the seqs)
    ws = await websockets.connect(gw.realtime + "?extensions=events", additional_headers=at("10.0.5.1"))
    created = json.loads(await ws.recv())
    session_id, token = created["session"]["id"], created["resume_token"]
    await ws.close()  # within its grace, the session waits for its resume
    assert await bogus_resumes(gw, "10.0.5.1", "x") == ["session_resume_expired", "session_resume_expired",
                                                        "rate_limited"]
    # a token naming another gateway is redirected there, but counts and waits as any failed resume: a loop of them
    # is no faster than of any other bogus one
    elsewhere = base64.urlsafe_b64encode(b"ws://10.9.9.9:8006").decode().rstrip("=") + ".x"
    started = time.monotonic()
    assert await bogus_resumes(gw, "10.0.5.2", elsewhere) == ["session_elsewhere", "session_elsewhere",
                                                              "rate_limited"]
    assert time.monotonic() - started >= 0.9
    async with websockets.connect(gw.realtime + "?resume=1", additional_headers=at("10.0.5.1")) as real:
        await real.send(json.dumps({"type": "session.resume", "session_id": session_id, "resume_token": token,
                                    "last_received_server_event_seq": created["server_event_seq"]}))
        assert json.loads(await asyncio.wait_for(real.recv(), 10))["type"] == "session.resumed"
        await real.send(json.dumps({"type": "session.close"}))


async def bogus_resumes(gw, address: str, token: str, attempts: int = 3) -> list[str]:
    codes = []
    for _ in range(attempts):
        async with websockets.connect(gw.realtime + "?resume=1", additional_headers=at(address)) as bogus:
            await bogus.send(json.dumps({"type": "session.resume", "session_id": "sess_nope", "resume_token": token}))
            codes.append(json.loads(await asyncio.wait_for(bogus.recv(), 10))["error"]["code"])
    return codes


async def test_bogus_resumes_are_answered_late_and_bounded_per_address(gateway_factory) -> None:
    """A loop of bogus resumes makes one attempt per delay per socket, and its sockets count per address."""
    gw = gateway_factory(resume_failure_delay_s="0.5", max_sessions_per_address="2")
    t0 = time.monotonic()
    for _ in range(3):
        code, _ = await refusal(gw.realtime + "?resume=1", "10.0.7.1", first={
            "type": "session.resume", "session_id": "sess_nope", "resume_token": "x"})
        assert code == "session_resume_expired"
    assert time.monotonic() - t0 >= 1.5
    held = [await websockets.connect(gw.realtime + "?resume=1", additional_headers=at("10.0.7.2")) for _ in range(2)]
    for ws in held:  # two resumes in flight (answered late) hold the address's two places
        await ws.send(json.dumps({"type": "session.resume", "session_id": "sess_nope", "resume_token": "x"}))
    await asyncio.sleep(0.1)
    code, _ = await refusal(gw.realtime + "?resume=1", "10.0.7.2", first={
        "type": "session.resume", "session_id": "sess_nope", "resume_token": "x"})
    assert code == "address_session_limit"
    for ws in held:
        await ws.close()


async def test_a_flood_of_events_is_refused_past_the_rate_and_the_session_goes_on(gateway_factory) -> None:
    gw = gateway_factory(max_events_per_s="5", max_event_burst="10")
    ws = await opened(gw.realtime, "10.0.8.1")
    for _ in range(40):
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    got: list[str] = []
    with contextlib.suppress(TimeoutError):
        while len(got) < 40:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 3))
            got.append(ev["error"]["code"] if ev["type"] == "error" else ev["type"])
    assert got.count("input_audio_buffer.cleared") <= 12 and got.count("rate_limited") >= 28, got
    await asyncio.sleep(1.0)  # the rate refills: the session goes on
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "input_audio_buffer.cleared"
    await leave(ws)


async def raw_post(port: int, path: str, headers: dict[str, str], body: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body)
    await writer.drain()
    answer = b""
    try:
        async with asyncio.timeout(5):
            while not answer.endswith(b"}"):  # headers, then the JSON body
                answer += await reader.read(4096)
    finally:
        writer.close()
    return answer


async def test_voice_checks_refuse_big_bodies_unread_and_know_the_servers_voices(gateway_factory, triton,
                                                                                  speech) -> None:
    gw = gateway_factory(voices_dir=str(triton.voices_dir))
    # 300 MB announced, a few bytes sent: answered at once, nothing read or held
    answer = await raw_post(gw.port, "/v1/voices/check", {"Content-Type": "application/json",
                                                          "Content-Length": str(300 << 20)}, b'{"audio": "')
    assert answer.startswith(b"HTTP/1.1 413") and b"input_too_large" in answer, answer[:300]

    async def chunks():  # no Content-Length: cut as it streams in
        for _ in range(20):
            yield b" " * (1 << 20)

    async with httpx.AsyncClient() as client:
        r = await client.post(f"{gw.http}/v1/voices/check", content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "input_too_large"

    write_wav(triton.voices_dir / "narrator.wav", speech("I am the narrator of this story."), 16_000)
    (triton.voices_dir / "broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really")
    check = lambda body: httpx.post(f"{gw.http}/v1/voices/check", json=body, timeout=10)  # noqa: E731
    ok = check({"voice": "narrator"})
    assert ok.status_code == 200 and ok.json()["voice"] == "narrator" and ok.json()["duration_s"] > 1, ok.text
    for name in ("broken", "nobody", "../etc/passwd"):
        bad = check({"voice": name})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_voice", bad.text


async def test_a_broken_voice_file_is_a_coded_refusal(gateway, triton) -> None:
    """A session naming a voice whose file is broken is told `invalid_voice` (not 1011 `backend_error`)."""
    (triton.voices_dir / "broken.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really")
    async with websockets.connect(gateway.ws) as ws:
        await ws.send(init_message(GREEDY, voice={"name": "broken"}))
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(append_message(np.zeros(16_000, np.float32), "in_0"))
        end = await closed(ws, 30)
    assert end["type"] == "session.closed" and end["reason"] == "invalid_voice", end
    assert ws.close_code != 1011

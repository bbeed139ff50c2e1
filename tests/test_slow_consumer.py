"""The slow-consumer policy: a client that reads nothing while the server has events for it is closed with
`slow_consumer` (1008) once one send has waited MINICPMO_SEND_TIMEOUT_S behind a full write buffer; its
session ends (slot and Triton sequence freed) and the gateway logs one line, no traceback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import websockets


async def test_a_client_that_never_reads_is_closed(gateway_factory, tmp_path) -> None:
    gw = gateway_factory(send_timeout_s="2", max_prompt_bytes="100000")  # big instructions: big answers
    host, port = gw.http.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel buffers little for us
    sock.connect((host, int(port)))
    ws = await websockets.connect(gw.realtime, sock=sock, max_queue=1, close_timeout=30)
    update = json.dumps({"type": "session.update", "session": {"instructions": "x" * 60_000}})
    sent = 0
    started = time.monotonic()
    with contextlib.suppress(asyncio.TimeoutError, websockets.ConnectionClosed):
        while time.monotonic() - started < 8:  # past the send timeout: the server has given up on us
            await asyncio.wait_for(ws.send(update), 5)  # each answered with a 60 kB session.updated, unread
            sent += 1
            await asyncio.sleep(0.01)
    received = 0
    try:
        async with asyncio.timeout(30):
            while True:
                await ws.recv()
                received += 1
    except websockets.ConnectionClosed as exc:
        assert exc.rcvd is not None and (exc.rcvd.code, exc.rcvd.reason) == (1008, "slow_consumer"), exc
    assert received < sent, (received, sent)  # bounded: not every answer was kept for us
    for _ in range(100):
        if gw.health()["active_sessions"] == 0:
            break
        await asyncio.sleep(0.1)
    assert gw.health()["active_sessions"] == 0
    log = (tmp_path / "gateway0.log").read_text()
    assert "closing (slow_consumer)" in log and "Traceback" not in log, log[-3000:]
    print(f"{sent} events sent unread, {received} delivered before the slow_consumer close")

"""A small Realtime client for the end-to-end tests: send events, collect what the server says."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import websockets

from gateway.audio import encode_pcm16_base64, resample

# What the page, `talk` and minicpmo_client opt into on /v1/realtime (a stock client gets the spec alone): the
# model's own turns, and the extension events and fields (seqs, resume tokens, response.listen, ...).
EXTENSIONS = "extensions=duplex,events"


def opted_in(url: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{EXTENSIONS}"


class RealtimeClient:
    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self.rate = 24_000  # the session's input rate

    @classmethod
    async def connect(cls, url: str) -> RealtimeClient:
        return cls(await websockets.connect(url, max_size=64 << 20))

    async def send(self, event_type: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": event_type, **fields}))

    async def append(self, audio16k: np.ndarray, rate: int | None = None, **fields: Any) -> None:
        pcm = resample(audio16k, 16_000, rate or self.rate)
        await self.send("input_audio_buffer.append", audio=encode_pcm16_base64(pcm), **fields)

    async def recv(self, timeout_s: float = 30.0) -> dict[str, Any]:
        ev = json.loads(await asyncio.wait_for(self.ws.recv(), timeout_s))
        self.events.append(ev)
        return ev

    async def until(self, predicate: Callable[[dict[str, Any]], bool] | str, timeout_s: float = 60.0) -> dict:
        """Receive until an event matches (a predicate, or a type name); return that event."""
        match = (lambda e: e["type"] == predicate) if isinstance(predicate, str) else predicate
        async with asyncio.timeout(timeout_s):
            while True:
                ev = await self.recv(timeout_s)
                if match(ev):
                    return ev

    async def quiet(self, seconds: float = 1.0) -> list[dict[str, Any]]:
        """Everything until the server has said nothing for `seconds`."""
        got = []
        while True:
            try:
                got.append(await self.recv(seconds))
            except (TimeoutError, websockets.ConnectionClosed):
                return got

    def of(self, event_type: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == event_type]

    async def close(self) -> None:
        """End the session (not only the socket, which would leave it waiting for a resume)."""
        try:
            await self.send("session.close")
            await self.until("session.closed", timeout_s=10)
        except (TimeoutError, websockets.ConnectionClosed):
            pass
        await self.ws.close()

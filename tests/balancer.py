"""A TCP load balancer on loopback for the tests: each new connection goes to the next backend port in turn, as a
round-robin layer-4 balancer in front of several gateways does. Its own event loop runs in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading


class RoundRobin:
    def __init__(self, backends: list[int]) -> None:
        self._next = itertools.cycle(backends)
        self.routed: list[int] = []  # the backend of each connection, in order
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="balancer", daemon=True)

    def __enter__(self) -> RoundRobin:
        self._thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        with contextlib.suppress(Exception):
            self._loop.run_until_complete(asyncio.sleep(0.1))
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = next(self._next)
        self.routed.append(port)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        with contextlib.suppress(Exception):
            writer.close()

"""The session's one consumer and its steps: one step in flight at a time, in order, each sent only once the one
before it ended; one bound on the steps waiting (`max_pending_steps`), whatever dialect planned them; a close while
a big frame is read waits for its reading thread before the state is called again.

The shell's `Session` is the code under test; Triton (outside it) is a stand-in that answers each step with a
listen once the test lets it, and records how many of the session's steps it was given at once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections.abc import AsyncIterator

import numpy as np

from gateway.dialects.openai import OpenAIRealtimeState
from gateway.dialects.openai_extensions import ALL
from gateway.settings import Settings
from gateway.shell import Session
from minicpmo_triton.duplex_contract import StepEvent, StepInput
from tests.test_shell_offload import append, sent, until

UPDATE = json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm",
                                                                                       "rate": 16_000}}}}})


class GatedTriton:
    """Each step is answered with one listen when the test opens the gate for it."""

    corr_id = 1

    def __init__(self) -> None:
        self.on_lost = None
        self.gate: asyncio.Queue[None] = asyncio.Queue()
        self.seconds: list[int] = []  # the seconds of caller audio sent, in order (by the audio's first sample)
        self.in_flight = 0
        self.most_in_flight = 0

    async def step(self, request: StepInput, trace: str | None = None) -> AsyncIterator[StepEvent]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            self.seconds.append(round(float(request.audio[0]) * 32_768))
            await self.gate.get()
            yield StepEvent("listen", metrics={"kv_cache_length": 10 * len(self.seconds)})
        finally:
            self.in_flight -= 1

    def answer(self, n: int) -> None:
        for _ in range(n):
            self.gate.put_nowait(None)

    async def cancel(self) -> None:
        pass

    async def close(self, timeout_s: float = 10.0) -> None:
        pass


def numbered(seconds: int) -> str:
    """An append of `seconds` s whose every second starts with its own number (as a 16-bit sample), so that
    Triton's stand-in tells them apart."""
    frame = json.loads(append(seconds, loud=False))
    pcm = np.zeros(seconds * 16_000, np.int16)
    pcm[::16_000] = np.arange(1, seconds + 1)
    frame["audio"] = base64.b64encode(pcm.tobytes()).decode()
    return json.dumps(frame)


def refusals(session: Session) -> list[str]:
    return [e["error"]["code"] for e in sent(session) if e["type"] == "error"]


async def test_a_long_append_goes_out_one_step_at_a_time_in_order_and_one_bound_refuses_what_comes_meanwhile() -> None:
    """With `max_pending_steps` 2, a 6 s append's seconds all go out, in order, each once the one before it was
    answered; an append that comes while more than 2 wait is refused `input_backpressure` (the session goes on),
    and once they are answered the next is taken."""
    triton = GatedTriton()
    state = OpenAIRealtimeState("sess_test", ext=ALL, vad=None)  # duplex, as the page opts into
    session = Session(state, triton, Settings(max_pending_steps=2), resumable=True)
    try:
        await session.handle(UPDATE)
        await session.handle(numbered(6))
        await until(lambda: triton.seconds == [1], "the first second went out")
        await session.handle(numbered(1))  # five wait: refused
        assert refusals(session) == ["input_backpressure"]
        triton.answer(5)
        await until(lambda: len(triton.seconds) == 6, "every second of the long append went out")
        assert triton.seconds == [1, 2, 3, 4, 5, 6]
        await session.handle(numbered(1))  # one waits behind the one in flight: taken
        triton.answer(2)
        await until(lambda: len(triton.seconds) == 7 and triton.in_flight == 0, "the next append went out")
        assert refusals(session) == ["input_backpressure"]
        assert triton.most_in_flight == 1, "one step of the session at a time"
    finally:
        await session.close("test", emit=False)


async def test_a_close_while_a_big_frame_is_read_waits_for_its_thread_before_the_state_is_called() -> None:
    """The reading thread owns the input stream (resampler, VAD) till it ends: the dialect's close is called
    after it, never beside it."""
    triton = GatedTriton()
    state = OpenAIRealtimeState("sess_test", ext=ALL, vad=None)
    state.offload_frame_bytes = 1  # every frame is read in a worker thread
    read, calls = state.read_frame, []
    reading = threading.Event()

    def slow_read(text: str, plan: object) -> object:
        reading.set()
        time.sleep(0.3)  # a big frame's decoding
        calls.append("read")
        return read(text, plan)

    def on_close(reason: str, message: str | None) -> list:
        calls.append("on_close")
        return []

    state.read_frame, state.on_close = slow_read, on_close  # type: ignore[method-assign]
    session = Session(state, triton, Settings(), resumable=True)
    frame = asyncio.get_running_loop().create_task(session.handle(UPDATE))
    await asyncio.get_running_loop().run_in_executor(None, reading.wait, 10.0)
    await session.close("test")
    await frame  # its caller goes on: the session closed
    assert calls == ["read", "on_close"]

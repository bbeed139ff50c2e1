"""The shell reads a big client frame in a worker thread (its VAD and resampling would hold the event loop)
and a small one inline; either way the state decides it on the loop, and a session's events keep their order:
a step event that arrives while a big frame is read waits for the frame's decision.

The shell's `Session` is the code under test; Triton (outside it) is a stand-in that yields the step events
the test gives it, and the VAD a stand-in that records where it runs and holds a big frame's decision until
the loop has shown it still runs.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable

import numpy as np

from gateway.audio import encode_pcm16_base64
from gateway.dialects.openai import OFFLOAD_FRAME_BYTES, OpenAIRealtimeState
from gateway.dialects.openai_extensions import ALL
from gateway.settings import Settings
from gateway.shell import Session
from gateway.vad import WINDOW
from minicpmo_triton.duplex_contract import StepEvent

WAIT_S = 10.0  # a guard against a hang, never a speed goal


class FakeTriton:
    """A session's Triton stream as the shell sees it: each step yields the events the test puts in."""

    corr_id = 1

    def __init__(self) -> None:
        self.on_lost = None
        self.events: asyncio.Queue[StepEvent] = asyncio.Queue()
        self.yielded = threading.Event()  # set as the latest event is handed to the shell

    async def step(self, request: object, trace: str | None = None) -> AsyncIterator[StepEvent]:
        while True:
            ev = await self.events.get()
            self.yielded.set()
            yield ev

    async def cancel(self) -> None:
        pass

    async def close(self, timeout_s: float = 10.0) -> None:
        pass


class GatedVad:
    """Loud windows are speech. Called off the loop, it first has the next step event delivered and waits
    until the loop ran after it: had that event been decided without waiting for this frame, it would be."""

    def __init__(self, triton: FakeTriton) -> None:
        self.triton, self.loop = triton, asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.state: OpenAIRealtimeState | None = None
        self.threads: list[bool] = []  # per call: on the loop's thread?
        self.loop_ran: list[bool] = []
        self.text_seen: list[str] = []  # the reply's words when the step event had been delivered
        self.decided_on_loop: list[bool] = []  # per frame the state decided: on the loop's thread?

    def __call__(self, audio: np.ndarray) -> list[float]:
        on_loop = threading.get_ident() == self.loop_thread
        self.threads.append(on_loop)
        if len(audio) >= 16_000 and on_loop:
            self.triton.events.put_nowait(StepEvent("text", text=" more", metrics={"kv_cache_length": 120}))
        elif len(audio) >= 16_000:
            self.triton.yielded.clear()
            self.loop.call_soon_threadsafe(self.triton.events.put_nowait,
                                           StepEvent("text", text=" more", metrics={"kv_cache_length": 120}))
            delivered = self.triton.yielded.wait(WAIT_S)
            looped = threading.Event()
            self.loop.call_soon_threadsafe(looped.set)  # runs once the task that got the event gave the loop back
            self.loop_ran.append(delivered and looped.wait(WAIT_S))
            self.text_seen.append(self.state.response.item.text)
        n = len(audio) // WINDOW
        return [float(np.abs(audio[i * WINDOW:(i + 1) * WINDOW]).mean() > 0.05) for i in range(n)]


def append(seconds: float, loud: bool) -> str:
    n = int(seconds * 16_000)
    audio = 0.3 * np.sin(np.arange(n) * 0.05) if loud else np.zeros(n)
    return json.dumps({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(audio.astype(np.float32))})


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def sent(session: Session) -> list[dict]:
    return [json.loads(t) for t in session.journal.since(0)]


async def barge_in_with_a_step_event_in_between(offload: bool) -> tuple[Session, GatedVad, list[tuple]]:
    """A reply is being spoken; a small quiet append (inline either way), then 2 s of speech (big: offloaded
    unless `offload` is off) during which Triton delivers one more word of the reply."""
    triton = FakeTriton()
    vad = GatedVad(triton)
    state = OpenAIRealtimeState("sess_test", ext=ALL, vad=vad)  # duplex, as the page opts into
    vad.state = state
    decide = state.on_frame

    def on_frame(read: object) -> object:  # the state itself is only ever called on the loop
        vad.decided_on_loop.append(threading.get_ident() == vad.loop_thread)
        return decide(read)

    state.on_frame = on_frame
    if not offload:
        state.offload_frame_bytes = None
    session = Session(state, triton, Settings(), resumable=True)
    try:
        await session.handle(json.dumps({"type": "session.update", "session": {
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}},
            "overlap_policy": "barge_in_on_speech"}}))
        await session.handle(append(1.0, loud=False))  # one second: a duplex step goes to "Triton"
        triton.events.put_nowait(StepEvent("text", text="hi", metrics={"kv_cache_length": 100}))
        await until(lambda: state.active is not None, "the reply opened")
        await session.handle(append(0.1, loud=False))  # noise under the reply: decided inline
        assert session.offloaded == 0
        big = append(2.0, loud=True)
        assert (len(big) >= OFFLOAD_FRAME_BYTES) and len(append(0.1, loud=True)) < OFFLOAD_FRAME_BYTES
        await session.handle(big)
        await until(lambda: state.stale_dropped == 1, "the word that came during the barge-in was fenced off")
        events = [(e["type"], e.get("delta") or e.get("action") or e.get("response", {}).get("status"))
                  for e in sent(session)]
        return session, vad, events
    finally:
        await session.close("test", emit=False)


async def test_a_big_append_is_decided_off_the_loop_and_a_step_event_waits_for_it() -> None:
    session, vad, events = await barge_in_with_a_step_event_in_between(offload=True)
    assert session.offloaded == 1
    assert vad.threads == [True, False], "the small append's VAD on the loop, the big one's off it"
    assert vad.loop_ran == [True], "the event loop ran while the big append's VAD did"
    assert vad.text_seen == ["hi"], "the step event was decided while the big append was"
    assert vad.decided_on_loop == [True] * 4, "the big append was read off the loop, and decided on it"
    decided = [e for e in events if e[0] in ("response.output_audio_transcript.delta", "overlap.decision",
                                             "response.done")]
    assert decided == [("response.output_audio_transcript.delta", "hi"), ("overlap.decision", "drop"),
                       ("overlap.decision", "barge_in"), ("response.done", "cancelled")]


async def test_offloading_leaves_the_events_as_they_were() -> None:
    _, inline_vad, inline = await barge_in_with_a_step_event_in_between(offload=False)
    _, _, offloaded = await barge_in_with_a_step_event_in_between(offload=True)
    assert inline_vad.threads == [True, True]
    assert offloaded == inline

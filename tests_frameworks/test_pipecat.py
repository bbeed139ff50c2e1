"""Pipecat (`pipecat-ai`), driven as its `examples/realtime/realtime-openai.py` does: an
`OpenAIRealtimeLLMService(api_key=..., base_url=...)` between an `LLMContextAggregatorPair`'s two halves, run
by a `PipelineWorker`; the frames a transport would bring in (`InputAudioRawFrame`) are queued into the
worker, and what the transport would play (`TTSAudioRawFrame`) is observed.

Pipecat parses each server event with its own pydantic models (`pipecat.services.openai.realtime.events`);
one that fails to parse raises in its receive loop, which ends: nothing more is heard from the server. An
`error` event is fatal to it too. The parse is observed (not changed) to say which event and field it was.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import websockets
from loguru import logger
from pipecat.frames.frames import (
    ErrorFrame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMMessagesAppendFrame,
    LLMRunFrame,
    TTSAudioRawFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.events import AudioConfiguration, AudioInput, SessionProperties, TurnDetection
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

from .conftest import API_KEY, INTERRUPTION, QUESTION, RATE, Clean, Gateway, Seen, chunks, silence

pytestmark = pytest.mark.asyncio(loop_scope="function")
logger.remove()  # pipecat logs DEBUG to stderr by default: keep what a failure shows readable
logger.add(sys.stderr, level="WARNING")

# The example's settings with server VAD, and replies kept short (the tiny model talks until its budget).
SERVER_VAD = OpenAIRealtimeLLMService.Settings(
    system_instruction="You are a helpful voice assistant. Keep it short.",
    session_properties=SessionProperties(audio=AudioConfiguration(input=AudioInput(turn_detection=TurnDetection())),
                                         max_output_tokens=24))


# The error codes pipecat's receive loop passes over; any other error event ends it.
PIPECAT_IGNORES = ("response_cancel_not_active", "conversation_already_has_active_response")


class Frames(BaseObserver):
    """The frames the realtime service pushes (what a transport would play), and every ErrorFrame."""

    def __init__(self, llm: OpenAIRealtimeLLMService, seen: Seen) -> None:
        super().__init__()
        self.llm, self.seen = llm, seen

    async def on_push_frame(self, data: FramePushed) -> None:
        if isinstance(data.frame, ErrorFrame):
            if data.source is self.llm:
                self.seen.error(f"ErrorFrame: {data.frame.error}")
        elif data.source is self.llm:
            self.seen.add(type(data.frame).__name__, data.frame)


@contextlib.contextmanager
def parsed_events(seen: Seen) -> Any:
    """Observe pipecat's parse of each server event: `server:<type>`, and what its models refuse."""
    parse = events.parse_server_event

    def observed(message: str) -> Any:
        try:
            evt = parse(message)
        except Exception as exc:
            text = "\n".join(line for line in str(exc).splitlines()[:12] if "errors.pydantic.dev" not in line)
            seen.error(f"pipecat's models refuse a server event: {text}")
            seen.end("pipecat's receive loop ended on a server event its models refuse")
            raise
        seen.add(f"server:{evt.type if evt is not None else 'unparsed'}", evt)
        if evt is not None and evt.type == "error" and evt.error.code not in PIPECAT_IGNORES:
            seen.error(f"error event {evt.error.code}: {evt.error.message} (param {evt.error.param})")
            seen.end(f"pipecat's receive loop ended on the error event {evt.error.code}")
        return evt

    events.parse_server_event = observed
    try:
        yield
    finally:
        events.parse_server_event = parse


@contextlib.asynccontextmanager
async def pipecat_session(gateway: Gateway, clean: Clean, settings: Any = None,
                          messages: list[dict[str, Any]] | None = None, query: str = ""
                          ) -> AsyncIterator[tuple[PipelineWorker, Seen]]:
    seen = Seen()
    sink = logger.add(lambda m: clean.logs.records.append(f"pipecat: {m.record['message'][:600]}"), level="ERROR")
    llm = OpenAIRealtimeLLMService(api_key=API_KEY, base_url=gateway.realtime + query, settings=settings)
    user, assistant = LLMContextAggregatorPair(LLMContext(messages or []))
    worker = PipelineWorker(Pipeline([user, llm, assistant]), observers=[Frames(llm, seen)], idle_timeout_secs=None,
                            params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE))
    with parsed_events(seen):
        run = asyncio.create_task(WorkerRunner(handle_sigint=False).run(worker))
        try:
            await seen.until("session.updated", lambda s: s.count("server:session.updated") > 0 or bool(s.errors),
                             20)
            yield worker, seen
        finally:
            await worker.cancel()
            await asyncio.wait_for(run, 20)
            logger.remove(sink)


async def say(worker: PipelineWorker, pcm: bytes) -> None:
    await worker.queue_frames([InputAudioRawFrame(audio=piece, sample_rate=RATE, num_channels=1)
                               for piece in chunks(pcm)])


def replies(seen: Seen) -> int:
    return seen.count("server:response.done")


async def a_reply(seen: Seen, after: int, what: str, timeout_s: float = 60) -> None:
    await seen.until(what, lambda s: replies(s) > after and s.count(TTSAudioRawFrame.__name__) > 0, timeout_s)


async def test_default_session(gateway: Gateway, clean: Clean) -> None:
    """No settings at all: pipecat sends its default session.update once it has parsed session.created."""
    async with pipecat_session(gateway, clean) as (_, seen):
        await asyncio.sleep(1)
        clean.check(seen)
        assert seen.count("server:session.updated"), "no session.updated"


async def test_greeting(gateway: Gateway, clean: Clean) -> None:
    """The example's start: a context saying "Say hello!", and an `LLMRunFrame` when the client connects."""
    async with pipecat_session(gateway, clean, SERVER_VAD, [{"role": "developer", "content": "Say hello!"}]) \
            as (worker, seen):
        await worker.queue_frames([LLMRunFrame()])
        await a_reply(seen, 0, "the greeting, spoken")
        clean.check(seen)


async def test_server_vad_turn_with_audio_back(gateway: Gateway, clean: Clean, speech: Callable[[str], bytes]
                                              ) -> None:
    async with pipecat_session(gateway, clean, SERVER_VAD) as (worker, seen):
        await say(worker, speech(QUESTION) + silence(1.0))
        await seen.until("speech_stopped", lambda s: s.count("server:input_audio_buffer.speech_stopped") > 0, 30)
        await a_reply(seen, 0, "the reply, spoken")
        clean.check(seen)


async def test_barge_in_by_speech_then_typed_message(gateway: Gateway, clean: Clean,
                                                     speech: Callable[[str], bytes]) -> None:
    async with pipecat_session(gateway, clean, SERVER_VAD) as (worker, seen):
        await say(worker, speech(QUESTION) + silence(1.0))
        await seen.until("the reply's first audio", lambda s: s.count(TTSAudioRawFrame.__name__) > 0, 60)
        await say(worker, speech(INTERRUPTION) + silence(1.0))
        await seen.until("the reply cut where it was heard (conversation.item.truncated)",
                         lambda s: s.count("server:conversation.item.truncated") > 0, 30)
        before = replies(seen)
        await worker.queue_frames([LLMMessagesAppendFrame([{"role": "user", "content": "And in Berlin?"}],
                                                          run_llm=True)])
        await a_reply(seen, before, "a reply to the typed message after the barge-in")
        clean.check(seen)


async def test_app_interrupt_and_truncate(gateway: Gateway, clean: Clean) -> None:
    """An `InterruptionFrame` while the bot speaks: pipecat truncates the reply to what was played."""
    async with pipecat_session(gateway, clean, SERVER_VAD) as (worker, seen):
        await worker.queue_frames([LLMMessagesAppendFrame([{"role": "user", "content": "Tell me a story."}],
                                                          run_llm=True)])
        await seen.until("the reply's first audio", lambda s: s.count(TTSAudioRawFrame.__name__) > 0, 60)
        await worker.queue_frames([InterruptionFrame()])
        await seen.until("conversation.item.truncated", lambda s: s.count("server:conversation.item.truncated") > 0,
                         20)
        clean.check(seen)


async def test_typed_message(gateway: Gateway, clean: Clean) -> None:
    async with pipecat_session(gateway, clean, SERVER_VAD) as (worker, seen):
        await worker.queue_frames([LLMMessagesAppendFrame([{"role": "user", "content": "Hello, who are you?"}],
                                                          run_llm=True)])
        await a_reply(seen, 0, "a reply to the typed message")
        clean.check(seen)


async def stock_session(gateway: Gateway, speech: Callable[[str], bytes]) -> list[str]:
    """Every server event of a session a stock client drives over a raw socket (server VAD: a spoken turn, a
    barge-in, a typed message, a cancel and a truncate): what pipecat would parse, had it lived that long."""
    got: list[str] = []

    async def until(ws: Any, event_type: str, timeout_s: float = 60) -> dict[str, Any]:
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    got.append(await ws.recv())
                    ev = json.loads(got[-1])
                    if ev["type"] == event_type:
                        return ev
        except TimeoutError:
            seen = [json.loads(m)["type"] for m in got[-12:]]
            raise AssertionError(f"waited {timeout_s} s for {event_type}; last events: {seen}") from None

    async def send(ws: Any, event_type: str, **fields: Any) -> None:
        await ws.send(json.dumps({"type": event_type, **fields}))

    async def say(ws: Any, pcm: bytes) -> None:
        for piece in chunks(pcm):
            await send(ws, "input_audio_buffer.append", audio=base64.b64encode(piece).decode())

    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with websockets.connect(gateway.realtime, additional_headers=headers, max_size=64 << 20) as ws:
        await until(ws, "session.created")
        await send(ws, "session.update", session={
            "type": "realtime", "max_output_tokens": 24,
            "audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
        await until(ws, "session.updated")
        await say(ws, speech(QUESTION) + silence(1.0))
        await until(ws, "response.output_audio.delta")
        await say(ws, speech(INTERRUPTION) + silence(1.0))
        # A reply still speaking when the interruption starts is cut (conversation.item.truncated); one already
        # done is not (over a WebSocket the client truncates what it had not played, as below). Either way the
        # interruption is committed and answered.
        await until(ws, "input_audio_buffer.committed")
        reply = (await until(ws, "response.created"))["response"]["id"]
        while (await until(ws, "response.done"))["response"]["id"] != reply:
            pass
        await send(ws, "conversation.item.create", item={"type": "message", "role": "user",
                                                         "content": [{"type": "input_text", "text": "And Berlin?"}]})
        await send(ws, "response.create")
        delta = await until(ws, "response.output_audio.delta")
        await send(ws, "response.cancel")
        await send(ws, "conversation.item.truncate", item_id=delta["item_id"], content_index=0, audio_end_ms=200)
        await until(ws, "conversation.item.truncated")
        await send(ws, "session.close")
        with contextlib.suppress(asyncio.TimeoutError, websockets.ConnectionClosed):
            await until(ws, "session.closed", 10)
    return got


async def test_pipecat_models_parse_every_event_of_a_session(gateway: Gateway, speech: Callable[[str], bytes]
                                                             ) -> None:
    """Past session.created: each server event of a stock session, through pipecat's own parser."""
    refused: dict[str, str] = {}
    for message in await stock_session(gateway, speech):
        try:
            events.parse_server_event(message)
        except Exception as exc:  # noqa: BLE001 (pipecat wraps whatever its models refuse in a bare Exception)
            lines = [line for line in str(exc).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
            refused.setdefault(json.loads(message)["type"], " / ".join(lines[:7]))
    assert not refused, "\n".join(["", *(f"{t}: {why}" for t, why in sorted(refused.items()))])


async def test_duplex_opted_in_on_the_url(gateway: Gateway, clean: Clean) -> None:
    """The model's own turns: `?extensions=duplex&` on base_url (pipecat appends `?model=...` to it as it is: the
    `&` keeps that a parameter of its own); no turn detection set. A typed message is answered in voice."""
    settings = OpenAIRealtimeLLMService.Settings(
        system_instruction="You are a helpful voice assistant. Keep it short.",
        session_properties=SessionProperties(max_output_tokens=24))
    async with pipecat_session(gateway, clean, settings, query="?extensions=duplex&") as (worker, seen):
        updated = [e for k, e in seen.items if k == "server:session.updated"][-1]
        assert updated.session.audio.input.turn_detection is None, updated
        await worker.queue_frames([LLMMessagesAppendFrame([{"role": "user", "content": "Hello, who are you?"}],
                                                          run_llm=True)])
        await a_reply(seen, 0, "a spoken reply in duplex")
        clean.check(seen)

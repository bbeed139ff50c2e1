"""LiveKit Agents with its OpenAI plugin (`livekit-plugins-openai`), without a LiveKit server: the plugin's
`RealtimeModel(base_url=..., api_key=...)` and its `RealtimeSession` (`model.session()`), driven through the
calls an `AgentSession` makes on it (`push_audio`, `generate_reply`, `update_chat_ctx`, `interrupt`,
`truncate`), its events observed (`generation_created`, `input_speech_started`, `error`, and
`openai_server_event_received` for what came over the wire).

LiveKit builds events without validating them (`.construct`), so nothing is refused for a wrong enum; what
fails is what it waits for: `generate_reply()` resolves on a `response.created` echoing its
`response.metadata.client_event_id`, `update_chat_ctx()` on `conversation.item.added` for the item ids it
chose, each within a timeout that raises `RealtimeError` / logs at ERROR.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from livekit import rtc
from livekit.agents import llm
from livekit.plugins import openai
from openai.types.realtime.realtime_audio_input_turn_detection import ServerVad

from .conftest import API_KEY, GREETING, INTERRUPTION, QUESTION, RATE, Clean, Gateway, Seen, chunks, silence

pytestmark = pytest.mark.asyncio(loop_scope="function")
REPLY_TOKENS = 24  # replies kept short: the tiny model talks until its budget (LiveKit asks for "inf")


@pytest.fixture(autouse=True)
def tiny_replies_run_to_their_budget(clean: Clean) -> None:
    """The tiny model's random weights never end a reply (`<|im_end|>` has a logit of 0): each one runs to
    REPLY_TOKENS and is `incomplete` / `max_output_tokens`, as OpenAI's would be at that budget. LiveKit fails
    the generation's future, which nobody awaits: asyncio logs it at ERROR. Not the gateway's doing."""
    clean.allow("response incomplete: max_output_tokens", "the tiny model's replies always reach their budget")


@contextlib.asynccontextmanager
async def livekit_session(gateway: Gateway, short: bool = True, query: str = "", **options: Any
                          ) -> AsyncIterator[tuple[Any, Seen]]:
    """A RealtimeModel pointed at the gateway (base_url is the HTTP API root, as for OpenAI) and its session."""
    model = openai.realtime.RealtimeModel(base_url=f"{gateway.http}/v1{query}", api_key=API_KEY, **options)
    if short:
        model.update_options(max_response_output_tokens=REPLY_TOKENS)
    session = model.session()
    seen = Seen()
    audio: list[rtc.AudioFrame] = []

    async def play(gen: llm.GenerationCreatedEvent) -> None:
        async for message in gen.message_stream:
            seen.add("message", message.message_id)
            async for frame in message.audio_stream:
                audio.append(frame)
                seen.add("audio", frame)
        seen.add("generation_done", gen.response_id)

    tasks: set[asyncio.Task[None]] = set()

    def on_generation(gen: llm.GenerationCreatedEvent) -> None:
        seen.add("generation_created", gen)
        tasks.add(asyncio.get_running_loop().create_task(play(gen)))

    session.on("generation_created", on_generation)
    session.on("input_speech_started", lambda ev: seen.add("input_speech_started", ev))
    session.on("input_speech_stopped", lambda ev: seen.add("input_speech_stopped", ev))
    session.on("error", lambda ev: seen.error(f"{ev.error}: {getattr(ev.error, 'body', '')}"))
    session.on("openai_server_event_received", lambda ev: seen.add(f"server:{ev.get('type')}", ev))
    session.on("openai_client_event_queued", lambda ev: seen.add(f"client:{ev.get('type')}", ev))
    try:
        await seen.until("session.updated", lambda s: s.count("server:session.updated") > 0 or bool(s.errors), 20)
        yield session, seen
    finally:
        for task in tasks:
            task.cancel()
        await session.aclose()
        await model.aclose()


async def push(session: Any, pcm: bytes) -> None:
    for piece in chunks(pcm):
        session.push_audio(rtc.AudioFrame(piece, RATE, 1, len(piece) // 2))
        await asyncio.sleep(0)


def of(seen: Seen, kind: str) -> list[dict[str, Any]]:
    return [d for k, d in seen.items if k == kind]


def why_no_reply(seen: Seen) -> str:
    """What generate_reply() waited for: a response.created echoing its metadata.client_event_id."""
    asked = [e.get("response", {}).get("metadata") for e in of(seen, "client:response.create")]
    created = [e["response"].get("metadata") for e in of(seen, "server:response.created")]
    errors = [e["error"] for e in of(seen, "server:error")]
    return (f"LiveKit sent response.create with response.metadata {asked}; the server's response.created "
            f"carried metadata {created}; error events: {errors}")


def why_no_items(seen: Seen) -> str:
    """What update_chat_ctx() waited for: conversation.item.added for each item id it created."""
    sent = [e["item"].get("id") for e in of(seen, "client:conversation.item.create")]
    added = [e["item"]["id"] for e in of(seen, "server:conversation.item.added")]
    return f"LiveKit created items {sent}; the server added items {added}"


async def resolved(what: str, awaitable: Any, seen: Seen, why: Callable[[Seen], str], timeout_s: float = 15) -> Any:
    """A LiveKit call that must resolve (generate_reply has its own 10 s timeout: its RealtimeError says so)."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except (TimeoutError, llm.RealtimeError) as exc:
        raise AssertionError(f"{what} did not resolve: {type(exc).__name__}: {exc}. {why(seen)}") from exc


def generations_done(seen: Seen) -> int:
    return seen.count("generation_done")


async def test_default_session(gateway: Gateway, clean: Clean) -> None:
    """`RealtimeModel()` as its docs construct it: semantic_vad, text and audio, voice marin."""
    async with livekit_session(gateway, short=False) as (_, seen):
        await asyncio.sleep(1)
        clean.check(seen)


async def test_greeting(gateway: Gateway, clean: Clean) -> None:
    """The documented start: `generate_reply(instructions=...)` on an empty conversation."""
    async with livekit_session(gateway) as (session, seen):
        gen = await resolved("generate_reply(instructions=...) on an empty conversation",
                             session.generate_reply(instructions=GREETING), seen, why_no_reply)
        assert gen.user_initiated
        await seen.until("the greeting's audio, to its end", lambda s: generations_done(s) > 0 and s.count("audio"),
                         60)
        clean.check(seen)


async def test_server_vad_turn_with_audio_back(gateway: Gateway, clean: Clean, speech: Callable[[str], bytes]
                                              ) -> None:
    async with livekit_session(gateway, turn_detection=ServerVad(type="server_vad")) as (session, seen):
        await push(session, speech(QUESTION) + silence(1.0))
        await seen.until("input_speech_stopped", lambda s: s.count("input_speech_stopped") > 0, 30)
        await seen.until("a reply with audio, to its end", lambda s: generations_done(s) > 0 and s.count("audio"), 60)
        clean.check(seen)


async def test_barge_in_by_speech_then_generate_reply(gateway: Gateway, clean: Clean,
                                                      speech: Callable[[str], bytes]) -> None:
    async with livekit_session(gateway, turn_detection=ServerVad(type="server_vad")) as (session, seen):
        await push(session, speech(QUESTION) + silence(1.0))
        await seen.until("the reply's first audio", lambda s: s.count("audio") > 0, 60)
        before = seen.count("input_speech_started")
        await push(session, speech(INTERRUPTION) + silence(1.0))
        await seen.until("input_speech_started under the reply", lambda s: s.count("input_speech_started") > before,
                         30)
        await seen.until("the interrupted reply's end", lambda s: generations_done(s) > 0, 30)
        await asyncio.sleep(2)  # the interruption's own turn
        await resolved("generate_reply() after a barge-in", session.generate_reply(), seen, why_no_reply)
        clean.check(seen)


async def test_app_interrupt_and_truncate(gateway: Gateway, clean: Clean) -> None:
    """What AgentSession does when the app interrupts: `interrupt()`, then `truncate()` to what was played."""
    async with livekit_session(gateway) as (session, seen):
        await resolved("generate_reply()", session.generate_reply(instructions="Tell a long story."),
                       seen, why_no_reply)
        await seen.until("the reply's first audio", lambda s: s.count("audio") > 0, 60)
        message_id = next(d for k, d in seen.items if k == "message")
        session.interrupt()
        session.truncate(message_id=message_id, modalities=["audio"], audio_end_ms=300)
        await seen.until("conversation.item.truncated", lambda s: s.count("server:conversation.item.truncated") > 0,
                         20)
        await seen.until("the interrupted reply's end", lambda s: generations_done(s) > 0, 30)
        await resolved("generate_reply() after interrupt()", session.generate_reply(), seen, why_no_reply)
        clean.check(seen)


async def typed_message_answered(session: Any, seen: Seen) -> None:
    """A typed message the way AgentSession adds one: `update_chat_ctx` with the new item, then a reply."""
    ctx = session.chat_ctx.copy()
    ctx.add_message(role="user", content="Hello, who are you?")
    await resolved("update_chat_ctx() with a user message", session.update_chat_ctx(ctx), seen, why_no_items)
    await resolved("generate_reply() to the typed message", session.generate_reply(), seen, why_no_reply)
    await seen.until("the reply's audio, to its end", lambda s: generations_done(s) > 0 and s.count("audio"), 60)


async def test_typed_message_with_update_chat_ctx(gateway: Gateway, clean: Clean) -> None:
    async with livekit_session(gateway) as (session, seen):
        await typed_message_answered(session, seen)
        clean.check(seen)


async def test_duplex_opted_in_on_the_url(gateway: Gateway, clean: Clean) -> None:
    """The model's own turns: `?extensions=duplex` on base_url, `turn_detection=None` (a duplex session reports
    null: no VAD turns); a typed message and generate_reply() are answered in voice."""
    async with livekit_session(gateway, query="?extensions=duplex", turn_detection=None) as (session, seen):
        updated = of(seen, "server:session.updated")[-1]["session"]
        assert (updated["duplex"], updated["audio"]["input"]["turn_detection"]) == (True, None), updated
        await typed_message_answered(session, seen)
        clean.check(seen)

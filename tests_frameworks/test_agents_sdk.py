"""The OpenAI Agents SDK (`openai-agents`), driven as its realtime quickstart says (`RealtimeAgent`,
`RealtimeRunner`, `runner.run(model_config={"url": ..., "api_key": ...})`, `send_audio`, `send_message`,
`interrupt`, iterating the session's events), against our gateway. Every server event passes the SDK's
validation (`openai.types.realtime.RealtimeServerEvent`) or it logs `Failed to validate server event` at
ERROR and emits an `error` event: both fail these tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pydantic
import pytest
from agents.realtime import RealtimeAgent, RealtimeRunner, RealtimeSession

from .conftest import API_KEY, INTERRUPTION, QUESTION, Clean, Gateway, Seen, chunks, silence

pytestmark = pytest.mark.asyncio(loop_scope="function")

# The quickstart's settings, with server VAD, and replies kept short (the tiny model talks until its budget).
QUICKSTART = {"model_settings": {
    "audio": {"input": {"format": "pcm16", "turn_detection": {"type": "server_vad", "interrupt_response": True}},
              "output": {"format": "pcm16", "voice": "alloy"}},
    "max_output_tokens": 24}}
DEFAULTS = {"model_settings": {"max_output_tokens": 24}}  # the SDK's defaults (semantic_vad), short replies
# The model's own turns (docs/frameworks.md): `?extensions=duplex` on the url, and `turn_detection: None` so the
# SDK does not ask for its semantic_vad (a duplex session reports turn_detection null: no VAD turns).
DUPLEX = {"model_settings": {"turn_detection": None, "max_output_tokens": 24}}


def describe(error: Any) -> str:
    """An `error` event's cause, precisely: each field the SDK's validation refused, or the server's error."""
    if isinstance(error, pydantic.ValidationError):
        # union branches (model names) are left out of the path; each refusal once
        lines = dict.fromkeys(
            f"{e['loc'][0]}: {'.'.join(str(p) for p in e['loc'][1:] if not str(p)[:1].isupper())}"
            f" = {e.get('input')!r:.60}: {e['msg']}" if e["type"] != "union_tag_invalid"
            else f"{e['input']!r:.200}: not a spec event" for e in error.errors())
        return "; ".join(lines)
    if isinstance(error, dict) or hasattr(error, "code"):
        get = error.get if isinstance(error, dict) else lambda k: getattr(error, k, None)
        return f"server error {get('code')}: {get('message')} (param {get('param')})"
    return repr(error)


def record(ev: Any, seen: Seen) -> None:
    """A session event as `kind`: the SDK's own type, or `server:<type>` for the raw server event under it."""
    if ev.type == "error":
        seen.error(describe(ev.error))
    elif ev.type == "raw_model_event":
        if ev.data.type == "raw_server_event":
            seen.add(f"server:{ev.data.data.get('type')}", ev.data.data)
    else:
        seen.add(ev.type, ev)


@contextlib.asynccontextmanager
async def agents_session(gateway: Gateway, config: dict[str, Any] | None = None, query: str = ""
                         ) -> AsyncIterator[tuple[RealtimeSession, Seen]]:
    agent = RealtimeAgent(name="Assistant", instructions="You are a helpful voice assistant. Keep it short.")
    runner = RealtimeRunner(starting_agent=agent, config=config)
    session = await runner.run(model_config={"url": gateway.realtime + query, "api_key": API_KEY})
    seen = Seen()
    async with session:
        async def pump() -> None:
            async for ev in session:
                record(ev, seen)

        task = asyncio.create_task(pump())
        try:
            await seen.until("session.updated", lambda s: s.count("server:session.updated") > 0
                             or bool(s.errors), 20)
            yield session, seen
        finally:
            task.cancel()


def replies(seen: Seen) -> int:
    return seen.count("server:response.done")


def audio_bytes(seen: Seen) -> int:
    return sum(len(ev.audio.data) for kind, ev in seen.items if kind == "audio")


async def say(session: RealtimeSession, pcm: bytes) -> None:
    for piece in chunks(pcm):
        await session.send_audio(piece)


async def a_reply(seen: Seen, after: int, what: str, timeout_s: float = 60) -> None:
    """A response created after position `after` of what the session saw, and done."""
    def done(s: Seen) -> bool:
        created = {d["response"]["id"] for k, d in s.items[after:] if k == "server:response.created"}
        return any(d["response"]["id"] in created for k, d in s.items[after:] if k == "server:response.done")
    await seen.until(what, done, timeout_s)


async def settled(seen: Seen, timeout_s: float = 60) -> None:
    """No response open and no speech going on, for a second."""
    def idle(s: Seen) -> bool:
        return (s.count("server:response.created") == replies(s)
                and s.count("server:input_audio_buffer.speech_started")
                == s.count("server:input_audio_buffer.speech_stopped"))
    for _ in range(2):
        await seen.until("the session to settle (every response done)", idle, timeout_s)
        await asyncio.sleep(1)


async def test_default_session(gateway: Gateway, clean: Clean) -> None:
    """`RealtimeRunner(agent)` with no settings: the SDK asks for semantic_vad, audio/pcm, voice, transcription."""
    async with agents_session(gateway) as (_, seen):
        await asyncio.sleep(1)
        updated = [d for k, d in seen.items if k == "server:session.updated"]
        assert updated, f"no session.updated: the SDK's session.update was refused: {seen.errors}"
        td = updated[-1]["session"]["audio"]["input"]["turn_detection"]
        clean.check(seen)
        assert td and td["type"] == "semantic_vad", f"the session's turn detection is {td}, not semantic_vad"


async def test_server_vad_turn_with_audio_back(gateway: Gateway, clean: Clean, speech: Callable[[str], bytes]
                                              ) -> None:
    async with agents_session(gateway, QUICKSTART) as (session, seen):
        await say(session, speech(QUESTION) + silence(1.0))
        await seen.until("speech_started/stopped",
                         lambda s: s.count("server:input_audio_buffer.speech_stopped") > 0, 30)
        await a_reply(seen, 0, "the reply's response.done")
        await seen.until("the SDK's audio_end", lambda s: s.count("audio_end") > 0, 10)
        assert audio_bytes(seen) > 0, "no audio came back"
        clean.check(seen)


async def test_a_long_clip_in_one_send_audio(gateway: Gateway, clean: Clean, speech: Callable[[str], bytes]) -> None:
    """`send_audio(clip)` with a 7 s recording: one append of 7 s (OpenAI takes events up to 15 MiB). The question
    and then silence: the turn ends on the silence, as under OpenAI's server VAD (the question said twice filled
    6.7 s of the 7, leaving 0.3 s of silence, under the 500 ms that ends a turn: no server answers that)."""
    async with agents_session(gateway, QUICKSTART) as (session, seen):
        clip = (speech(QUESTION) + silence(7.0))[: 2 * 24_000 * 7]
        await session.send_audio(clip)
        await a_reply(seen, 0, "a reply to the clip")
        clean.check(seen)


async def test_barge_in_by_speech_then_send_message(gateway: Gateway, clean: Clean,
                                                    speech: Callable[[str], bytes]) -> None:
    """In a default session (semantic_vad): the caller speaks over the reply, then the app sends a message."""
    async with agents_session(gateway, DEFAULTS) as (session, seen):
        await say(session, speech(QUESTION) + silence(1.0))
        await seen.until("the reply's first audio", lambda s: s.count("audio") > 0, 60)
        await say(session, speech(INTERRUPTION) + silence(1.0))
        await seen.until("audio_interrupted (the caller spoke over the reply)",
                         lambda s: s.count("audio_interrupted") > 0, 30)
        await settled(seen)
        after = len(seen.items)
        await asyncio.wait_for(session.send_message("And what about Berlin?"), 10)
        await a_reply(seen, after, "a reply to send_message() after the barge-in")
        clean.check(seen)


async def test_app_interrupt_and_truncate(gateway: Gateway, clean: Clean) -> None:
    """`session.interrupt()` while the reply plays: the SDK cancels it and truncates its item to what was played."""
    async with agents_session(gateway, QUICKSTART) as (session, seen):
        await session.send_message("Tell me a long story about the sea.")
        await seen.until("the reply's first audio", lambda s: s.count("audio") > 0, 60)
        await session.interrupt()
        await seen.until("conversation.item.truncated", lambda s: s.count("server:conversation.item.truncated") > 0,
                         20)
        await settled(seen, 20)
        after = len(seen.items)
        await session.send_message("Just say goodbye.")
        await a_reply(seen, after, "a reply to send_message() after interrupt()")
        clean.check(seen)


async def test_typed_message(gateway: Gateway, clean: Clean) -> None:
    async with agents_session(gateway, QUICKSTART) as (session, seen):
        await session.send_message("Hello there, who are you?")
        await a_reply(seen, 0, "a reply to send_message()")
        await seen.until("agent_end", lambda s: s.count("agent_end") > 0, 10)
        history = [ev.history for kind, ev in seen.items if kind == "history_updated"][-1]
        roles = [item.role for item in history if getattr(item, "type", "") == "message"]
        assert roles[:2] == ["user", "assistant"], f"history: {roles}"
        clean.check(seen)


async def test_duplex_opted_in_on_the_url(gateway: Gateway, clean: Clean) -> None:
    """The model's own turns: the SDK meets only spec events (responses open and close as under server VAD);
    a typed message is answered in voice."""
    async with agents_session(gateway, DUPLEX, query="?extensions=duplex") as (session, seen):
        updated = [d for k, d in seen.items if k == "server:session.updated"][-1]["session"]
        assert (updated["duplex"], updated["audio"]["input"]["turn_detection"]) == (True, None), updated
        await session.send_message("Hello there, who are you?")
        await a_reply(seen, 0, "a spoken reply in duplex")
        assert audio_bytes(seen) > 0, "no audio came back"
        clean.check(seen)

"""The client library against the real server (tritonserver + gateway processes), used as a developer
would: connect, converse, interrupt, lose the socket mid-reply and carry on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

import minicpmo_client as mc
from minicpmo_client.state import CONTROL_EVENTS

from .helpers import GREEDY, SPEAKING_TEXT

pytestmark = pytest.mark.asyncio(loop_scope="function")
SECOND = 16_000


async def seconds_of(audio: np.ndarray, n: int) -> AsyncIterator[np.ndarray]:
    """`n` whole seconds of 16 kHz audio (zero padded), one second per chunk, as fast as they go."""
    audio = np.pad(audio, (0, max(0, n * SECOND - len(audio))))[: n * SECOND]
    for i in range(0, len(audio), SECOND):
        yield audio[i:i + SECOND]
        await asyncio.sleep(0)


async def until(events: AsyncIterator[mc.ClientEvent], stop, seen: list, timeout_s: float = 90.0) -> mc.ClientEvent:
    async with asyncio.timeout(timeout_s):
        async for ev in events:
            seen.append(ev)
            if stop(ev):
                return ev
    raise AssertionError(f"the conversation ended first: {seen[-5:]}")


def of(seen: list, kind: type) -> list:
    return [e for e in seen if isinstance(e, kind)]


async def open_session(url: str, **kw) -> mc.Session:
    return await mc.connect(url, input_rate=16_000, session={**GREEDY, **kw.pop("session", {})}, **kw)


async def test_a_turn_yields_typed_events_in_order(gateway, speech) -> None:
    s = await open_session(gateway.realtime, turn_detection="server_vad", session={"max_output_tokens": 32},
                           instructions="You are a helpful assistant.", voice="default", api_key="test-key")
    assert s.session_id in gateway.health()["active_session_ids"]
    audio = np.concatenate([speech("Good morning. What will the weather be like tomorrow?"), np.zeros(SECOND)])
    seen: list = []
    final = await until(s.converse(seconds_of(audio, len(audio) // SECOND + 1)), lambda e: isinstance(e, mc.TurnFinal),
                        seen)
    kinds = [type(e) for e in seen]
    assert kinds.index(mc.UserTurn) < kinds.index(mc.ReplyStarted) < kinds.index(mc.TranscriptDelta)
    assert [u.kind for u in of(seen, mc.UserTurn)][:3] == ["speech_started", "speech_stopped", "committed"]
    started = of(seen, mc.ReplyStarted)[0]
    chunks = of(seen, mc.AudioChunk)
    assert all(c.response_id == started.response_id and c.sample_rate == 24_000 for c in chunks)
    assert chunks[-1].is_final and len(chunks[-1].pcm) == 0 and not any(c.is_final for c in chunks[:-1])
    heard = np.concatenate([c.pcm for c in chunks])
    assert len(heard) > 12_000 and np.abs(heard).max() > 0
    assert final.response_id == started.response_id and final.status in ("completed", "incomplete")
    assert final.transcript == "".join(d.text for d in of(seen, mc.TranscriptDelta)) and final.had_audio
    assert final.latency_ms is not None and final.latency_ms > 0
    await s.close()
    assert s.state.closed == "client_closed" and s.state.missed == 0


@pytest.mark.parametrize("played_ms", [None, 250])  # the server's estimate, or what the player says it played
async def test_interrupt_cuts_the_reply_and_flushes_its_audio(gateway, speech, played_ms) -> None:
    s = await open_session(gateway.realtime)
    seen: list = []
    events = s.converse(seconds_of(speech(SPEAKING_TEXT), 10))
    first = await until(events, lambda e: isinstance(e, mc.AudioChunk), seen)
    assert await s.interrupt(played_ms) == first.response_id
    final = await until(events, lambda e: isinstance(e, mc.TurnFinal), seen)
    cut = seen.index(of(seen, mc.BargeIn)[0])
    assert of(seen, mc.BargeIn)[0] == mc.BargeIn(first.response_id, "client_cancelled")
    assert (final.response_id, final.status, final.had_audio) == (first.response_id, "cancelled", True)
    said = "".join(d.text for d in of(seen, mc.TranscriptDelta) if d.response_id == first.response_id)
    assert said.startswith(final.transcript) and (not said or len(final.transcript) < len(said)), "not cut"
    assert not [e for e in seen[cut:] if isinstance(e, mc.AudioChunk) and not e.is_final]
    listen = await until(events, lambda e: isinstance(e, mc.Listening), seen)
    assert listen == mc.Listening(first.response_id, False)
    assert await s.interrupt() is None  # nothing playing now
    await s.close()


async def test_a_socket_cut_mid_reply_resumes_the_session_and_loses_no_event(gateway, speech) -> None:
    trace: list[dict] = []
    s = await open_session(gateway.realtime, turn_detection="server_vad", session={"max_output_tokens": 96},
                           on_server_event=trace.append)
    session_id = s.session_id
    audio = np.concatenate([speech("Good morning. What will the weather be like tomorrow?"), np.zeros(SECOND)])
    seen: list = []
    events = s.converse(seconds_of(audio, len(audio) // SECOND + 1))
    first = await until(events, lambda e: isinstance(e, mc.AudioChunk), seen)
    s.drop_connection()  # TCP gone, no close frame: what a network failure looks like
    resumed = await until(events, lambda e: isinstance(e, mc.Resumed), seen)
    print(f"resumed after the cut: {resumed}")
    assert resumed.attempt == 1 and not resumed.gap
    final = await until(events, lambda e: isinstance(e, mc.TurnFinal), seen)
    assert final.response_id == first.response_id and final.had_audio
    assert s.session_id == session_id and gateway.health()["active_session_ids"].count(session_id) == 1
    seqs = [e["server_event_seq"] for e in trace if e["type"] not in CONTROL_EVENTS]
    assert seqs == list(range(1, len(seqs) + 1)), "a seq is missing or repeated across the cut"
    deltas = [e for e in trace if e["type"] == "response.output_audio.delta"]
    assert sum(len(c.pcm) for c in of(seen, mc.AudioChunk)) == sum(e["metadata"]["audio_ms"] * 24 for e in deltas)
    assert final.transcript == "".join(d.text for d in of(seen, mc.TranscriptDelta))
    await s.close()


async def test_a_slow_consumer_holds_the_socket_back_and_loses_nothing(gateway, speech) -> None:
    trace: list[dict] = []
    s = await open_session(gateway.realtime, turn_detection="server_vad", session={"max_output_tokens": 32},
                           max_queue=4, on_server_event=trace.append)
    audio = np.concatenate([speech("Good morning. What will the weather be like tomorrow?"), np.zeros(SECOND)])
    async for chunk in seconds_of(audio, len(audio) // SECOND + 1):
        await s.send_audio(chunk)
    await asyncio.sleep(6)  # nobody reads: the queue fills, then the reader stops taking from the socket
    assert s.backlog == 4
    seen: list = []
    final = await until(s.events(), lambda e: isinstance(e, mc.TurnFinal), seen)
    assert final.had_audio and of(seen, mc.ReplyStarted)[0].response_id == final.response_id
    seqs = [e["server_event_seq"] for e in trace]
    assert seqs == list(range(1, len(seqs) + 1)) and s.state.missed == 0
    await s.close()


async def test_resume_gives_up_with_a_clear_error_once_the_session_is_gone(gateway_factory, speech) -> None:
    gw = gateway_factory(disconnect_grace_s="0.5")
    s = await open_session(gw.realtime, backoff=mc.Backoff(base_s=1.5, attempts=2, jitter=0))
    s.drop_connection()
    with pytest.raises(mc.ClientError) as err:
        await until(s.converse(), lambda e: False, [], timeout_s=30)
    assert err.value.code == "resume_failed" and "session_resume_expired" in err.value.message
    assert not err.value.retryable
    with pytest.raises(mc.ClientError) as err:
        await s.send_text("still there?")
    assert err.value.code == "resume_failed"


async def test_an_unreachable_server_is_retried_then_refused() -> None:
    from gateway.triton import free_port

    with pytest.raises(mc.ClientError) as err:
        await mc.connect(f"ws://127.0.0.1:{free_port()}/v1/realtime", backoff=mc.Backoff(base_s=0.01, attempts=2))
    assert err.value.code == "connection_failed" and err.value.retryable and "3 attempts" in err.value.message


async def first_answer(s: mc.Session) -> tuple[mc.ClientEvent, list]:
    """The conversation's events until a reply ends or the server refuses; then the session is closed."""
    seen: list = []
    final = await until(s.converse(), lambda e: isinstance(e, (mc.TurnFinal, mc.Error)), seen, timeout_s=60)
    await s.close()
    assert isinstance(final, mc.TurnFinal), final
    return final, seen


@pytest.mark.parametrize("turn_detection", ["server_vad", None, "duplex"])
async def test_a_typed_question_is_answered_in_voice(gateway, turn_detection) -> None:
    s = await open_session(gateway.realtime, turn_detection=turn_detection, session={"max_output_tokens": 24})
    await s.send_text("What will the weather be like tomorrow?")
    final, seen = await first_answer(s)
    assert of(seen, mc.UserTurn)[0].text == "What will the weather be like tomorrow?"
    assert final.had_audio and final.status in ("completed", "incomplete") and final.latency_ms > 0


@pytest.mark.parametrize("turn_detection", ["duplex", "server_vad", None])
async def test_say_hello_voices_the_welcome_line_first(gateway, turn_detection) -> None:
    s = await open_session(gateway.realtime, turn_detection=turn_detection)
    await s.say_hello("Hello! How can I help you today?")
    final, _ = await first_answer(s)
    assert final.had_audio and final.transcript == "Hello! How can I help you today?"


async def test_check_voice_accepts_a_good_reference_and_refuses_a_bad_one(gateway, speech) -> None:
    ok = await mc.check_voice(gateway.realtime, speech("This is my voice, please use it."))
    assert ok.sample_rate == 16_000 and ok.duration_s > 0.5
    assert (await mc.check_voice(gateway.http, "default")).duration_s is None
    with pytest.raises(mc.ClientError) as err:
        await mc.check_voice(gateway.realtime, np.zeros(1600, np.float32))  # 0.1 s: under the 0.5 s minimum
    assert err.value.code == "invalid_voice"

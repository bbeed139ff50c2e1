"""`/v1/realtime` end to end: real tritonserver, real gateway process, real WebSockets, espeak-ng speech."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import websockets

from gateway.audio import decode_pcm16_base64, encode_f32_base64

from .helpers import SPEAKING_TEXT
from .realtime_client import RealtimeClient, opted_in

pytestmark = pytest.mark.asyncio(loop_scope="function")
GREEDY = {"do_sample": False}
TENTH = 1600  # 100 ms at 16 kHz


def tenths(audio: np.ndarray) -> list[np.ndarray]:
    return [audio[i:i + TENTH] for i in range(0, len(audio), TENTH)]


def whole_seconds(audio: np.ndarray, n: int) -> np.ndarray:
    return np.pad(audio, (0, max(0, n * 16_000 - len(audio))))[: n * 16_000]


IN_16K = {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}  # whole seconds in, whole steps


async def open_session(url: str, **session) -> tuple[RealtimeClient, dict]:
    """A session opted into the extensions (these tests exercise them, as the page does): duplex, unless a turn
    detection is named (`duplex: false` leaves duplex)."""
    if "turn_detection" in session:
        session["duplex"] = False
    c = await RealtimeClient.connect(opted_in(url))
    created = await c.recv()
    assert created["type"] == "session.created", created
    await c.send("session.update", session={**GREEDY, **session})
    await c.until("session.updated")
    return c, created


async def speaking(c: RealtimeClient, speech_audio: np.ndarray, seconds: int = 6) -> dict:
    """Whole seconds of speech, each sent once the model has answered the one before, until it opens a spoken
    response. In lockstep, so that no second reaches the gateway after the reply opened (it would be judged as
    the caller talking over the reply, and the test would depend on the machine's speed)."""
    audio = whole_seconds(speech_audio, seconds)
    for i in range(seconds):
        await c.append(audio[i * 16_000:(i + 1) * 16_000])
        step = await c.until("duplex.step")
        if step["decision"] == "speak":
            return await c.until("response.speak")  # sent right after the step that opens it
    raise AssertionError("the model did not speak")


async def append_seconds(c: RealtimeClient, audio: np.ndarray) -> None:
    for i in range(0, len(audio), 16_000):
        await c.append(audio[i:i + 16_000])


def index(events: list[dict], event_type: str) -> int:
    return next(i for i, e in enumerate(events) if e["type"] == event_type)


async def test_an_openai_turn_with_server_vad(gateway, speech) -> None:
    c, created = await open_session(gateway.realtime, max_output_tokens=32,
                                    audio={"input": {"turn_detection": {"type": "server_vad"}}})
    assert created["resume_token"] and created["capabilities"]["barge_in"]
    audio = np.concatenate([speech("Good morning. What will the weather be like tomorrow?"), np.zeros(16_000)])
    for piece in tenths(audio):  # 100 ms appends, as OpenAI clients send them
        await c.append(piece)
    done = await c.until("response.done")
    assert done["response"]["status"] in ("completed", "incomplete")
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.added", "response.created",
             "response.output_item.added", "response.content_part.added", "response.output_audio_transcript.delta",
             "response.output_audio.delta", "response.output_audio.done", "response.output_audio_transcript.done",
             "response.content_part.done", "response.output_item.done", "response.done"]
    positions = [index(c.events, t) for t in order]
    assert positions == sorted(positions), [c.events[i]["type"] for i in positions]
    user = c.of("conversation.item.added")[0]["item"]
    assert user["role"] == "user" and user["content"][0]["type"] == "input_audio"
    audio_out = np.concatenate([decode_pcm16_base64(e["delta"], 1 << 30) for e in c.of("response.output_audio.delta")])
    assert len(audio_out) > 24_000 // 2 and np.abs(audio_out).max() > 0  # audio/pcm at 24 kHz
    transcript = "".join(e["delta"] for e in c.of("response.output_audio_transcript.delta"))
    assert done["response"]["output"][0]["content"][0]["transcript"] == transcript
    assert done["response"]["usage"]["output_token_details"]["audio_tokens"] > 0
    seqs = [e["server_event_seq"] for e in c.events]
    assert seqs == list(range(1, 1 + len(seqs))) and all(e["event_id"].startswith("event_") for e in c.events)
    await c.close()


async def test_a_whole_utterance_in_one_append_is_decided_off_the_loop(gateway, speech) -> None:
    """A recording uploaded as one append (3 s of speech + 1 s of silence at 24 kHz): its VAD would hold the
    event loop, so the gateway decides it in a worker thread; the turn is the one 100 ms appends make."""
    c, _ = await open_session(gateway.realtime, max_output_tokens=8,
                              audio={"input": {"turn_detection": {"type": "server_vad"}}})
    audio = np.concatenate([speech("Good morning. What will the weather be like tomorrow?"), np.zeros(16_000)])
    assert len(audio) <= 5 * 16_000  # within one append's limit
    before = gateway.health()["frames_offloaded"]
    await c.append(audio)
    done = await c.until("response.done")
    assert gateway.health()["frames_offloaded"] == before + 1
    assert done["response"]["status"] in ("completed", "incomplete")
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.added", "response.created", "response.done"]
    positions = [index(c.events, t) for t in order]
    assert positions == sorted(positions), [c.events[i]["type"] for i in positions]
    seqs = [e["server_event_seq"] for e in c.events]
    assert seqs == list(range(1, 1 + len(seqs)))
    await c.close()


async def test_model_native_listen_and_speak(gateway, speech) -> None:
    c, _ = await open_session(gateway.realtime, audio={"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                                                       "output": {"format": {"type": "audio/pcm", "rate": 16000}}})
    c.rate = 16_000
    await c.append(whole_seconds(speech(SPEAKING_TEXT), 3))
    # the first three seconds are listened to: each step's decision (`duplex.step`), and nothing else
    heard = [await c.until("duplex.step") for _ in range(3)]
    assert [(e["second"], e["decision"]) for e in heard] == [(1, "listen"), (2, "listen"), (3, "listen")], heard
    assert not c.of("response.speak")
    assert await c.quiet(1.5) == [], "the first three seconds are listened to"
    await c.append(whole_seconds(speech(SPEAKING_TEXT)[48_000:], 3))
    speak = await c.until("response.speak")
    deltas = [await c.until("response.output_audio.delta") for _ in range(2)]
    assert all(d["response_id"] == speak["response_id"] and d["metadata"]["epoch"] == 0 for d in deltas)
    assert [d["metadata"]["audio_start_ms"] for d in deltas] == [0, 1000]
    assert all(len(decode_pcm16_base64(d["delta"], 1 << 30)) == 16_000 for d in deltas)  # 1 s at 16 kHz out
    # The caller cuts in (response.cancel): the model goes back to listening, then speaks again, on its own.
    await c.send("response.cancel")
    listen = await c.until("response.listen")
    assert (listen["response_id"], listen["end_of_turn"]) == (speak["response_id"], False)
    again = await speak_again(c)
    assert again["response_id"] != speak["response_id"] and again["epoch"] == 1
    await c.close()


async def speak_again(c: RealtimeClient, seconds: int = 10) -> dict:
    """Seconds of silence until the model opens another spoken response (greedy decoding: deterministic)."""
    before = len(c.of("response.speak"))
    for _ in range(seconds):
        await c.append(np.zeros(16_000, np.float32))
        await c.quiet(0.3)
        if len(c.of("response.speak")) > before:
            return c.of("response.speak")[-1]
    raise AssertionError("the model did not speak again")


async def test_barge_in_cancels_and_no_late_delta_gets_out(gateway, speech) -> None:
    c, _ = await open_session(gateway.realtime, overlap_policy="barge_in_on_speech", audio=IN_16K)
    c.rate = 16_000
    speak = await speaking(c, speech(SPEAKING_TEXT))
    await c.until("response.output_audio.delta")
    dropped_before = gateway.health()["stale_deltas_dropped"]
    await c.quiet(0.5)
    # One more silent second (its step goes to Triton), then at once the caller talks over the reply: the
    # barge-in is decided on the gateway (VAD, milliseconds) while that step is still in the stages, so its
    # words and audio come back late, whatever the machine's load, and must be fenced off.
    await c.append(np.zeros(16_000, np.float32))
    await c.append(speech("Stop, stop, wait a moment please.")[:8000])
    decision = await c.until(lambda e: e["type"] == "overlap.decision" and e["action"] == "barge_in")
    assert decision["reason"] == "speech_onset"
    done = await c.until("response.done")
    assert done["response"]["id"] == speak["response_id"]
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected", "cause": "barge_in"}
    after = c.events[c.events.index(done) + 1:] + await c.quiet(1.5)
    assert not [e for e in after if e.get("response_id") == speak["response_id"]
                and e["type"].endswith(".delta")], "a delta of the cancelled reply reached the client"
    assert gateway.health()["stale_deltas_dropped"] > dropped_before, "the late delta was fenced off"
    truncated = next(e for e in c.events if e["type"] == "conversation.item.truncated")
    assert truncated["audio_end_ms"] <= sum(
        len(decode_pcm16_base64(e["delta"], 1 << 30)) for e in c.of("response.output_audio.delta")) / 24
    # The conversation goes on in the next epoch.
    again = await speak_again(c)
    assert again["epoch"] == 1
    await c.quiet(0.5)
    new = [e for e in c.of("response.output_audio.delta") if e["response_id"] == again["response_id"]]
    assert new and all(e["metadata"]["epoch"] == 1 for e in new)
    await c.close()


async def test_a_backchannel_does_not_interrupt(gateway, speech) -> None:
    c, _ = await open_session(gateway.realtime, overlap_short_ack_ms=700, overlap_barge_in_ms=1200, audio=IN_16K)
    c.rate = 16_000
    speak = await speaking(c, speech(SPEAKING_TEXT))
    await c.quiet(0.5)
    await c.append(np.zeros(8_000, np.float32))  # silence under the reply: dropped as noise
    await c.append(speech("okay")[:8_000], transcript_hint="okay")
    decisions = [await c.until("overlap.decision") for _ in range(2)]
    assert [(d["action"], d["reason"]) for d in decisions] == [("drop", "noise"), ("listen", "backchannel")]
    await c.append(np.zeros(8_000, np.float32))  # completes the second: the reply goes on
    delta = await c.until("response.output_audio.delta")
    assert delta["response_id"] == speak["response_id"] and delta["metadata"]["epoch"] == 0
    assert not c.of("response.done")
    # Closing the session ends the open response first: every response.created gets its response.done.
    await c.send("session.close")
    await c.until("session.closed")
    done = c.of("response.done")
    assert [d["response"]["id"] for d in done] == [speak["response_id"]]
    # the spec has no reason for a session's end; ours is the cause
    assert done[0]["response"]["status_details"] == {"type": "cancelled", "cause": "client_closed"}


async def test_truncate_and_playback_ack(gateway, speech) -> None:
    c, _ = await open_session(gateway.realtime, audio=IN_16K)
    c.rate = 16_000
    speak = await speaking(c, speech(SPEAKING_TEXT))
    first = await c.until("response.output_audio.delta")
    await c.send("playback.ack", response_id=speak["response_id"], played_ms=400)
    ack = await c.until("playback.acknowledged")
    assert (ack["played_ms"], ack["history_committed"]) == (400, False)
    await c.send("playback.ack", response_id=speak["response_id"], played_ms=100)  # acks only move forward
    assert (await c.until("playback.acknowledged"))["played_ms"] == 400
    await c.send("playback.ack", response_id=speak["response_id"], played_ms=10**7)
    sent = sum(e["metadata"]["audio_ms"] for e in c.of("response.output_audio.delta"))
    assert (await c.until("playback.acknowledged"))["played_ms"] <= sent + 1000  # clamped to what was sent
    # Truncating past the end is clamped, and cuts the reply (its response ends cancelled).
    await c.send("conversation.item.truncate", item_id=first["item_id"], content_index=0, audio_end_ms=10**7)
    truncated = await c.until("conversation.item.truncated")
    assert 0 < truncated["audio_end_ms"] <= sent + 1000
    done = c.of("response.done")[0]  # sent just before the truncation it carries out
    assert done["response"]["status"] == "cancelled"
    # A later reply makes acks of the first one too late.
    for _ in range(8):
        await c.append(np.zeros(16_000, np.float32))
        if [e for e in await c.quiet(0.4) if e["type"] == "response.speak"]:
            break
    if len(c.of("response.speak")) > 1:
        await c.send("playback.ack", response_id=speak["response_id"], played_ms=500)
        err = await c.until("error")
        assert err["error"]["code"] == "playback_ack_too_late"
    await c.send("playback.ack", response_id="resp_nope", played_ms=5)
    assert (await c.until("error"))["error"]["code"] == "unknown_response"
    await c.close()


async def test_response_races_and_an_empty_commit(gateway) -> None:
    c, _ = await open_session(gateway.realtime, turn_detection=None, max_output_tokens=48)
    await c.send("response.cancel", event_id="evt_1")
    err = await c.until("error")
    assert (err["error"]["code"], err["error"]["event_id"]) == ("response_cancel_not_active", "evt_1")
    await c.append(np.zeros(800, np.float32))  # 50 ms
    await c.send("input_audio_buffer.commit")
    assert (await c.until("error"))["error"]["code"] == "input_audio_buffer_commit_empty"
    await c.send("input_audio_buffer.clear")
    await c.until("input_audio_buffer.cleared")
    await c.send("conversation.item.create", item={"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": "Hello there!"}]})
    item = (await c.until("conversation.item.done"))["item"]
    await c.send("response.create")
    await c.send("response.create")
    await c.until("response.created")
    assert (await c.until("error"))["error"]["code"] == "conversation_already_has_active_response"
    done = await c.until("response.done")
    assert done["response"]["status"] in ("completed", "incomplete")
    await c.send("conversation.item.retrieve", item_id=item["id"])
    assert (await c.until("conversation.item.retrieved"))["item"]["content"][0]["text"] == "Hello there!"
    await c.send("conversation.item.delete", item_id=item["id"])
    await c.until("conversation.item.deleted")
    await c.send("conversation.item.retrieve", item_id=item["id"])
    assert (await c.until("error"))["error"]["code"] == "item_not_found"
    await c.close()


@pytest.mark.parametrize(("payload", "code"), [
    ("{not json", "invalid_json"),
    (json.dumps({"type": "no.such.event"}), "unknown_event"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "bad_audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()}),
     "bad_audio"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (15 * 1024 * 1024 + 8)}), "event_too_large"),
])
async def test_bad_input_gets_a_coded_error_and_the_session_goes_on(gateway, payload, code) -> None:
    c, _ = await open_session(gateway.realtime)
    await c.ws.send(payload)
    err = await c.until("error")
    assert err["error"]["code"] == code and err["error"]["type"] == "invalid_request_error"
    await c.send("session.update", session={"overlap_barge_in_ms": 1000})
    assert (await c.until("session.updated"))["session"]["overlap_barge_in_ms"] == 1000
    await c.close()


async def test_resume_replays_what_was_missed_and_rotates_the_token(gateway, triton, speech) -> None:
    c, created = await open_session(gateway.realtime)
    await append_seconds(c, whole_seconds(speech(SPEAKING_TEXT), 6))
    await c.until("response.output_audio.delta")
    seen = c.events[-1]["server_event_seq"]
    await c.ws.close()  # the connection drops; the session waits for a resume
    await asyncio.sleep(1.0)  # the rest of the steps run while nobody listens
    r = await RealtimeClient.connect(gateway.realtime + "?resume=1")
    await r.send("session.resume", session_id=created["session"]["id"], resume_token=created["resume_token"],
                 last_received_server_event_seq=seen)
    resumed = await r.recv()
    assert resumed["type"] == "session.resumed" and resumed["replayed"] > 0
    assert resumed["resume_token"] != created["resume_token"]
    replayed = [await r.recv() for _ in range(resumed["replayed"])]
    assert [e["server_event_seq"] for e in replayed] == list(range(seen + 1, seen + 1 + len(replayed)))
    # The old token no longer works; a second attach with the new one replaces this socket.
    bad = await RealtimeClient.connect(gateway.realtime + "?resume=1")
    await bad.send("session.resume", session_id=created["session"]["id"], resume_token=created["resume_token"],
                   last_received_server_event_seq=0)
    assert (await bad.recv())["error"]["code"] == "invalid_resume_token"
    with pytest.raises(websockets.ConnectionClosed):
        await bad.recv()
    second = await RealtimeClient.connect(gateway.realtime)  # a plain connection: a fresh session, then resume
    fresh = await second.recv()
    assert fresh["type"] == "session.created"
    await second.send("session.resume", session_id=created["session"]["id"], resume_token=resumed["resume_token"],
                      last_received_server_event_seq=replayed[-1]["server_event_seq"])
    assert (await second.recv())["type"] == "session.resumed"
    assert (await r.until("session.replaced"))["session_id"] == created["session"]["id"]
    assert fresh["session"]["id"] not in gateway.health()["active_session_ids"]  # dropped for the resumed one
    await second.send("session.close")
    closed = await second.until("session.closed")
    assert closed["reason"] == "client_closed"
    assert created["session"]["id"] not in gateway.health()["active_session_ids"]


async def test_journal_gap_and_grace_expiry_free_the_triton_sequence(gateway_factory, triton, speech) -> None:
    gw = gateway_factory(disconnect_grace_s="2", journal_bytes="4096")
    others = triton.live()["llm"]  # sequences of other tests' sessions, ending or not
    c, created = await open_session(gw.realtime)
    await append_seconds(c, whole_seconds(speech(SPEAKING_TEXT), 6))
    await c.until("response.output_audio.delta")  # an audio delta alone is over 4 KiB: the journal drops
    await c.ws.close()
    r = await RealtimeClient.connect(gw.realtime + "?resume=1")
    await r.send("session.resume", session_id=created["session"]["id"], resume_token=created["resume_token"],
                 last_received_server_event_seq=1)
    gap = await r.recv()
    assert (gap["type"], gap["reason"]) == ("session.resync_required", "journal_gap")
    assert gw.health()["active_sessions"] == 1
    await r.ws.close()  # dropped again, and nobody comes back
    await asyncio.sleep(2.5)
    assert gw.health()["active_sessions"] == 0
    assert triton.wait_live(lambda live: live["llm"] <= others)["llm"] <= others
    late = await RealtimeClient.connect(gw.realtime + "?resume=1")
    await late.send("session.resume", session_id=created["session"]["id"], resume_token=gap["resume_token"],
                    last_received_server_event_seq=0)
    assert (await late.recv())["error"]["code"] == "session_resume_expired"


async def test_minicpm_dialect_with_its_queue(gateway_factory, speech) -> None:
    gw = gateway_factory(max_sessions="1", init_timeout_s="2")
    first = await RealtimeClient.connect(gw.realtime + "?mode=audio")
    assert (await first.recv())["type"] == "session.queue_done"
    await first.send("session.update", session={"instructions": "You are a helpful assistant.",
                                                 "config": GREEDY})
    created = await first.until("session.created")
    assert created["session_id"].startswith("sess_") and created["prompt_length"] > 0
    waiting = await RealtimeClient.connect(gw.realtime + "?mode=video")
    queued = await waiting.recv()
    assert (queued["type"], queued["position"]) == ("session.queued", 1)
    await waiting.send("session.update", session={"config": GREEDY})  # early: kept for when its turn comes
    audio = whole_seconds(speech(SPEAKING_TEXT), 6)
    for i in range(6):
        await first.send("input_audio_buffer.append", audio=encode_f32_base64(audio[i * 16_000:(i + 1) * 16_000]))
    listens = [await first.until("response.listen") for _ in range(3)]
    assert all("kv_cache_length" in e for e in listens)
    delta = await first.until("response.output_audio.delta")
    assert "text" in delta and "audio" in delta and delta["end_of_turn"] is False
    await first.send("session.close", reason="stopped")
    assert (await first.until("session.closed"))["reason"] == "stopped"
    assert (await waiting.until("session.queue_done", timeout_s=10))["type"] == "session.queue_done"
    assert (await waiting.recv())["type"] == "session.created"
    await waiting.ws.send("{not json")
    err = await waiting.until("error")
    assert err["error"]["code"] == "invalid_json"
    assert (await waiting.until("session.closed"))["reason"] == "protocol_error"
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await waiting.recv()
    assert closed.value.rcvd.code == 1003  # as MiniCPM-o's gateway does
    # A caller admitted who never configures its session gives the slot back.
    idle = await RealtimeClient.connect(gw.realtime + "?mode=audio")
    assert (await idle.recv())["type"] == "session.queue_done"
    with pytest.raises(websockets.ConnectionClosed):
        await idle.recv(timeout_s=10)
    again = await RealtimeClient.connect(gw.realtime + "?mode=audio")
    assert (await again.recv())["type"] == "session.queue_done"  # not queued: the slot is free
    await again.ws.close()


async def test_items_with_text_and_an_image(gateway) -> None:
    from .test_vision_e2e import jpeg

    c, _ = await open_session(gateway.realtime, turn_detection=None, max_output_tokens=16)
    await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": f"data:image/jpeg;base64,{jpeg(640, 480)}"}]})
    item = (await c.until("conversation.item.done"))["item"]
    assert [p["type"] for p in item["content"]] == ["input_text", "input_image"]
    await c.send("response.create")
    done = await c.until("response.done")
    details = done["response"]["usage"]["input_token_details"]
    # sliced as MiniCPM-o's processor slices a chat image (max_slice_nums 9): the overview and a 1x2 grid, 64 each
    assert details["image_tokens"] == 64 * 3 and details["text_tokens"] > 0
    # What is no image at all is refused at the door (a coded error, no item); an image whose header reads but whose
    # data does not decode is the stages' finding: a coded error, the response failed, the session on.
    await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/jpeg;base64,aGVsbG8gd29ybGQ="}]})
    assert (await c.until("error"))["error"]["code"] == "bad_image"
    truncated = base64.b64encode(base64.b64decode(jpeg(640, 480))[:2000]).decode()
    await c.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": f"data:image/jpeg;base64,{truncated}"}]})
    bad = (await c.until("conversation.item.done"))["item"]
    await c.send("response.create")
    assert (await c.until("error"))["error"]["code"] == "bad_image"
    assert (await c.until("response.done"))["response"]["status"] == "failed"
    await c.send("conversation.item.delete", item_id=bad["id"])
    await c.until("conversation.item.deleted")
    await c.send("response.create")  # the conversation now ends with the assistant: answered all the same, as OpenAI
    assert (await c.until("response.done"))["response"]["status"] in ("completed", "incomplete")
    await c.send("conversation.item.create", item={"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": "And now?"}]})
    await c.send("response.create")
    assert (await c.until("response.done"))["response"]["status"] in ("completed", "incomplete")
    await c.close()


async def test_the_example_client_talks_realtime(gateway, speech) -> None:
    from gateway.audio import resample
    from minicpmo_client.backend import converse_realtime

    audio = resample(speech("Hello, how are you today?"), 16_000, 24_000)
    events, reply = await converse_realtime(gateway.realtime, audio, turn_detection="server_vad", greedy=True,
                                            quiet_s=1.0)
    types = [e["type"] for e in events]
    assert "input_audio_buffer.speech_stopped" in types and "response.done" in types
    assert types[-1] == "session.closed" and len(reply) > 0

"""The client library's pure parts: the state machine (server events in, typed client events out),
the events it sends, and the backoff. No server: these are the protocol rules on their own."""

from __future__ import annotations

import json

import numpy as np
import pytest

import minicpmo_client as mc
from minicpmo_client import wire
from minicpmo_client.backoff import Backoff


class Server:
    """Numbers events as the gateway does (server_event_seq 1, 2, 3, ...)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "server_event_seq": self.seq, **fields}


def reply_events(s: Server, rid: str, words: list[str], seconds: int, status: str = "completed",
                 reason: str | None = None, kept: str | None = None) -> list[dict]:
    out = [s("response.speak", response_id=rid), s("response.created", response={"id": rid}),
           s("response.output_item.added", response_id=rid, item={"id": f"item_{rid}"})]
    for w in words:
        out.append(s("response.output_audio_transcript.delta", response_id=rid, delta=w))
    for _ in range(seconds):
        out.append(s("response.output_audio.delta", response_id=rid, delta=wire.encode_pcm16(np.full(24_000, 0.25))))
    transcript = "".join(words) if kept is None else kept
    out.append(s("response.done", response={
        "id": rid, "status": status, "status_details": {"reason": reason} if reason else None,
        "output": [{"content": [{"type": "output_audio", "transcript": transcript}]}]}))
    out.append(s("response.listen", response_id=rid, end_of_turn=status == "completed"))
    return out


def feed(state: mc.ConversationState, events: list[dict], t0: float = 0.0, step: float = 0.1) -> list:
    out = []
    for i, ev in enumerate(events):
        out += state.on_server(ev, t0 + i * step)
    return out


def test_a_reply_becomes_started_deltas_audio_final_marker_and_turn_final() -> None:
    s, state = Server(), mc.ConversationState()
    feed(state, [s("session.created", session={"id": "sess_1"}, resume_token="tok")])
    assert (state.session_id, state.resume_token, state.last_seq) == ("sess_1", "tok", 1)
    state.note_input(10.0)  # the caller's last input before the reply
    out = feed(state, reply_events(s, "resp_1", ["Hel", "lo"], 2), t0=10.2)
    kinds = [type(e) for e in out]
    assert kinds == [mc.ReplyStarted, mc.TranscriptDelta, mc.TranscriptDelta, mc.AudioChunk, mc.AudioChunk,
                     mc.AudioChunk, mc.TurnFinal, mc.Listening]
    audio = [e for e in out if isinstance(e, mc.AudioChunk)]
    assert [len(a.pcm) for a in audio] == [24_000, 24_000, 0] and [a.is_final for a in audio] == [False, False, True]
    assert audio[0].sample_rate == 24_000 and abs(audio[0].pcm.max() - 0.25) < 1e-4
    final = out[-2]
    assert final == mc.TurnFinal("resp_1", "Hello", True, "completed", pytest.approx(final.latency_ms))
    # first audio is the 6th event of the reply (t0 + 5 * 0.1), the input was at 10.0
    assert final.latency_ms == pytest.approx((10.2 + 0.5 - 10.0) * 1000)
    assert out[-1] == mc.Listening("resp_1", True) and not state.replying
    assert (state.last_reply.id, state.last_reply.item_id) == ("resp_1", "item_resp_1")  # what a late cut names


def test_a_cancelled_reply_reports_the_barge_in_and_what_was_heard() -> None:
    s, state = Server(), mc.ConversationState()
    out = feed(state, reply_events(s, "resp_2", ["one ", "two ", "three"], 1, status="cancelled",
                                   reason="barge_in", kept="one "))
    i = next(i for i, e in enumerate(out) if isinstance(e, mc.BargeIn))
    assert out[i] == mc.BargeIn("resp_2", "barge_in")
    assert out[i + 1].is_final and out[i + 2].transcript == "one " and out[i + 2].status == "cancelled"
    assert out[-1] == mc.Listening("resp_2", False)


def test_a_reply_without_audio_has_no_final_chunk_and_no_latency() -> None:
    s, state = Server(), mc.ConversationState()
    out = feed(state, reply_events(s, "resp_3", ["text only"], 0))
    assert not any(isinstance(e, mc.AudioChunk) for e in out)
    final = next(e for e in out if isinstance(e, mc.TurnFinal))
    assert (final.had_audio, final.latency_ms, final.transcript) == (False, None, "text only")


def test_replayed_events_are_dropped_and_gaps_counted() -> None:
    s, state = Server(), mc.ConversationState()
    events = reply_events(s, "resp_4", ["a", "b"], 1)
    first = feed(state, events[:5])
    again = feed(state, events[:5])  # a replay of what we already have
    assert again == [] and state.last_seq == 5
    feed(state, events[7:])  # two events never came
    assert state.missed == 2 and state.last_seq == events[-1]["server_event_seq"]
    assert len(first) == 3


def test_control_events_rotate_the_token_without_moving_the_seq() -> None:
    s, state = Server(), mc.ConversationState()
    feed(state, [s("session.created", session={"id": "sess_9"}, resume_token="old")])
    out = state.on_server({"type": "session.resumed", "server_event_seq": 1, "resume_token": "new", "replayed": 0}, 1)
    assert out == [] and (state.resume_token, state.last_seq, state.missed) == ("new", 1, 0)
    out = state.on_server({"type": "session.replaced", "server_event_seq": 1}, 2)
    assert out == [mc.Closed("replaced")] and state.closed == "replaced"


def test_user_turns_errors_and_close() -> None:
    s, state = Server(), mc.ConversationState()
    out = feed(state, [
        s("input_audio_buffer.speech_started", audio_start_ms=300, item_id="item_1"),
        s("input_audio_buffer.speech_stopped", audio_end_ms=1800, item_id="item_1"),
        s("conversation.item.added", item={"id": "item_2", "role": "user",
                                           "content": [{"type": "input_text", "text": "What time is it?"}]}),
        s("conversation.item.added", item={"id": "item_3", "role": "assistant", "content": []}),
        s("error", error={"code": "input_backpressure", "message": "dropped"}),
        s("error", error={"code": "bad_audio", "message": "odd bytes"}),
        s("session.closed", reason="client_closed"),
    ])
    assert out == [mc.UserTurn("speech_started", "item_1", 300), mc.UserTurn("speech_stopped", "item_1", 1800),
                   mc.UserTurn("committed", "item_2", text="What time is it?"),
                   mc.Error("input_backpressure", "dropped", True), mc.Error("bad_audio", "odd bytes", False),
                   mc.Closed("client_closed")]


def test_the_events_the_client_sends() -> None:
    text = [json.loads(m) for m in wire.user_text("Hi?")]
    assert text == [{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Hi?"}]}}, {"type": "response.create"}]
    hello = [json.loads(m) for m in wire.assistant_text("Welcome!")]
    assert hello[0]["item"]["role"] == "assistant" and hello[0]["item"]["content"] == [
        {"type": "output_text", "text": "Welcome!"}] and hello[1] == {"type": "response.create"}
    appends = [json.loads(m) for m in wire.appends(np.zeros(16_000 * 12, np.float32), 16_000)]
    assert [len(wire.decode_pcm16(a["audio"])) for a in appends] == [80_000, 80_000, 32_000]  # at most 5 s each
    update = json.loads(wire.session_update(instructions="Be brief.", voice="default", turn_detection=None,
                                            input_rate=16_000, output_rate=24_000))["session"]
    assert update["audio"]["input"] == {"format": {"type": "audio/pcm", "rate": 16_000}, "turn_detection": None}
    assert update["audio"]["output"]["voice"] == "default" and update["instructions"] == "Be brief."
    assert json.loads(wire.truncate("item_1", 1234.6)) == {"type": "conversation.item.truncate", "item_id": "item_1",
                                                           "content_index": 0, "audio_end_ms": 1235}
    resume = json.loads(wire.resume("sess_1", "tok", 41))
    assert resume == {"type": "session.resume", "session_id": "sess_1", "resume_token": "tok",
                      "last_received_server_event_seq": 41}
    assert wire.with_query("ws://h:1/v1/realtime?resume=1", key="k y") == "ws://h:1/v1/realtime?resume=1&key=k+y"
    assert wire.http_base("wss://h:1/v1/realtime?key=x") == "https://h:1"


def test_pcm16_round_trip_clips() -> None:
    audio = np.array([0.0, 0.5, -0.5, 1.5, -1.5], np.float32)
    back = wire.decode_pcm16(wire.encode_pcm16(audio))
    assert np.allclose(back, [0.0, 0.5, -0.5, 32767 / 32768, -1.0], atol=1e-4)


def test_backoff_is_exponential_capped_jittered_and_bounded() -> None:
    b = Backoff(base_s=0.5, factor=2, max_s=3, attempts=5, jitter=0.5)
    assert list(b.delays(lambda: 0.0)) == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert list(b.delays(lambda: 1.0)) == [0.25, 0.5, 1.0, 1.5, 1.5]
    assert sum(Backoff().delays(lambda: 0.0)) < 30  # inside the server's disconnect grace

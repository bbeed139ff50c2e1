"""The Realtime dialects' pure code: audio codec, VAD segmentation, overlap policy, journal, conversation
cuts, and the OpenAI state machine driven by hand-made step events (no sockets, no Triton)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from gateway.audio import AudioDecodeError, decode_pcm16_base64, encode_pcm16_base64
from gateway.dialects.openai import OpenAIRealtimeState
from gateway.dialects.openai_config import RealtimeConfig, Update, apply_update
from gateway.dialects.openai_conversation import Item
from gateway.dialects.openai_extensions import ALL, Extensions
from gateway.journal import Journal
from gateway.overlap import OverlapPolicy, OverlapSettings
from gateway.vad import WINDOW, SpeechSegmenter
from gateway.wire import ProtocolError
from minicpmo_triton.duplex_contract import StepEvent


class LoudnessVad:
    """Speech wherever a window is loud: a stand-in for Silero in tests of the code around it."""

    def probabilities(self, audio: np.ndarray) -> list[float]:
        n = len(audio) // WINDOW
        return [float(np.abs(audio[i * WINDOW:(i + 1) * WINDOW]).mean() > 0.05) for i in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pcm(seconds: float, loud: bool, rate: int = 16_000) -> str:
    n = int(seconds * rate)
    audio = 0.3 * np.sin(np.arange(n) * 0.05) if loud else np.zeros(n)
    return encode_pcm16_base64(audio.astype(np.float32))


def state(**session) -> tuple[OpenAIRealtimeState, Clock]:
    """A session that opted into the extensions, as the page, `talk` and minicpmo_client do: duplex unless the
    test names a turn detection (which leaves duplex, as `duplex: false` says)."""
    if "turn_detection" in session:
        session.setdefault("duplex", False)
    clock = Clock()
    st = OpenAIRealtimeState("sess_test", ext=ALL, vad=LoudnessVad().probabilities, clock=clock)
    # 16 kHz in: whole seconds of audio make whole steps (at 24 kHz the resampler holds back a few ms)
    st.on_client({"type": "session.update", "session": {
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}, **session}})
    return st, clock


def types(fx) -> list[str]:
    return [e.type for e in fx.events]


def encoded(fx) -> list[dict]:
    return [e.encode() for e in fx.events]


def speak(st: OpenAIRealtimeState, step, text: str = "hi", kv: int = 100, seconds: float = 1.0,
          dropped: int = 0) -> list[str]:
    """`kv`: the LLM's cache after the step; `dropped`: what the sliding window has dropped before it."""
    metrics = {"kv_cache_length": kv, "kv_tokens_total": kv + dropped}
    out = st.on_step_event(step, StepEvent("text", text=text, metrics=metrics))
    audio = np.full(int(24_000 * seconds), 0.1, np.float32)
    out.extend(st.on_step_event(step, StepEvent("audio", audio=audio, metrics=metrics)))
    return types(out)


# ---- codecs and detectors ----
def test_pcm16_round_trip_and_strict_decoding() -> None:
    audio = np.array([0.0, 0.5, -0.5, 0.999], np.float32)
    back = decode_pcm16_base64(encode_pcm16_base64(audio), 10)
    np.testing.assert_allclose(back, audio, atol=1 / 32768)
    with pytest.raises(AudioDecodeError, match="16-bit"):
        decode_pcm16_base64(base64.b64encode(b"abc").decode(), 10)
    with pytest.raises(AudioDecodeError, match="base64"):
        decode_pcm16_base64("not base64!", 10)
    with pytest.raises(AudioDecodeError, match="at most"):
        decode_pcm16_base64(encode_pcm16_base64(np.zeros(11, np.float32)), 10)


def test_segmenter_pads_the_start_and_waits_out_the_silence() -> None:
    seg = SpeechSegmenter(threshold=0.5, prefix_padding_ms=64, silence_duration_ms=96, window_ms=32)
    events = seg.feed([0.0] * 10 + [0.9] * 5 + [0.1] * 2 + [0.9] + [0.0] * 3)
    assert [(e.kind, e.audio_ms) for e in events] == [("speech_started", 320 - 64), ("speech_stopped", 576)]


def test_overlap_policy_decisions() -> None:
    loud, quiet = np.full(1600, 0.2, np.float32), np.zeros(1600, np.float32)
    p = OverlapPolicy(OverlapSettings(short_ack_ms=700, barge_in_ms=1200))
    assert p.decide(quiet, 0).action == "drop"
    assert (p.decide(loud, 500).action, p.decide(loud, 0).reason) == ("listen", "noise")  # a pause resets
    assert p.decide(loud, 300, hint="OK.").reason == "backchannel"
    assert p.decide(loud, 500).reason == "short_speech"  # 800 ms: past the short ack, under barge-in
    assert p.decide(loud, 500).action == "barge_in"  # 1300 ms of sustained speech
    onset = OverlapPolicy(OverlapSettings(policy="barge_in_on_speech"))
    assert onset.decide(loud, 100, vad_onset=True).reason == "speech_onset"
    never = OverlapPolicy(OverlapSettings(policy="listen_only"))
    assert never.decide(loud, 5000).action == "listen"


def test_journal_replays_what_follows_and_reports_a_gap() -> None:
    now = [0.0]
    j = Journal(max_age_s=10, max_bytes=25, clock=lambda: now[0])
    for seq in range(1, 4):
        j.add(seq, f"event-{seq}")  # 7 bytes each
    assert j.since(1) == ["event-2", "event-3"]
    j.add(4, "event-4")  # 28 bytes: event 1 goes
    assert j.since(0) is None and j.since(1) == ["event-2", "event-3", "event-4"]
    now[0] = 20.0
    assert j.since(3) is None  # all of it aged out


def test_a_cut_keeps_the_words_heard_and_only_moves_earlier() -> None:
    item = Item("item_1", "assistant")
    for words in ("Hello there. ", "How are you?"):
        item.add_text(words, voiced=True)
        item.add_audio(1000)
    assert item.heard_text(1500) == "Hello there. How ar"
    assert item.truncate(99_999) == 2000  # clamped to what was sent
    assert item.truncate(500) == 500 and item.text == "Hello "
    assert item.truncate(1800) == 500  # never back out


# ---- configuration ----
def update(session: dict, started: bool = False, config: RealtimeConfig | None = None,
           ext=ALL) -> tuple[RealtimeConfig, list[str]]:
    """`session.update` over a config: the new config and the codes of the fields refused."""
    out, refused = apply_update(config or RealtimeConfig(), Update(session, started, ext, vad=True))
    return out, [err.code for err in refused]


def test_session_update_reads_ga_and_beta_shapes() -> None:
    ga, refused = update({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000},
                                              "turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}},
                          "output_modalities": ["text"]})
    assert (ga.input_rate, ga.turn_detection.type, ga.turn_detection.silence_duration_ms) == (16000, "server_vad", 300)
    assert not ga.audio_out and refused == []
    beta, _ = update({"input_audio_format": "pcm16", "turn_detection": None, "temperature": 0.0})
    assert beta.turn_detection.type is None and beta.options().temperature == 0.0
    assert update({"audio": {"input": {"format": {"type": "audio/pcmu"}}}})[1] == ["unsupported_audio_format"]
    duplex = RealtimeConfig.first(ALL)
    assert update({"turn_detection": {"type": "server_vad"}}, started=True, config=duplex)[1] == \
        ["session_update_not_allowed"]
    assert update({"instructions": "Be brief."}, started=True)[1] == ["session_update_not_allowed"]
    assert update({"overlap_barge_in_ms": 900}, started=True)[0].overlap.barge_in_ms == 900


def test_one_bad_field_refuses_that_field_not_the_others() -> None:
    """What the Agents SDK and LiveKit send first, with one value the session cannot take: the rest applies."""
    config, refused = update({"instructions": "Be brief.", "max_output_tokens": 99, "temperature": -3,
                              "audio": {"output": {"voice": "marin", "format": {"type": "audio/pcmu"}},
                                        "input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}})
    assert refused == ["unsupported_audio_format", "invalid_config"]
    assert (config.instructions, config.max_output_tokens, config.voice) == ("Be brief.", 99, "marin")
    assert config.turn_detection.type == "semantic_vad" and config.model == {}


def test_semantic_vad_is_served_by_the_vad_its_eagerness_setting_the_silence() -> None:
    for eagerness, silence in (("low", 1000), ("medium", 500), ("auto", 500), ("high", 250)):
        config, _ = update({"turn_detection": {"type": "semantic_vad", "eagerness": eagerness}})
        assert (config.turn_detection.vad, config.turn_detection.silence_ms) == (True, silence)
        assert config.turn_detection.to_dict() == {"type": "semantic_vad", "eagerness": eagerness,
                                                   "create_response": True, "interrupt_response": True}
    assert update({"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}})[1] == ["invalid_value"]


def test_duplex_is_offered_where_the_url_opted_in_and_reported_in_spec_values() -> None:
    stock = RealtimeConfig.first(Extensions())
    assert stock.turn_detection.type == "server_vad"  # OpenAI's default
    assert update({"duplex": True}, ext=Extensions())[1] == ["invalid_value"]
    assert update({"turn_detection": {"type": "duplex"}})[1] == ["invalid_value"]  # not a spec value
    duplex = RealtimeConfig.first(ALL)
    shown = duplex.to_dict("sess_1", ALL)
    assert (shown["audio"]["input"]["turn_detection"], shown["duplex"]) == (None, True)
    assert update({"turn_detection": None}, config=duplex)[0].duplex  # what it reports, sent back: no change
    assert update({"duplex": False, "turn_detection": None}, config=duplex)[0].turn_detection.type is None
    assert update({"duplex": False}, config=duplex)[0].turn_detection.type == "server_vad"
    assert update({"turn_detection": {"type": "semantic_vad"}}, config=duplex)[0].turn_detection.type == "semantic_vad"
    assert update({"duplex": True}, config=stock)[0].duplex
    assert "duplex" not in stock.to_dict("sess_1", Extensions()) and "overlap_policy" not in stock.to_dict(
        "sess_1", Extensions())


# ---- the OpenAI state machine ----
def test_duplex_appends_become_one_second_steps_and_a_spoken_turn_is_a_response() -> None:
    st, _ = state()
    fx = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(2.5, loud=True)})
    assert [len(s.request.audio) for s in fx.steps] == [16_000, 16_000]
    steps = fx.steps
    for s in steps:
        st.prepare(s)
    assert steps[0].request.options is not None and steps[1].request.options is None  # options ride on the first
    # each step's decision leads its events (`duplex.step`): a listen step has no other
    listened = encoded(st.on_step_event(steps[0], StepEvent("listen", metrics={"kv_cache_length": 50})))
    assert listened == [{"type": "duplex.step", "event_id": listened[0]["event_id"],
                         "second": 1, "decision": "listen", "epoch": 0, "kv_cache_length": 50}]
    assert speak(st, steps[1]) == [
        "duplex.step", "response.speak", "response.created", "conversation.item.added", "response.output_item.added",
        "response.content_part.added", "response.output_audio_transcript.delta", "response.output_audio.delta"]
    done = st.on_step_event(steps[1], StepEvent("listen", end_of_turn=True, chunk_usage={"output_text_tokens": 2}))
    assert types(done) == [
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done", "response.listen"]
    response = next(e for e in encoded(done) if e["type"] == "response.done")["response"]
    assert response["status"] == "completed" and response["usage"]["output_tokens"] == 2
    assert response["output"][0]["content"][0]["transcript"] == "hi"


def test_cancel_fences_the_old_epoch_and_rolls_back_to_what_was_heard() -> None:
    st, clock = state()
    steps = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(4, loud=False)}).steps
    for s in steps:
        st.prepare(s)
    # the window slid 1000 tokens off before: a rollback point counts from the call's start (kv_tokens_total)
    st.on_step_event(steps[0], StepEvent("listen", metrics={"kv_cache_length": 40, "kv_tokens_total": 1040}))
    speak(st, steps[1], "one ", kv=60, dropped=1000)
    clock.now += 0.5
    speak(st, steps[2], "two ", kv=80, dropped=1000)
    fx = st.on_client({"type": "response.cancel"})
    assert fx.cancel and st.epoch == 1
    done = next(e for e in encoded(fx) if e["type"] == "response.done")["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
    truncated = next(e for e in encoded(fx) if e["type"] == "conversation.item.truncated")
    assert truncated["audio_end_ms"] == 500  # half a second heard, in real time from the first audio
    assert done["output"][0]["content"][0]["transcript"] == "on"
    # The step in flight (the old epoch) keeps talking: none of it gets out, its usage still counts.
    late = st.on_step_event(steps[3], StepEvent("text", text="late", chunk_usage={"output_text_tokens": 1}))
    assert late.events == [] and st.stale_dropped == 1 and st.usage.counts["output_text_tokens"] == 1
    for s in steps:  # each answered, as the shell says once a step's events are all in
        st.on_step_end(s)
    # The next step rolls the LLM back to step 1 (partly heard) and hears steps 2 and 3 again.
    nxt = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(1, loud=False)}).steps[0]
    req = st.prepare(nxt)
    assert req.rollback_to == 1060 and len(req.replay_audio) == 2 * 16_000
    assert st.on_client({"type": "input_audio_buffer.append", "audio": pcm(1, loud=False)}).steps[0].request \
        .rollback_to == -1


def test_sustained_speech_under_a_reply_barges_in_and_a_backchannel_does_not() -> None:
    st, _ = state(overlap_barge_in_ms=1200, overlap_short_ack_ms=700)
    steps = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(1, loud=False)}).steps
    st.prepare(steps[0])
    speak(st, steps[0])
    quiet = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(0.2, loud=False)})
    assert [e["action"] for e in encoded(quiet) if e["type"] == "overlap.decision"] == ["drop"]
    ack = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(0.4, loud=True), "transcript_hint": "ok"})
    assert [(e["action"], e["reason"]) for e in encoded(ack)] == [("listen", "backchannel")]
    assert st.active is not None
    more = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(1.0, loud=True)})
    decisions = [(e["action"], e["reason"]) for e in encoded(more) if e["type"] == "overlap.decision"]
    assert decisions == [("barge_in", "sustained_speech")] and more.cancel
    done = next(e for e in encoded(more) if e["type"] == "response.done")["response"]
    assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected", "cause": "barge_in"}


def test_client_errors_are_coded() -> None:
    st, _ = state()

    def code(event: dict) -> str:
        with pytest.raises(ProtocolError) as err:
            st.on_client(event)
        return err.value.code

    assert code({"type": "response.cancel"}) == "response_cancel_not_active"
    assert code({"type": "input_audio_buffer.commit"}) == "input_audio_buffer_commit_empty"
    assert code({"type": "no.such.event"}) == "unknown_event"
    assert code({"type": "input_audio_buffer.append", "audio": "@@@"}) == "bad_audio"
    odd = base64.b64encode(b"\x00\x01\x02").decode()
    assert code({"type": "input_audio_buffer.append", "audio": odd}) == "bad_audio"
    assert code({"type": "playback.ack", "response_id": "resp_x", "played_ms": 10}) == "unknown_response"
    step = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(1, loud=False)}).steps[0]
    st.prepare(step)
    speak(st, step)
    first = st.response.id
    assert code({"type": "response.create", "response": {"instructions": "go"}}) \
        == "conversation_already_has_active_response"
    st.on_client({"type": "response.cancel"})
    step = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(1, loud=False)}).steps[0]
    st.prepare(step)
    speak(st, step)
    assert code({"type": "playback.ack", "response_id": first, "played_ms": 10}) == "playback_ack_too_late"
    ack = st.on_client({"type": "playback.ack", "response_id": st.response.id, "played_ms": 10**6})
    assert encoded(ack)[0]["played_ms"] == 1000  # clamped to the audio sent


def test_turn_based_response_carries_the_conversation_and_the_heard_reply() -> None:
    st, clock = state(turn_detection=None)
    st.on_client({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                               "content": [{"type": "input_text", "text": "Hi"}]}})
    fx = st.on_client({"type": "response.create"})
    chat = fx.steps[0].request
    assert [m.role for m in chat.messages] == ["user"] and chat.generate_audio is True
    st.prepare(fx.steps[0])
    st.on_step_event(fx.steps[0], StepEvent("text", text="Hello you"))
    st.on_step_event(fx.steps[0], StepEvent("audio", audio=np.zeros(24_000, np.float32)))
    clock.now += 0.2
    st.on_client({"type": "response.cancel"})
    st.on_client({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                               "content": [{"type": "input_text", "text": "Go"}]}})
    nxt = st.on_client({"type": "response.create"}).steps[0].request.messages
    assert [(m.role, m.text) for m in nxt] == [("user", "Hi"), ("assistant", "He"), ("user", "Go")]


def test_chat_images_are_sliced_as_the_reference_processor_slices_them() -> None:
    """A conversation item's image goes to the model with `max_slice_nums` 9, as /backend's turn-based messages and
    MiniCPM-o's chat (its MiniCPMVImageProcessor's default, processing_minicpmo.py:128), not 1 (a duplex frame's)."""
    from .test_vision_e2e import jpeg

    st, _ = state(turn_detection=None)
    st.on_client({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": f"data:image/jpeg;base64,{jpeg(640, 480)}"}]}})
    [message] = st.on_client({"type": "response.create"}).steps[0].request.messages
    assert len(message.images) == 1 and message.max_slice_nums == 9


def test_the_stream_resampler_has_no_seams_between_chunks() -> None:
    from gateway.audio import StreamResampler, resample

    t = np.arange(24_000) / 24_000
    audio = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    stream = StreamResampler(24_000, 16_000)
    chunked = np.concatenate([stream(audio[i:i + 480]) for i in range(0, len(audio), 480)])  # 20 ms chunks
    whole = resample(audio, 24_000, 16_000)
    assert 0 <= len(whole) - len(chunked) < 400  # the stream holds back its last few ms, no more
    np.testing.assert_allclose(chunked, whole[: len(chunked)], atol=1e-4)  # the same signal, seamless


def test_the_turn_based_buffer_is_bounded() -> None:
    st, _ = state(turn_detection=None)
    for _ in range(12):
        st.on_client({"type": "input_audio_buffer.append", "audio": pcm(5, loud=False)})
    with pytest.raises(ProtocolError) as err:
        st.on_client({"type": "input_audio_buffer.append", "audio": pcm(1, loud=False)})
    assert err.value.code == "input_audio_buffer_full"
    vad, _ = state(turn_detection={"type": "server_vad", "prefix_padding_ms": 300})
    for _ in range(20):  # a minute and more of silence: only the prefix padding is kept
        vad.on_client({"type": "input_audio_buffer.append", "audio": pcm(5, loud=False)})
    assert vad.buffer.samples == 300 * 16
    fx = vad.on_client({"type": "input_audio_buffer.append", "audio": pcm(1, loud=True)})
    fx.extend(vad.on_client({"type": "input_audio_buffer.append", "audio": pcm(1, loud=False)}))
    assert types(fx)[:3] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed"]
    assert "response.created" in types(fx) and fx.steps[0].kind == "chat"


def test_minicpm_session_update_checks_its_voice_references() -> None:
    from gateway.audio import encode_f32_base64
    from gateway.dialects.minicpm import MiniCPMRealtimeState

    st = MiniCPMRealtimeState("sess_m")
    with pytest.raises(ProtocolError) as err:
        st.on_client({"type": "session.update", "session": {"ref_audio": encode_f32_base64(np.zeros(800, np.float32))}})
    assert (err.value.code, err.value.close_code) == ("invalid_voice", 1008)
    ref = np.zeros(16_000, np.float32)
    fx = st.on_client({"type": "session.update", "session": {"tts_ref_audio": encode_f32_base64(ref)}})
    assert types(fx) == ["session.created"] and set(st.voice) == {"tts_ref_audio"}


def item(role: str, text: str) -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "conversation.item.create", "item": {"type": "message", "role": role,
                                                         "content": [{"type": kind, "text": text}]}}


def test_duplex_voices_an_assistant_message_at_response_create() -> None:
    st, _ = state()
    for s in st.on_client({"type": "input_audio_buffer.append", "audio": pcm(2, loud=False)}).steps:
        st.prepare(s)
    fx = st.on_client(item("assistant", "Hello! How can I help?"))
    assert types(fx) == ["conversation.item.added", "conversation.item.done"] and fx.steps == []  # not in context yet
    [step] = st.on_client({"type": "response.create"}).steps
    assert (step.kind, step.request.say, step.request.context_text, step.request.answer_tokens) \
        == ("context", "Hello! How can I help?", "", 0)
    assert step.second == 2  # a barge-in into it replays the caller's seconds after the second sent before it
    assert speak(st, step, text="Hello!")[:2] == ["response.speak", "response.created"]
    done = st.on_step_event(step, StepEvent("listen", end_of_turn=True))
    response = next(e for e in encoded(done) if e["type"] == "response.done")["response"]
    assert response["status"] == "completed" and response["output"][0]["content"][0]["transcript"] == "Hello!"
    [again] = st.on_client({"type": "response.create"}).steps  # said once: the next response is an answer
    assert again.request.say == "" and again.request.answer_tokens == st.config.max_output_tokens


def test_duplex_a_deleted_assistant_message_is_not_voiced() -> None:
    st, _ = state()
    item_id = next(e for e in encoded(st.on_client(item("assistant", "Hi"))) if e["type"] == "conversation.item.added")
    st.on_client({"type": "conversation.item.delete", "item_id": item_id["item"]["id"]})
    [step] = st.on_client({"type": "response.create"}).steps
    assert step.request.say == ""


def test_duplex_answers_a_typed_question_in_voice() -> None:
    st, _ = state()
    [ctx] = st.on_client(item("user", "What time is it?")).steps
    assert (ctx.request.context_text, ctx.request.context_kind, ctx.request.respond) == ("What time is it?", "user",
                                                                                          False)
    [step] = st.on_client({"type": "response.create", "response": {"max_output_tokens": 24}}).steps
    assert (step.request.answer_tokens, step.request.say, step.request.context_text) == (24, "", "")
    [prompted] = st.on_client({"type": "response.create", "response": {"instructions": "Greet."}}).steps
    assert (prompted.request.context_text, prompted.request.answer_tokens) == ("Greet.", 0)  # instructions: as before
    with pytest.raises(ProtocolError) as err:
        st.on_client({"type": "response.create", "response": {"max_output_tokens": 0}})
    assert err.value.code == "invalid_value"


def test_the_contract_carries_a_spoken_turn() -> None:
    from minicpmo_triton.duplex_contract import StepInput, decode_request, encode_request
    from minicpmo_triton.errors import StepError
    from minicpmo_triton.model_config import DuplexDefaults

    for req in (StepInput(say="Hello!"), StepInput(context_text="q", context_kind="user", answer_tokens=24)):
        back = decode_request(encode_request(req), False, DuplexDefaults())
        assert (back.say, back.answer_tokens, back.context_text) == (req.say, req.answer_tokens, req.context_text)
    rows = encode_request(StepInput(say="x"))
    rows["context"] = np.array([b'{"answer_tokens": -1}'], np.object_)
    with pytest.raises(StepError) as err:
        decode_request(rows, False, DuplexDefaults())
    assert err.value.code == "invalid_input"


def test_voice_check_judges_as_a_session_does() -> None:
    from gateway.audio import encode_f32_base64
    from gateway.inputs import check_voice

    second = np.zeros(24_000, np.float32)
    assert check_voice({"audio": encode_pcm16_base64(second), "format": "pcm16", "sample_rate": 24_000}) \
        == {"ok": True, "duration_s": 1.0, "sample_rate": 24_000}
    assert check_voice({"audio": encode_f32_base64(second[:16_000])})["duration_s"] == 1.0  # f32 16 kHz by default
    assert check_voice({"voice": "default"})["duration_s"] is None
    bad = [{"audio": encode_f32_base64(second[:1600])}, {"audio": encode_f32_base64(np.zeros(31 * 16_000))},
           {"audio": "@@"}, {"audio": encode_f32_base64(second), "sample_rate": 8000},
           {"audio": encode_f32_base64(second), "format": "mp3"}, {"voice": "nobody"}, {}]
    for body in bad:
        with pytest.raises(ProtocolError) as err:
            check_voice(body)
        assert err.value.code == "invalid_voice", body
    with pytest.raises(ProtocolError) as err:
        check_voice([1])
    assert err.value.code == "invalid_payload"


def test_turn_based_says_an_assistant_message_then_answers_past_it() -> None:
    st, _ = state(turn_detection=None)
    st.on_client(item("assistant", "Hello!"))
    [step] = st.on_client({"type": "response.create"}).steps
    assert step.request.say and [(m.role, m.text) for m in step.request.messages] == [("assistant", "Hello!")]
    st.on_step_event(step, StepEvent("text", text="Hello!"))
    st.on_step_event(step, StepEvent("done", text="Hello!", reason="turn_end"))
    # Said once; asked again with the conversation ending with the assistant, it is answered (as OpenAI's is): the
    # session's instructions come last, so the model has a turn to take.
    [again] = st.on_client({"type": "response.create"}).steps
    assert not again.request.say
    assert [(m.role, m.text) for m in again.request.messages] == [("assistant", "Hello!"),
                                                                  ("system", st.config.instructions)]
    st.on_step_event(again, StepEvent("done", text="", reason="turn_end"))
    st.on_client(item("user", "Hi."))
    [answer] = st.on_client({"type": "response.create"}).steps
    assert not answer.request.say  # the reply's item carries the words said, once
    assert [(m.role, m.text) for m in answer.request.messages][-1] == ("user", "Hi.")


# ---- what a stock client sends (the OpenAI SDKs, the voice-agent frameworks) ----
def stock(**session) -> OpenAIRealtimeState:
    """A session as a stock client opens it (no ?extensions=): server VAD by default."""
    st = OpenAIRealtimeState("sess_stock", vad=LoudnessVad().probabilities, clock=Clock())
    st.on_client({"type": "session.update", "session": {
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}, **session}})
    return st


def test_a_stock_session_starts_in_server_vad_and_sees_no_extension() -> None:
    st = stock()
    created = st.created()[0].encode()
    assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert "capabilities" not in created and "duplex" not in created["session"] and "epoch" not in created["session"]
    fx = st.on_client({"type": "session.update", "session": {"duplex": True, "instructions": "Be brief."}})
    assert [e["type"] for e in encoded(fx)] == ["error", "session.updated"]  # that field refused, the rest taken
    assert encoded(fx)[0]["error"]["param"] == "session.duplex" and st.config.instructions == "Be brief."


def test_response_metadata_is_echoed_and_instructions_come_last() -> None:
    st = stock(turn_detection=None)
    fx = st.on_client({"type": "response.create", "event_id": "evt_greet", "response": {
        "instructions": "Greet the caller.", "metadata": {"client_event_id": "response_create_1"}}})
    created = next(e for e in encoded(fx) if e["type"] == "response.created")["response"]
    assert created["metadata"] == {"client_event_id": "response_create_1"}
    chat = fx.steps[0].request  # a greeting: nothing in the conversation, the instructions alone
    assert [(m.role, m.text) for m in chat.messages] == [("system", "Greet the caller.")] and not chat.say
    done = st.on_step_event(fx.steps[0], StepEvent("done", text="Hi!", reason="length"))
    response = next(e for e in encoded(done) if e["type"] == "response.done")["response"]
    assert response["metadata"] == created["metadata"]
    assert response["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    st.on_client(item("user", "What time is it?"))
    chat = st.on_client({"type": "response.create", "response": {"instructions": "Answer in French."}}).steps[0].request
    assert [(m.role, m.text) for m in chat.messages][-2:] == [("user", "What time is it?"),
                                                            ("system", "Answer in French.")]
    with pytest.raises(ProtocolError) as err:
        st.on_client({"type": "response.create", "response": {"metadata": {"n": 1}}})
    assert (err.value.code, err.value.param) == ("invalid_value", "response.metadata")


def test_a_duplex_response_carries_the_metadata_of_the_response_create_it_answers() -> None:
    st, _ = state()
    [step] = st.on_client({"type": "response.create", "response": {"metadata": {"k": "v"}}}).steps
    st.prepare(step)
    out = st.on_step_event(step, StepEvent("text", text="Hello", metrics={"kv_cache_length": 9}))
    assert next(e for e in encoded(out) if e["type"] == "response.created")["response"]["metadata"] == {"k": "v"}


def test_client_item_ids_are_kept_unique_and_placed_where_asked() -> None:
    st = stock(turn_detection=None)

    def create(text: str, **fields) -> dict:
        out = st.on_client({**item("user", text), **fields})
        return encoded(out)[0]

    def with_id(text: str, item_id: str) -> dict:
        return {"type": "message", "role": "user", "id": item_id, "content": [{"type": "input_text", "text": text}]}

    added = create("one", item=with_id("one", "item_lk_1"))
    assert (added["item"]["id"], added.get("previous_item_id")) == ("item_lk_1", None)
    assert create("zero", item=with_id("zero", "item_lk_0"), previous_item_id="root").get("previous_item_id") is None
    assert create("half", item=with_id("half", "item_lk_h"), previous_item_id="item_lk_0")["previous_item_id"] \
        == "item_lk_0"
    assert [i.id for i in st.conversation.items] == ["item_lk_0", "item_lk_h", "item_lk_1"]
    with pytest.raises(ProtocolError) as err:
        st.on_client({**item("user", "again"), "item": with_id("again", "item_lk_1")})
    assert (err.value.code, err.value.param) == ("item_create_duplicate_item_id", "item.id")
    with pytest.raises(ProtocolError) as err:
        st.on_client({**item("user", "where"), "previous_item_id": "item_nope"})
    assert (err.value.code, err.value.param) == ("item_not_found", "previous_item_id")
    st.on_client({"type": "conversation.item.delete", "item_id": "item_lk_1"})
    assert create("back", item=with_id("back", "item_lk_1"))["item"]["id"] == "item_lk_1"  # LiveKit's edit: re-made


def test_a_long_append_is_turn_detected_as_if_streamed() -> None:
    """A 7 s recording in one append (OpenAI takes events up to 15 MiB): speech, its end, a reply."""
    st = stock()
    clip = np.concatenate([0.3 * np.sin(np.arange(2 * 16_000) * 0.05), np.zeros(5 * 16_000)]).astype(np.float32)
    fx = st.on_client({"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(clip)})
    assert types(fx)[:3] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed"]
    user = st.conversation.items[0]
    assert 2.0 <= len(user.audio) / 16_000 <= 3.5  # the speech and the silence that ended it, not all 7 s
    assert fx.steps[0].kind == "chat"


def test_a_long_duplex_append_is_its_seconds_as_steps_in_order() -> None:
    """The dialect plans every whole second of one long append at once; the shell queues them in order and is the
    one bound on them (tests/test_shell_steps.py)."""
    st, _ = state()
    fx = st.on_client({"type": "input_audio_buffer.append", "audio": pcm(20, loud=False)})
    assert [s.second for s in fx.steps] == list(range(1, 21))
    for step in fx.steps:
        st.prepare(step)
        st.on_step_event(step, StepEvent("listen", metrics={"kv_cache_length": 10}))
        assert st.on_step_end(step).steps == []


def test_the_extensions_are_named_on_the_url() -> None:
    assert Extensions.parse(None) == Extensions() and Extensions.parse("duplex") == Extensions(duplex=True)
    assert Extensions.parse("duplex, events") == ALL
    with pytest.raises(ProtocolError) as err:
        Extensions.parse("duplex,telepathy")
    assert (err.value.code, err.value.close_code) == ("invalid_value", 1008)

"""The backend protocol codec and session state machine: pure code, no sockets."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from export.presets import tiny
from gateway.audio import encode_f32_base64
from gateway.dialects.backend import (
    BackendState,
    InputAppend,
    InputContext,
    loads,
    parse_client_message,
    parse_init,
    voice_refs,
)
from gateway.wire import ProtocolError
from minicpmo_triton.duplex_contract import StepEvent
from minicpmo_triton.media.tokenizer import tiny_special_ids
from minicpmo_triton.rules.duplex_options import DuplexOptions, InvalidOptions
from minicpmo_triton.rules.duplex_rules import ChunkDecoder, forbidden_token_mask, stream_decode
from minicpmo_triton.rules.sampling import SamplingParams

AUDIO = np.linspace(-0.5, 0.5, 16_000, dtype=np.float32)


def msg(data: dict) -> dict:
    return loads(json.dumps(data))


@pytest.mark.parametrize("key", ["audio", "audio_base64", "audio_data"])
def test_input_append_accepts_every_audio_alias(key: str) -> None:
    message = {"type": "input.append", "input": {key: encode_f32_base64(AUDIO), "input_id": 3}}
    parsed = parse_client_message(msg(message))
    assert isinstance(parsed, InputAppend) and parsed.input_id == "3"
    np.testing.assert_array_equal(parsed.audio, AUDIO)


def test_input_append_reads_frames_and_hints() -> None:
    from .test_caller_costs import png

    one, two = png(8, 8), png(4, 4)
    parsed = parse_client_message(msg({"type": "input.append", "input": {
        "audio": {"data": encode_f32_base64(AUDIO)}, "frames": [one, {"data": two}],
        "hints": {"force_listen": True, "max_slice_nums": 2}}}))
    assert parsed.frames == [base64.b64decode(one), base64.b64decode(two)]  # base64-decoded once, here
    assert parsed.force_listen and parsed.max_slice_nums == [2, 2]


@pytest.mark.parametrize(("audio", "fragment"), [
    ("not base64!", "base64"),
    (base64.b64encode(b"12345").decode(), "whole number"),
    (base64.b64encode(np.array([np.nan], np.float32).tobytes()).decode(), "NaN"),
    (encode_f32_base64(np.zeros(16_000 * 6, np.float32)), "at most"),
])
def test_bad_audio_is_a_coded_error(audio: str, fragment: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_message(msg({"type": "input.append", "input": {"audio": audio}}))
    assert info.value.code == "bad_audio" and fragment in info.value.message and info.value.close_code is None


def test_init_reads_aliases_and_defaults() -> None:
    ref = encode_f32_base64(AUDIO)
    init = parse_init(msg({"type": "session.init", "payload": {"instructions": "Be brief.",
                                                               "voice": {"ref_audio": ref}}}))
    assert init.mode == "full_duplex" and init.system_prompt == "Be brief." and init.ref_audio_base64 == ref
    assert list(voice_refs(init)) == ["ref_audio"]


@pytest.mark.parametrize("ref", [encode_f32_base64(AUDIO[:4000]), encode_f32_base64(np.zeros(16_000 * 31, np.float32)),
                                 "QUJD", 7])
def test_voice_references_are_bounded(ref) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_init(msg({"type": "session.init", "payload": {"voice": {"tts_ref_audio": ref}}}))
    assert info.value.code == "invalid_voice" and info.value.close_code == 1008


def test_invalid_json_closes_with_1003() -> None:
    with pytest.raises(ProtocolError) as info:
        loads("{nope")
    assert info.value.code == "invalid_json" and info.value.close_code == 1003


def test_context_via_input_append_is_a_context() -> None:
    parsed = parse_client_message(msg({"type": "input.append", "input": {"input_id": "c", "context": {
        "text": " weather: sunny ", "respond": False}}}))
    assert isinstance(parsed, InputContext) and parsed.text == "weather: sunny" and not parsed.respond


def test_options_validate_types_and_ranges() -> None:
    assert DuplexOptions.from_config({"do_sample": False}).temperature == 0.0
    assert DuplexOptions.from_config({"length_penalty": 1, "unknown_key": 3}).length_penalty == 1.0
    context = DuplexOptions.from_config({"sliding_window_mode": "context", "context_max_units": 8})
    assert (context.sliding_window_mode, context.context_max_units, context.context_previous_max_tokens) == \
        ("context", 8, 500)
    for bad in ({"temperature": "hot"}, {"top_p": 0}, {"max_new_speak_tokens_per_chunk": 0}, {"top_k": True},
                {"sliding_window_mode": "sliding"}, {"context_max_units": 0}, {"context_previous_max_tokens": -1}):
        with pytest.raises(InvalidOptions):
            DuplexOptions.from_config(bad)


def test_session_state_maps_a_spoken_turn() -> None:
    state = BackendState("sess_x")
    usage = {"input_audio_tokens": 10, "output_text_tokens": 2, "output_speech_tokens": 25}
    text = state.delta("in_4", StepEvent("text", text="hi", chunk_usage=usage)).encode()
    audio = state.delta("in_4", StepEvent("audio", audio=AUDIO)).encode()
    listen = state.delta("in_5", StepEvent("listen", end_of_turn=True,
                                           chunk_usage={"input_audio_tokens": 10})).encode()
    assert text["kind"] == "text" and text["response_id"] == audio["response_id"] == listen["response_id"]
    assert text["usage"]["total_tokens"] == 37 and "usage" not in audio
    assert audio["audio_samples"] == 16_000 and audio["sample_rate"] == 24_000
    assert listen["end_of_turn"] and listen["usage"]["input_audio_tokens"] == 20
    nxt = state.delta("in_9", StepEvent("text", text="again")).encode()
    assert nxt["response_id"] != text["response_id"]  # a new turn, a new response id
    assert state.on_close("client_closed", None)[0].encode()["usage"]["total_tokens"] == 47


class _Rules:
    tokens = tiny().tokens

    def decoder(self, turn_ended: bool = True, max_new: int = 20) -> ChunkDecoder:
        return ChunkDecoder(self.tokens, turn_ended, max_new, 28, lambda ids: len([i for i in ids if i < 256]))


def test_rules_listen_before_a_turn_ends_the_chunk() -> None:
    d = _Rules().decoder()
    assert d.accept(_Rules.tokens.listen) is None
    assert d.is_listen and d.pending == [_Rules.tokens.listen, _Rules.tokens.unit_end]


def test_rules_listen_mid_turn_becomes_tts_bos() -> None:
    tk = _Rules.tokens
    d = _Rules().decoder(turn_ended=False)
    assert d.accept(tk.listen) == tk.tts_bos and not d.done


def test_rules_reject_the_token_that_reaches_28_characters() -> None:
    """modeling_minicpmo_unified.py:5078-5092: the crossing token is neither fed nor voiced."""
    d = _Rules().decoder()
    fed = [d.accept(_Rules.tokens.speak)] + [d.accept(65) for _ in range(28)]
    assert fed[-2] == 65 and fed[-1] is None and d.done and len(d.text_ids) == 27 and not d.is_listen
    assert d.pending == [_Rules.tokens.chunk_eos, _Rules.tokens.unit_end] and len(d.generated) == 28


def test_rules_end_with_chunk_eos_on_the_last_step() -> None:
    d = _Rules().decoder(max_new=3)
    d.accept(65)
    d.accept(66)
    assert d.must_end
    d.end_now()
    assert d.pending == [_Rules.tokens.chunk_eos, _Rules.tokens.unit_end] and d.generated == [65, 66]


def test_rules_turn_eos_is_fed_and_the_chunk_goes_on() -> None:
    tk = _Rules().tokens
    d = _Rules().decoder()
    assert d.accept(tk.speak) == tk.speak and d.turn_start
    assert d.accept(65) == 65
    assert d.accept(tk.turn_eos) == tk.turn_eos and d.end_of_turn and d.turn_ended and not d.done
    assert d.accept(tk.listen) is None and d.is_listen and d.text_ids == []  # a listened chunk is not voiced
    assert d.pending == [tk.listen, tk.unit_end]


def test_rules_forced_listen_closes_an_open_turn() -> None:
    tk = _Rules.tokens
    d = _Rules().decoder(turn_ended=False)
    d.force_listen()
    assert d.pending == [tk.turn_eos, tk.listen, tk.unit_end] and d.end_of_turn and d.turn_ended


def test_rules_first_draw_decides_chunk_eos_and_the_penalty_divides() -> None:
    """utils.py StreamDecoder.decode: greedy argmax of the raw logits ends the chunk when it is <|chunk_eos|>;
    else the repetition penalty divides a logit whatever its sign, then the length penalty acts on <|turn_eos|>."""
    tk = _Rules.tokens
    forbidden = forbidden_token_mask(288, tk, [0])
    greedy = SamplingParams(0.0, 20, 0.8, 2.0)
    logits = np.full(288, -5.0, np.float32)
    logits[tk.chunk_eos] = 1.0
    history: list[int] = []
    assert stream_decode(logits, forbidden, history, greedy, 1.0, tk, np.random.default_rng(0)) == tk.chunk_eos
    assert history == []  # the first draw is not recorded
    logits[tk.chunk_eos], logits[65], logits[66] = -10.0, -1.0, -0.8
    history = [65]
    # 65 is penalised: -1 / 2 = -0.5, above 66's -0.8 (a sign-aware penalty would make it -2 and pick 66)
    assert stream_decode(logits, forbidden, history, greedy, 1.0, tk, np.random.default_rng(0)) == 65
    assert history == [65, 65]


def test_tiny_special_ids_follow_the_byte_range() -> None:
    ids = tiny_special_ids()
    assert min(ids.values()) == 256 and ids["<|listen|>"] == tiny().tokens.listen

"""One bad row fails alone: in every batched stage, a hostile row gets a coded error and every other row of its
batch gets exactly what it gets without it (the stages in process, on the exported tiny model)."""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from minicpmo_triton.engine.exported import load_engine
from minicpmo_triton.errors import StepError, from_wire, to_wire
from minicpmo_triton.media.pcm import MAX_SAMPLE_ABS, pcm_problem
from minicpmo_triton.media.tokenizer import load_tokenizer
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.rules.duplex_options import DuplexOptions, InvalidOptions
from minicpmo_triton.rules.sampling import SamplingParams, sample
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import StepEvent, StepInput
from minicpmo_triton.stage_io import (
    AudioEncoderRequest,
    LlmRequest,
    Token2WavRequest,
    TtsRequest,
    VisionEncoderRequest,
)
from minicpmo_triton.stages.audio_encoder import AudioEncoderStage, AudioStreamEncoder
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.llm import LlmStage
from minicpmo_triton.stages.state_store import SequenceNotStarted
from minicpmo_triton.stages.token2wav import Token2WavStage
from minicpmo_triton.stages.tts import TtsStage
from minicpmo_triton.stages.vision_encoder import VisionEncoderStage

from .conftest import MODEL_REPOSITORY, ensure_exported
from .helpers import OTHER_TEXT

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def preset():
    ensure_exported()
    return load_stage_config(MODEL_REPOSITORY / "llm" / "1")


def engine(name: str) -> Any:
    return load_engine(MODEL_REPOSITORY / name / "1")


class PoisonedEngine:
    """The real engine, except that a row whose `feed` holds `marker` breaks: its `output` becomes NaN
    (`nan`), or the whole forward raises (`raise`), as a forward that one row's values overflow would."""

    def __init__(self, inner: Any, feed: str, marker: float, output: str = "", mode: str = "nan") -> None:
        self.inner, self.feed, self.marker, self.output, self.mode = inner, feed, marker, output, mode

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = feeds[self.feed]
        bad = [row for row in range(len(values)) if (values[row] == self.marker).any()]
        if bad and self.mode == "raise":
            raise RuntimeError("the forward failed")
        out = dict(self.inner.run(feeds))
        if bad:
            out[self.output] = out[self.output].copy()
            out[self.output][bad] = np.nan
        return out


# ---- the LLM ----

# Marks the poisoned row: a byte the duplex decoder never draws (one of tiny's bad ids; control tokens such as
# <|audio_start|> it may draw, as MiniCPM-o's loop may), so only a prefill that carries it is poisoned.
POISON_MARK = 1


def llm_stage(preset, poison: bool = False) -> LlmStage:
    eng = engine("llm")
    if poison:
        eng = PoisonedEngine(eng, "input_ids", POISON_MARK, "logits")
    encoder = AudioStreamEncoder(load_engine(MODEL_REPOSITORY / "audio_encoder" / "1", name="stream"), preset.audio,
                                 preset.samples_per_audio_token)
    return LlmStage(eng, preset, load_tokenizer(preset, MODEL_REPOSITORY / "duplex" / "1"), 600.0, encoder)


def chunk(preset, corr: int, step: int, **settings: Any) -> LlmRequest:
    """One second of a session: <unit> and its audio, with that session's own settings."""
    tk = preset.tokens
    audio = (np.random.default_rng(corr * 1000 + step).standard_normal(16_000) * 0.1).astype(np.float32)
    return LlmRequest(input_ids=np.array([tk.unit] + [tk.audio_placeholder] * 10, np.int64), audio=audio,
                      seed=corr, **settings)


# Clean sessions: greedy, the defaults (sampled), greedy with a short chunk.
CLEAN: dict[int, dict[str, Any]] = {101: {"temperature": 0.0}, 102: {}, 103: {"temperature": 0.0, "max_new_tokens": 8}}
HOSTILE = 999


def _scaled_audio(scale: float) -> Callable[[LlmRequest], LlmRequest]:
    return lambda r: dataclasses.replace(r, audio=r.audio * np.float32(scale))


def _nan_audio(r: LlmRequest) -> LlmRequest:
    audio = r.audio.copy()
    audio[100] = np.nan
    return dataclasses.replace(r, audio=audio)


def _nan_embeds(preset) -> Callable[[LlmRequest], LlmRequest]:
    def make(r: LlmRequest) -> LlmRequest:
        ids = np.concatenate([[preset.tokens.audio_placeholder], r.input_ids])
        return dataclasses.replace(r, input_ids=ids, embeds=np.full((1, preset.llm.hidden), np.nan, np.float32))
    return make


def _settings(**kw: Any) -> Callable[[LlmRequest], LlmRequest]:
    return lambda r: dataclasses.replace(r, **kw)


# name -> (how the hostile row differs from a clean one, its code); the cases that once got through come first.
LLM_HOSTILE: dict[str, tuple[Callable[[Any], Callable[[LlmRequest], LlmRequest]], str]] = {
    "nan_temperature": (lambda p: _settings(temperature=NAN), "invalid_config"),
    "temperature_overflowing_float32": (lambda p: _settings(temperature=1e39), "invalid_config"),
    "inf_temperature": (lambda p: _settings(temperature=INF), "invalid_config"),
    "repetition_penalty_0": (lambda p: _settings(repetition_penalty=0.0), "invalid_config"),
    "negative_length_penalty": (lambda p: _settings(length_penalty=-1.0), "invalid_config"),
    "enormous_audio_default_settings": (lambda p: _scaled_audio(1e30), "bad_audio"),
    "audio_just_over_the_bound": (lambda p: _scaled_audio(30.0), "bad_audio"),
    "nan_audio": (lambda p: _nan_audio, "bad_audio"),
    "nan_embeddings": (_nan_embeds, "invalid_input"),
    "top_p_0": (lambda p: _settings(top_p=0.0), "invalid_config"),
    "negative_top_k": (lambda p: _settings(top_k=-1), "invalid_config"),
    "negative_seed": (lambda p: _settings(seed=-5), "invalid_config"),
}


def _llm_out(res: Any) -> tuple:
    return (res.generated.tolist(), res.text_ids.tolist(), res.kv_length, res.is_listen, res.end_of_turn)


def run_llm(stage: LlmStage, preset, steps: int, groups: Callable[[int], list[list[int]]],
            hostile: Callable[[LlmRequest], LlmRequest] | None = None) -> dict[int, list[Any]]:
    """Each step, the sessions in `groups(step)` run batch by batch; the hostile session's row is made by `hostile`."""
    out: dict[int, list[Any]] = {}
    for step in range(steps):
        for group in groups(step):
            calls = []
            for corr in group:
                req = chunk(preset, corr, step, **CLEAN.get(corr, {}))
                calls.append(StageCall(hostile(req) if hostile and corr == HOSTILE else req, corr, start=step == 0))
            for call, res in zip(calls, stage.run(calls), strict=True):
                out.setdefault(call.corr_id, []).append(res)
    return out


def assert_same(a: Any, b: Any, bitwise: bool) -> None:
    assert _llm_out(a) == _llm_out(b)
    if bitwise:
        np.testing.assert_array_equal(a.tts_hidden, b.tts_hidden)


@pytest.mark.parametrize("case", list(LLM_HOSTILE))
def test_a_hostile_llm_row_fails_alone(preset, case: str) -> None:
    """Batched with a hostile row, each clean session's output is bit for bit that of the same batch without it,
    and (greedy sessions) token for token what the session gives alone; the hostile row gets its code."""
    make, code = LLM_HOSTILE[case]
    clean, steps = list(CLEAN), 3
    with_hostile = run_llm(llm_stage(preset), preset, steps, lambda s: [[*clean[:2], HOSTILE, *clean[2:]]],
                           make(preset))
    without = run_llm(llm_stage(preset), preset, steps, lambda s: [clean])
    alone = run_llm(llm_stage(preset), preset, steps, lambda s: [[c] for c in clean])
    for step, res in enumerate(with_hostile[HOSTILE]):
        if case == "negative_seed" and step > 0:  # a refused START started nothing
            assert isinstance(res, SequenceNotStarted), res
        else:
            assert isinstance(res, StepError) and res.code == code, res
    for corr in clean:
        for res, ref, solo in zip(with_hostile[corr], without[corr], alone[corr], strict=True):
            assert not isinstance(res, Exception), res
            assert_same(res, ref, bitwise=True)
            if CLEAN[corr].get("temperature") == 0.0:
                assert_same(res, solo, bitwise=False)  # padding changes only float rounding
    spoke = [len(r.generated) for c in clean for r in with_hostile[c]]
    assert max(spoke) > 0, "the clean sessions decode (else this test proves little)"


def test_a_row_that_breaks_the_batched_forward_fails_alone_and_leaves_no_trace(preset) -> None:
    """A row whose forward goes NaN (past every check) fails the batch; each row then runs again alone from
    its state before the batch: the clean rows get exactly their solo output, the broken one `numeric_error`
    and its state as it was, so its next clean step is what it would have been without the broken one."""
    poisoned, alone = llm_stage(preset, poison=True), llm_stage(preset)
    clean = list(CLEAN)

    def poison(r: LlmRequest) -> LlmRequest:
        ids = np.concatenate([[POISON_MARK], r.input_ids])  # the marker the poisoned engine breaks on
        return dataclasses.replace(r, input_ids=ids)

    sessions = [*clean, HOSTILE]
    # step 0 for everyone (clean, batched); step 1 the hostile row is poisoned; step 2 everyone clean again
    first = run_llm(poisoned, preset, 1, lambda s: [sessions])
    before = dataclasses.replace(poisoned.store.get(HOSTILE))
    history, rng_state = list(before.history), before.rng.bit_generator.state
    calls = [StageCall(poison(chunk(preset, c, 1)) if c == HOSTILE else chunk(preset, c, 1, **CLEAN[c]), c)
             for c in sessions]
    results = dict(zip(sessions, poisoned.run(calls), strict=True))
    assert isinstance(results[HOSTILE], StepError) and results[HOSTILE].code == "numeric_error"
    after = poisoned.store.get(HOSTILE)
    assert after.cache is before.cache and after.history == history and after.pending == before.pending
    assert after.rng.bit_generator.state == rng_state

    # The reference: every session alone, the hostile one without its poisoned step.
    solo = run_llm(alone, preset, 1, lambda s: [[c] for c in sessions])
    solo_step1 = {c: alone.run([StageCall(chunk(preset, c, 1, **CLEAN[c]), c)])[0] for c in clean}
    for c in clean:
        assert_same(results[c], solo_step1[c], bitwise=True)  # run alone after the batch failed: exactly alone
    for c in sessions:
        assert_same(first[c][0], solo[c][0], bitwise=False)
    [again] = poisoned.run([StageCall(chunk(preset, HOSTILE, 2), HOSTILE)])
    [ref] = alone.run([StageCall(chunk(preset, HOSTILE, 2), HOSTILE)])
    assert_same(again, ref, bitwise=True)


# ---- the TTS ----

def tts_request(preset, n: int, **kw: Any) -> TtsRequest:
    h = np.random.default_rng(n).standard_normal((n, preset.llm.hidden)).astype(np.float32)
    return TtsRequest(text_ids=np.arange(40, 40 + n), tts_hidden=h, turn_start=True, seed=n, **kw)


TTS_HOSTILE: dict[str, tuple[Callable[[TtsRequest], TtsRequest], str]] = {
    "nan_temperature": (lambda r: dataclasses.replace(r, temperature=NAN), "invalid_config"),
    "temperature_overflowing_float32": (lambda r: dataclasses.replace(r, temperature=1e39), "invalid_config"),
    "nan_hidden": (lambda r: dataclasses.replace(r, tts_hidden=r.tts_hidden * np.float32(np.nan)), "invalid_input"),
    "text_id_out_of_vocabulary": (lambda r: dataclasses.replace(r, text_ids=r.text_ids + 10**9), "invalid_input"),
    "a_billion_tokens": (lambda r: dataclasses.replace(r, n_tokens=10**9), "invalid_input"),
    "the_forward_goes_nan": (lambda r: dataclasses.replace(r, text_ids=np.full_like(r.text_ids, 7)), "numeric_error"),
}


@pytest.mark.parametrize("case", list(TTS_HOSTILE))
def test_a_hostile_tts_row_fails_alone(preset, case: str) -> None:
    """As for the LLM; a row whose forward goes NaN fails the batch, so then every row runs alone."""
    make, code = TTS_HOSTILE[case]
    eng = PoisonedEngine(engine("tts"), "text_ids", 7, "logits")  # text id 7 marks a row whose forward breaks
    clean = {2: {"temperature": 0.0}, 5: {}, 9: {"temperature": 0.0}}
    hostile = 0

    def run(rows: list[int], steps: int = 2) -> dict[int, list[Any]]:
        stage, out = TtsStage(eng, preset, 600), {}
        for step in range(steps):
            calls = []
            for n in rows:
                req = dataclasses.replace(tts_request(preset, n or 3, **clean.get(n, {})), turn_start=step == 0)
                calls.append(StageCall(make(req) if n == hostile else req, n, start=step == 0))
            for call, res in zip(calls, stage.run(calls), strict=True):
                out.setdefault(call.corr_id, []).append(res)
        return out

    with_hostile, without = run([2, hostile, 5, 9]), run(list(clean))
    alone = {n: run([n])[n] for n in clean}
    for res in with_hostile[hostile]:
        assert isinstance(res, StepError) and res.code == code, res
    for n in clean:
        # Refused by its check, the hostile row leaves the batch as it would have been; failing in the
        # forward, it makes every row run alone.
        expected = alone[n] if code == "numeric_error" else without[n]
        for res, ref, solo in zip(with_hostile[n], expected, alone[n], strict=True):
            assert not isinstance(res, Exception), res
            assert res.speech_tokens.tolist() == ref.speech_tokens.tolist() and res.kv_length == ref.kv_length
            if clean[n].get("temperature") == 0.0:
                assert res.speech_tokens.tolist() == solo.speech_tokens.tolist()
            assert len(res.speech_tokens) == 25


# ---- token2wav ----

POISON_TOKEN = 6000  # clean rows draw their tokens below it; a row of it breaks the forward

T2W_HOSTILE: dict[str, tuple[Callable[[Token2WavRequest], Token2WavRequest], str]] = {
    "token_out_of_vocabulary": (lambda r: dataclasses.replace(r, speech_tokens=r.speech_tokens + 10**6),
                                "invalid_input"),
    "negative_token": (lambda r: dataclasses.replace(r, speech_tokens=-r.speech_tokens - 1), "invalid_input"),
    "nan_voice": (lambda r: dataclasses.replace(r, voice=np.full(16_000, np.nan, np.float32)), "invalid_voice"),
    # past every check, a forward that fails for the whole batch (the conformer sees the poison token)
    "the_forward_fails": (lambda r: dataclasses.replace(r, speech_tokens=np.full_like(r.speech_tokens, POISON_TOKEN)),
                          "stage_error"),
}


@pytest.mark.parametrize("case", list(T2W_HOSTILE))
def test_a_hostile_token2wav_row_fails_alone(preset, case: str) -> None:
    make, code = T2W_HOSTILE[case]
    hostile, clean = 0, [1, 2, 3]

    def run(rows: list[int]) -> tuple[dict[int, list[Any]], Token2WavStage]:
        stage, out = Token2WavStage.load(MODEL_REPOSITORY / "token2wav" / "1", preset, 600), {}
        stage.streamer.enc = PoisonedEngine(stage.streamer.enc, "tokens", POISON_TOKEN, mode="raise")
        for step in range(3):
            calls = []
            for n in rows:
                tokens = np.random.default_rng(n * 10 + step).integers(0, POISON_TOKEN, 25)
                req = Token2WavRequest(speech_tokens=tokens, turn_start=step == 0, finalize=step == 2)
                calls.append(StageCall(make(req) if n == hostile else req, n, start=step == 0))
            for call, res in zip(calls, stage.run(calls), strict=True):
                out.setdefault(call.corr_id, []).append(res)
        return out, stage

    with_hostile, _ = run([1, hostile, 2, 3])
    if case == "the_forward_fails":  # the batch failed: each clean row ran again alone
        alone = {n: run([n])[0][n] for n in clean}
    else:  # refused before the batch: the clean rows ran together, as without it
        alone = run(clean)[0]
    for res in with_hostile[hostile]:
        err = res if isinstance(res, StepError) else from_wire(to_wire(res), "token2wav")  # as the caller reads it
        assert err.code == code, res
    for n in clean:
        for res, ref in zip(with_hostile[n], alone[n], strict=True):
            assert not isinstance(res, Exception), res
            np.testing.assert_array_equal(res.waveform, ref.waveform)  # every row's own forward: bit for bit
        assert sum(len(r.waveform) for r in with_hostile[n]) > 0


# ---- the stateless encoders ----

def test_hostile_audio_fails_alone_in_the_audio_encoder(preset) -> None:
    stage = AudioEncoderStage(engine("audio_encoder"), preset.samples_per_audio_token)
    rng = np.random.default_rng(0)
    clean = [(rng.standard_normal(16_000) * 0.1).astype(np.float32) for _ in range(3)]
    hostile = [clean[0] * np.float32(1e30), np.full(16_000, np.inf, np.float32), clean[1] * np.float32(np.nan),
               np.full(16_000, MAX_SAMPLE_ABS * 1.01, np.float32)]
    mixed = stage.run([AudioEncoderRequest(a) for a in [clean[0], *hostile[:2], clean[1], *hostile[2:], clean[2]]])
    ref = stage.run([AudioEncoderRequest(a) for a in clean])
    assert [r.code for r in mixed if isinstance(r, StepError)] == ["bad_audio"] * 4
    got = [r for r in mixed if not isinstance(r, Exception)]
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a.embeds, b.embeds)
    assert stage.run([AudioEncoderRequest(np.full(16_000, MAX_SAMPLE_ABS, np.float32))])[0].embeds.shape[0] == 10


def _png(gray: int, size: tuple[int, int] = (300, 200)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (gray, gray, gray)).save(out, "PNG")
    return out.getvalue()


def test_a_forward_failure_in_the_vision_encoder_fails_its_request_alone(preset) -> None:
    """A black image (pixels of -1.0) marks the request whose forward breaks the batch; a bad image is refused."""
    stage = VisionEncoderStage(PoisonedEngine(engine("vision_encoder"), "pixels", -1.0, mode="raise"), preset.vision)

    def req(*images: bytes) -> VisionEncoderRequest:
        return VisionEncoderRequest(images=np.array(images, dtype=np.object_))

    clean = [req(_png(128)), req(_png(200), _png(60, (900, 300)))]
    mixed = stage.run([clean[0], req(_png(0)), req(b"not an image"), clean[1]])
    assert isinstance(mixed[1], RuntimeError)
    assert isinstance(mixed[2], StepError) and mixed[2].code == "bad_image"
    # the batch failed, so each request ran again alone: bit for bit what it gets alone
    for got, ref in zip([mixed[0], mixed[3]], [stage.run([c])[0] for c in clean], strict=True):
        np.testing.assert_array_equal(got.embeds, ref.embeds)
        assert got.slices.tolist() == ref.slices.tolist()


# ---- sampling ----

@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams()])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_sampling_refuses_non_finite_logits(params: SamplingParams, poison: float) -> None:
    """Greedy argmax would pick a NaN's index and sampling would crash: both are this row's coded error."""
    logits = np.linspace(-1, 1, 50).astype(np.float32)
    logits[7] = poison
    with pytest.raises(StepError) as info:
        sample(logits, params, np.random.default_rng(0))
    assert info.value.code == "numeric_error"


def test_sampling_refuses_logits_with_nothing_allowed() -> None:
    with pytest.raises(StepError, match="not finite"):
        sample(np.full(50, -np.inf, np.float32), SamplingParams(), np.random.default_rng(0))


def test_sampling_only_picks_allowed_tokens_around_masked_ones() -> None:
    logits = np.full(50, -np.inf, np.float32)
    logits[[3, 9, 40]] = [1.0, 2.0, 0.5]
    rng = np.random.default_rng(0)
    picks = {sample(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0), rng) for _ in range(200)}
    assert picks == {3, 9, 40}
    assert sample(logits, SamplingParams(temperature=0.0), rng) == 9


# ---- settings at session init ----

OPTION_CASES: list[tuple[dict[str, Any], bool]] = [
    # (config, accepted)
    ({}, True),
    ({"temperature": 0}, True), ({"temperature": 0.0}, True), ({"temperature": 1e-6}, True),
    ({"temperature": 10}, True),
    ({"temperature": NAN}, False), ({"temperature": INF}, False), ({"temperature": -INF}, False),
    ({"temperature": 1e39}, False), ({"temperature": 10.5}, False), ({"temperature": -0.1}, False),
    ({"temperature": 1e-45}, False), ({"temperature": 10**400}, False), ({"temperature": "hot"}, False),
    ({"tts_temperature": 0}, True), ({"tts_temperature": 10}, True), ({"tts_temperature": NAN}, False),
    ({"tts_temperature": 1e39}, False), ({"tts_temperature": -1}, False),
    ({"top_p": 1}, True), ({"top_p": 1e-9}, True), ({"top_p": 0}, False), ({"top_p": 1.01}, False),
    ({"top_p": NAN}, False), ({"top_p": -0.5}, False),
    ({"top_k": 0}, True), ({"top_k": 1_000_000}, True), ({"top_k": 1_000_001}, False), ({"top_k": 10**20}, False),
    ({"top_k": -1}, False), ({"top_k": 2.5}, False), ({"top_k": True}, False),
    ({"repetition_penalty": 1}, True), ({"repetition_penalty": 10}, True), ({"repetition_penalty": 0}, False),
    ({"repetition_penalty": -1.05}, False), ({"repetition_penalty": NAN}, False), ({"repetition_penalty": INF}, False),
    ({"repetition_penalty": 10.01}, False),
    ({"length_penalty": 0.5}, True), ({"length_penalty": 10}, True), ({"length_penalty": -1}, False),
    ({"length_penalty": 0}, False), ({"length_penalty": NAN}, False), ({"length_penalty": 1e39}, False),
    ({"seed": 0}, True), ({"seed": 2**63 - 1}, True), ({"seed": 2**63}, False), ({"seed": -1}, False),
    ({"seed": 1.5}, False),
    ({"max_new_speak_tokens_per_chunk": 1}, True), ({"max_new_speak_tokens_per_chunk": 256}, True),
    ({"max_new_speak_tokens_per_chunk": 0}, False), ({"max_new_speak_tokens_per_chunk": 257}, False),
    ({"max_new_speak_tokens_per_chunk": 10**20}, False),
    ({"force_listen_count": 0}, True), ({"force_listen_count": 3600}, True), ({"force_listen_count": 3601}, False),
    ({"force_listen_count": -1}, False), ({"force_listen_count": 10**20}, False),
    ({"do_sample": False, "top_k": 10**20}, False),
]


@pytest.mark.parametrize(("config", "accepted"), OPTION_CASES, ids=[repr(c)[:60] for c, _ in OPTION_CASES])
def test_session_settings_are_range_checked(config: dict[str, Any], accepted: bool) -> None:
    if accepted:
        options = DuplexOptions.from_config(config)
        for key, value in config.items():
            assert getattr(options, key) == value
        return
    with pytest.raises(InvalidOptions) as info:
        DuplexOptions.from_config(config)
    assert any(f"config.{key}" in str(info.value) for key in config)


def test_accepted_settings_pass_every_stage_check(preset) -> None:
    """The init's ranges are the stages' ranges: a session accepted at init is never refused by a stage."""
    extreme = DuplexOptions.from_config({"temperature": 10, "top_k": 1_000_000, "top_p": 1e-9, "seed": 2**63 - 1,
                                         "repetition_penalty": 10, "length_penalty": 10, "tts_temperature": 1e-6})
    llm = llm_stage(preset)
    req = dataclasses.replace(chunk(preset, 1, 0), temperature=extreme.temperature, top_k=extreme.top_k,
                              top_p=extreme.top_p, repetition_penalty=extreme.repetition_penalty,
                              length_penalty=extreme.length_penalty, seed=extreme.seed)
    [res] = llm.run([StageCall(req, 1, start=True)])
    assert not isinstance(res, Exception), res
    tts = TtsStage(engine("tts"), preset, 600)
    [res] = tts.run([StageCall(tts_request(preset, 3, temperature=extreme.tts_temperature), 1, start=True)])
    assert not isinstance(res, Exception), res


# ---- the error's way out and the audio bound ----

def test_a_coded_error_keeps_its_code_through_a_triton_error_message() -> None:
    err = from_wire(to_wire(StepError("bad_audio", "llm: audio samples must lie within +-2.0\nsecond line")), "llm")
    assert err.code == "bad_audio" and str(err) == "llm: llm: audio samples must lie within +-2.0\nsecond line"
    plain = from_wire(to_wire(RuntimeError("onnxruntime failed")), "tts")
    assert plain.code == "stage_error" and str(plain) == "tts: RuntimeError: onnxruntime failed"


@pytest.mark.parametrize(("values", "problem"), [
    ([0.0, 1.0, -1.0, MAX_SAMPLE_ABS, -MAX_SAMPLE_ABS], None),
    ([], None),
    ([0.0, MAX_SAMPLE_ABS * 1.001], "within"),
    ([1e30], "within"),
    ([-3.4e38], "within"),
    ([0.0, math.nan], "NaN"),
    ([math.inf], "NaN"),
])
def test_pcm_bound(values: list[float], problem: str | None) -> None:
    found = pcm_problem(np.array(values, np.float32))
    assert (found is None) if problem is None else (problem in found)


# ---- the pipeline after a refused step ----

async def test_a_refused_first_step_leaves_the_session_as_new(preset, speech) -> None:
    """The entry model's pipeline, in process: a first step the LLM refuses (enormous audio) starts nothing,
    so the session's next step is exactly a fresh session's first (system prompt, START and all)."""
    stages = InProcessStages(MODEL_REPOSITORY)
    pipeline = stages.pipeline()
    second = speech(OTHER_TEXT)[:16_000]
    options = DuplexOptions.from_config({"do_sample": False, "force_listen_count": 0})

    async def step(corr: int, start: bool, audio: np.ndarray) -> list[StepEvent]:
        events: list[StepEvent] = []

        async def emit(ev: StepEvent) -> None:
            events.append(ev)

        await pipeline.step(corr, start, False, StepInput(audio=audio, options=options if start else None), emit)
        return events

    with pytest.raises(StepError) as info:
        await step(1, True, second * np.float32(1e30))
    assert info.value.code == "bad_audio"
    after = await step(1, False, second)
    fresh = await step(2, True, second)
    strip = lambda evs: [(e.kind, e.text, e.metrics.kv_cache_length, e.chunk_usage) for e in evs]  # noqa: E731 (a one-line helper)
    assert strip(after) == strip(fresh) and after[-1].metrics.kv_cache_length > 20

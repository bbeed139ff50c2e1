"""The stage code on the exported tiny model, without Triton: batching, streaming, state lifetimes."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from minicpmo_triton.engine.exported import load_engine
from minicpmo_triton.engine.kv_batch import KvBatch, KvCache
from minicpmo_triton.media.tokenizer import ByteTokenizer
from minicpmo_triton.model_config import SAMPLES_PER_SPEECH_TOKEN, load_stage_config
from minicpmo_triton.stage_io import (
    STAGE_INPUTS,
    STAGE_OUTPUTS,
    LlmRequest,
    Token2WavRequest,
    TtsRequest,
    audio_key,
    triton_dims,
    triton_dtype,
)
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.llm import ContextFull, LlmStage
from minicpmo_triton.stages.state_store import SequenceNotStarted, SequenceStore
from minicpmo_triton.stages.token2wav import Token2WavStage
from minicpmo_triton.stages.tts import TtsStage

from .conftest import MODEL_REPOSITORY, ensure_exported


@pytest.fixture(scope="module")
def preset():
    ensure_exported()
    return load_stage_config(MODEL_REPOSITORY / "llm" / "1")


def llm_stage(preset, ttl_s: float = 600.0) -> LlmStage:
    return LlmStage(load_engine(MODEL_REPOSITORY / "llm" / "1"), preset, ByteTokenizer(), ttl_s)


def chunk_request(preset, rng: np.random.Generator, **kw) -> LlmRequest:
    tk = preset.tokens
    ids = np.array([tk.unit] + [tk.audio_placeholder] * 10, np.int64)
    return LlmRequest(input_ids=ids, embeds=rng.standard_normal((10, preset.llm.hidden)).astype(np.float32) * 0.2,
                      temperature=0.0, **kw)


def run_steps(stage: LlmStage, preset, corr_ids: list[int], steps: int, batched: bool) -> dict[int, list]:
    rngs = {c: np.random.default_rng(c) for c in corr_ids}
    out: dict[int, list] = {c: [] for c in corr_ids}
    for step in range(steps):
        calls = [StageCall(chunk_request(preset, rngs[c]), c, start=step == 0) for c in corr_ids]
        groups = [calls] if batched else [[c] for c in calls]
        for group in groups:
            for call, res in zip(group, stage.run(group), strict=True):
                assert not isinstance(res, Exception), res
                out[call.corr_id].append((res.generated.tolist(), res.kv_length, res.tts_hidden))
    return out


def test_batched_and_unbatched_llm_steps_agree(preset) -> None:
    """Sessions with different histories in one forward give what each gives alone (greedy)."""
    ids = [11, 12, 13]
    alone = run_steps(llm_stage(preset), preset, ids, steps=5, batched=False)
    together = run_steps(llm_stage(preset), preset, ids, steps=5, batched=True)
    tokens = lambda runs: {c: [(g, n) for g, n, _ in steps] for c, steps in runs.items()}  # noqa: E731 (a one-line helper)
    assert tokens(together) == tokens(alone)
    for c in ids:
        for (_, _, h_alone), (_, _, h_together) in zip(alone[c], together[c], strict=True):
            np.testing.assert_allclose(h_together, h_alone, atol=1e-4)  # padding changes only float rounding
    assert len({str(v) for v in tokens(alone).values()}) == 3, "different inputs should give different outputs"


def test_llm_state_lives_from_start_to_end(preset) -> None:
    stage = llm_stage(preset)
    rng = np.random.default_rng(0)
    [res] = stage.run([StageCall(chunk_request(preset, rng), 5)])
    assert isinstance(res, SequenceNotStarted)  # no START: no state
    stage.run([StageCall(chunk_request(preset, rng), 5, start=True)])
    assert stage.live_sequences == 1
    stage.run([StageCall(LlmRequest(decode=False), 5, end=True)])
    assert stage.live_sequences == 0


def test_force_listen_skips_decoding(preset) -> None:
    stage = llm_stage(preset)
    [res] = stage.run([StageCall(chunk_request(preset, np.random.default_rng(1), force_listen=True), 1, start=True)])
    assert res.is_listen and res.generated.tolist() == [preset.tokens.listen] and res.kv_length == 11


def test_a_mismatched_prefill_fails_only_its_own_request(preset) -> None:
    stage = llm_stage(preset)
    rng = np.random.default_rng(2)
    bad = dataclasses.replace(chunk_request(preset, rng), embeds=np.zeros((3, preset.llm.hidden), np.float32))
    good, broken = stage.run([StageCall(chunk_request(preset, rng), 1, start=True), StageCall(bad, 2, start=True)])
    assert not isinstance(good, Exception)
    assert isinstance(broken, ValueError) and "placeholders" in str(broken)


def test_context_full_is_reported(preset) -> None:
    small = dataclasses.replace(preset, duplex=dataclasses.replace(preset.duplex, context_tokens=40))
    stage = llm_stage(small)
    rng = np.random.default_rng(3)
    results = [stage.run([StageCall(chunk_request(small, rng), 1, start=i == 0)])[0] for i in range(3)]
    assert isinstance(results[-1], ContextFull)


def test_state_is_evicted_after_the_idle_ttl() -> None:
    now = [0.0]
    store: SequenceStore[str] = SequenceStore(ttl_s=10, clock=lambda: now[0])
    store.start(1, "a")
    store.start(2, "b")
    now[0] = 6
    store.get(2)  # touching keeps a sequence alive
    now[0] = 12
    assert store.evict_expired() == [1]
    assert 1 not in store and 2 in store and store.evicted_total == 1
    with pytest.raises(SequenceNotStarted):
        store.get(1)


def test_kv_batch_round_trips_ragged_caches() -> None:
    rng = np.random.default_rng(0)
    caches = [KvCache(rng.standard_normal((2, 2, n, 4)).astype(np.float32),
                      rng.standard_normal((2, 2, n, 4)).astype(np.float32)) for n in (0, 3, 5)]
    batch = KvBatch(caches)
    assert batch.key.shape == (2, 3, 2, 5, 4)
    assert batch.mask.sum(axis=1).tolist() == [0, 3, 5]
    for row, cache in enumerate(caches):
        np.testing.assert_array_equal(batch.extract(row).key, cache.key)


TURN_LEAD_SILENCE = 3


def test_token2wav_stage_streams_one_second_chunks_and_shares_voice_prompts(preset) -> None:
    """1 s per 25 tokens (the lead silence included), the rest at the turn's end; a voice is set up once."""
    stage = Token2WavStage.load(MODEL_REPOSITORY / "token2wav" / "1", preset, 600)
    tokens = np.random.default_rng(0).integers(0, 6000, 80)
    voice = 0.1 * np.random.default_rng(1).standard_normal(16_000).astype(np.float32)  # 1 s reference
    pieces = []
    for i, chunk in enumerate(np.split(tokens[:75], 3)):
        [res] = stage.run([StageCall(Token2WavRequest(speech_tokens=chunk, turn_start=i == 0, voice=voice), 1,
                                     start=i == 0)])
        pieces.append(res.waveform)
    [tail] = stage.run([StageCall(Token2WavRequest(speech_tokens=tokens[75:], finalize=True), 1)])
    assert [len(p) for p in pieces] == [24_000] * 3  # exactly 1 s per chunk, the lead silence included
    assert len(tail.waveform) == (len(tokens) + TURN_LEAD_SILENCE - 75) * SAMPLES_PER_SPEECH_TOKEN + 3840
    assert np.isfinite(np.concatenate(pieces)).all()
    assert (stage.prompts.computed, stage.prompts.reused) == (1, 0)
    # a second session with the same voice reuses the prompt; another voice (the default) sets up its own
    stage.run([StageCall(Token2WavRequest(speech_tokens=tokens[:25], turn_start=True, voice=voice), 2, start=True),
               StageCall(Token2WavRequest(speech_tokens=tokens[:25], turn_start=True), 3, start=True)])
    assert (stage.prompts.computed, stage.prompts.reused) == (2, 1)
    assert stage.state_bytes(2) > 0


def test_tts_gives_25_tokens_per_chunk_and_batches(preset) -> None:
    engine = load_engine(MODEL_REPOSITORY / "tts" / "1")
    h = preset.llm.hidden

    def req(n: int, start: bool) -> TtsRequest:
        rng = np.random.default_rng(n)
        return TtsRequest(text_ids=np.arange(40, 40 + n), tts_hidden=rng.standard_normal((n, h)).astype(np.float32),
                          turn_start=start, temperature=0.0)

    alone = [TtsStage(engine, preset, 600).run([StageCall(req(n, True), n, start=True)])[0] for n in (2, 5)]
    together = TtsStage(engine, preset, 600).run([StageCall(req(n, True), n, start=True) for n in (2, 5)])
    for a, b in zip(alone, together, strict=True):
        assert len(a.speech_tokens) == 25
        assert a.speech_tokens.tolist() == b.speech_tokens.tolist()
        assert (a.speech_tokens < preset.tts.num_audio_tokens - 1).all()  # no EOS mid-turn


def test_a_tts_turn_never_runs_past_the_position_table(preset) -> None:
    """A turn the caller keeps open (forced listens never end it) starts its cache over before the TTS's
    positions run out, the chunk then decided as a turn's first: the same codes as a fresh turn."""
    engine = load_engine(MODEL_REPOSITORY / "tts" / "1")
    h = preset.llm.hidden
    small = dataclasses.replace(preset, tts=dataclasses.replace(preset.tts, max_positions=100))
    stage, fresh = TtsStage(engine, small, 600), TtsStage(engine, small, 600)
    rng = np.random.default_rng(3)
    chunks = [TtsRequest(text_ids=np.arange(40, 44), tts_hidden=rng.standard_normal((4, h)).astype(np.float32),
                         turn_start=i == 0, temperature=0.0) for i in range(4)]
    got = [stage.run([StageCall(c, 1, start=i == 0)])[0] for i, c in enumerate(chunks)]
    assert [r.kv_length for r in got] == [30, 60, 90, 30]  # 4 text + audio_bos + 25 codes; 90 + 30 > 100: over
    again = fresh.run([StageCall(dataclasses.replace(chunks[3], turn_start=True), 1, start=True)])[0]
    assert got[3].speech_tokens.tolist() == again.speech_tokens.tolist()


@pytest.mark.parametrize("model", ["llm", "tts", "token2wav", "audio_encoder", "vision_encoder"])
def test_model_configs_declare_the_stage_tensors(model: str) -> None:
    """config.pbtxt and the dataclasses the code exchanges must not drift apart."""
    text = (MODEL_REPOSITORY / model / "config.pbtxt").read_text()
    for classes, section in zip((STAGE_INPUTS[model], STAGE_OUTPUTS[model]), ("input", "output"), strict=True):
        block = text.split(f"\n{section} [", 1)[1].split("\n]", 1)[0]
        declared = re.findall(r'name: "(\w+)" data_type: (\w+) dims: \[ ([-\d, ]+) \]', block)
        expected = list({f.name: (f.name, triton_dtype(f), ", ".join(map(str, triton_dims(f))))
                         for cls in classes for f in dataclasses.fields(cls)}.values())
        assert declared == expected
    # Triton batches only requests whose inputs have equal shapes unless told otherwise; the stages pad
    # (or group) rows themselves, so every variable-length input must be ragged or batches stay tiny.
    inputs = text.split("\ninput [", 1)[1].split("\n]", 1)[0]
    for line in re.findall(r'\{ name: "\w+" data_type: \w+ dims: \[ [-\d, ]*-1[-\d, ]* \][^\n]*', inputs):
        assert "allow_ragged_batch: true" in line, line
    if model not in ("audio_encoder", "vision_encoder"):
        assert "CONTROL_SEQUENCE_START" in text and "CONTROL_SEQUENCE_CORRID" in text and "oldest" in text


def test_llm_rollback_forgets_what_was_not_heard(preset) -> None:
    """Rolling back to an earlier step's kv length is as if the later steps never happened, the turn ended."""
    tk = preset.tokens
    stage, fresh = llm_stage(preset), llm_stage(preset)
    rng = np.random.default_rng(5)
    heard = chunk_request(preset, rng, decode=False)
    unheard = chunk_request(preset, rng, decode=False)
    first = stage.run([StageCall(heard, 1, start=True)])[0]
    stage.run([StageCall(unheard, 1)])
    assert stage.store.get(1).cache.length > first.kv_length
    probe = chunk_request(preset, np.random.default_rng(9))
    rolled = stage.run([StageCall(dataclasses.replace(probe, rollback_to=first.kv_length), 1)])[0]
    # The same conversation built directly: the heard step, the turn's end, then the probe.
    fresh.run([StageCall(heard, 2, start=True)])
    ended = np.concatenate([[tk.turn_eos, tk.unit_end], probe.input_ids])
    direct = fresh.run([StageCall(dataclasses.replace(probe, input_ids=ended), 2)])[0]
    assert rolled.generated.tolist() == direct.generated.tolist()
    assert rolled.kv_length == direct.kv_length
    np.testing.assert_allclose(stage.store.get(1).cache.key, fresh.store.get(2).cache.key, atol=1e-5)
    with pytest.raises(ValueError, match="roll back"):
        stage.check(dataclasses.replace(probe, rollback_to=10**6), stage.store.get(1))


def test_llm_encodes_the_steps_audio_as_the_streaming_encoder_would(preset) -> None:
    """Audio sent to the LLM stage is encoded there, batched across rows, as the next chunk of the session's
    audio stream (its Whisper KV cache): the same input as the streaming encoder's embeddings sent as embeds.
    A later chunk carries what the session heard before, so it is not the whole-utterance encoding any more."""
    from minicpmo_triton.stage_io import AudioEncoderRequest
    from minicpmo_triton.stages.audio_encoder import AudioEncoderStage, AudioStream, AudioStreamEncoder

    folder = MODEL_REPOSITORY / "audio_encoder" / "1"

    def stream_encoder() -> AudioStreamEncoder:
        return AudioStreamEncoder(load_engine(folder, name="stream"), preset.audio, preset.samples_per_audio_token)

    with_audio = LlmStage(load_engine(MODEL_REPOSITORY / "llm" / "1"), preset, ByteTokenizer(), 600.0,
                          stream_encoder())
    with_embeds, reference = llm_stage(preset), stream_encoder()
    rng = np.random.default_rng(3)
    audio = {c: [(rng.standard_normal(16_000) * 0.1).astype(np.float32) for _ in range(2)] for c in (1, 2)}
    streams = {1: AudioStream(), 2: AudioStream()}
    tk = preset.tokens
    ids = np.array([tk.unit] + [tk.audio_placeholder] * 10, np.int64)
    for step in range(2):
        sent = with_audio.run([StageCall(LlmRequest(input_ids=ids, audio=audio[c][step], temperature=0.0), c,
                                         start=step == 0) for c in (1, 2)])
        for c, got in zip((1, 2), sent, strict=True):
            embeds = reference.run([(audio[c][step], streams[c])])[0]
            want = with_embeds.run([StageCall(LlmRequest(input_ids=ids, embeds=embeds, temperature=0.0), c,
                                              start=step == 0)])[0]
            assert got.generated.tolist() == want.generated.tolist()
            assert got.encode_ms > 0
            np.testing.assert_allclose(with_audio.store.get(c).cache.key, with_embeds.store.get(c).cache.key,
                                       atol=1e-4)
            np.testing.assert_allclose(with_audio.store.get(c).audio.cache.key, streams[c].cache.key, atol=1e-5)
    assert with_audio.store.get(1).audio.cache.length == 2 * 50  # 50 encoder frames a second, kept across steps
    whole = AudioEncoderStage(load_engine(folder), preset.samples_per_audio_token)
    alone = whole.run([AudioEncoderRequest(audio[2][1])])[0].embeds
    assert np.abs(alone - embeds).max() > 1e-3
    assert with_audio.store.get(1).cache.key.tolist() != with_audio.store.get(2).cache.key.tolist()
    with_audio.run([StageCall(LlmRequest(decode=False), 2, end=True)])  # the audio stream goes with the session
    assert 2 not in with_audio.store and with_audio.store.get(1).audio.cache.length == 100
    # Audio to a stage without an encoder, or with too few placeholders, fails that request alone.
    failed = with_embeds.run([StageCall(LlmRequest(input_ids=ids, audio=audio[1][0]), 1)])[0]
    assert isinstance(failed, ValueError) and "no audio encoder" in str(failed)
    failed = with_audio.run([StageCall(LlmRequest(input_ids=ids[:5], audio=audio[1][0]), 1)])[0]
    assert isinstance(failed, ValueError) and "placeholders" in str(failed)


def test_voice_prompts_are_an_lru_bounded_by_their_bytes(preset) -> None:
    stage = Token2WavStage.load(MODEL_REPOSITORY / "token2wav" / "1", preset, 600)
    prompts = stage.prompts
    refs = [0.1 * np.random.default_rng(i).standard_normal(16_000).astype(np.float32) for i in range(3)]
    first = prompts.get(audio_key(refs[0]), refs[0])
    prompts.budget_bytes = 2 * first.cache.nbytes + 1  # room for two 1 s prompts
    for ref in refs[1:]:
        prompts.get(audio_key(ref), ref)
    assert prompts.computed == 3 and prompts.nbytes <= prompts.budget_bytes
    prompts.get(audio_key(refs[2]), refs[2])  # kept: reused
    prompts.get(audio_key(refs[0]), refs[0])  # evicted first: computed again
    assert (prompts.computed, prompts.reused) == (4, 1)


def test_teacher_forced_tokens_have_the_hidden_states_of_the_same_tokens_sampled(preset) -> None:
    """A given text fed as if sampled (`forced_ids`) is decoded exactly as the model's own text: the same
    tokens give the same hidden states for the TTS; a forced prefix is followed by sampling."""
    tk, stage = preset.tokens, llm_stage(preset)

    def run(corr_id: int, forced: list[int], max_new_tokens: int = 12):
        req = chunk_request(preset, np.random.default_rng(7), max_new_tokens=max_new_tokens,
                            forced_ids=np.array(forced, np.int64))
        [res] = stage.run([StageCall(req, corr_id, start=True)])
        assert not isinstance(res, Exception), res
        return res

    sampled = run(1, [tk.speak])  # <|speak|> forced, then greedy
    assert sampled.generated[0] == tk.speak and len(sampled.text_ids) > 0
    forced = run(2, sampled.generated.tolist())
    assert forced.generated.tolist() == sampled.generated.tolist()
    assert forced.text_ids.tolist() == sampled.text_ids.tolist()
    np.testing.assert_array_equal(forced.tts_hidden, sampled.tts_hidden)

    text = ByteTokenizer().encode("hello")
    said = run(3, [tk.speak, *text, tk.turn_eos, tk.chunk_eos])
    # the TTS conditions on what is fed from the second token on: the text and <|turn_eos|>
    assert said.generated.tolist() == [tk.speak, *text, tk.turn_eos, tk.chunk_eos]
    assert said.text_ids.tolist() == [*text, tk.turn_eos] and not said.is_listen
    assert said.end_of_turn and said.tts_hidden.shape == (len(text) + 1, preset.llm.hidden)
    cut = run(4, [tk.speak, *text, tk.turn_eos], max_new_tokens=4)  # the chunk's budget still ends it
    assert cut.generated.tolist() == [tk.speak, *text[:2]] and not cut.end_of_turn  # then <|chunk_eos|>, deferred


def test_no_folder_in_a_model_version_shadows_a_module() -> None:
    """Triton's Python stub puts each model's version folder on sys.path: a folder there named as a module imports
    as that module (a namespace package) wherever the module is not installed (a stage folder `torch/` made every
    `import torch` of a torch-less Python succeed and fail later: token2wav did not load)."""
    import importlib.util
    import sys

    ensure_exported()
    folders = [d for d in MODEL_REPOSITORY.glob("*/1/*") if d.is_dir() and d.name != "__pycache__"]
    assert folders  # token2wav's device modules, at least
    shadowing = [str(d.relative_to(MODEL_REPOSITORY)) for d in folders
                 if d.name in sys.stdlib_module_names or importlib.util.find_spec(d.name) is not None]
    assert shadowing == []

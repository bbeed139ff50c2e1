"""The paged TTS (its KV cache in a pool of its own, attention over blocks in place) against today's path (the
exported ONNX graph, a host KV cache per session), on `tiny`: the same codes (greedy and sampled, same seeds),
the logits of every forward within 1e-4, ragged rows (texts of 0 to 9 tokens, chunks of 3 to 25 codes, rows
finishing at different iterations), a turn's reset at its start and end, END and eviction freeing blocks, the
pool-full refusal, and the bytes a chunk moves staying flat as the turn grows. On the CPU and, where one exists,
on CUDA (there at fp32 weights, so the codes can be compared with the fp32 reference)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from export.presets import TINY_SEED, tiny
from export.stages import build_modules
from minicpmo_triton.engine.exported import load_engine
from minicpmo_triton.engine.protocol import NOT_FINITE, pick_engine
from minicpmo_triton.engine.sampler import inverse_cdf, value_ordered
from minicpmo_triton.engine.traffic import CountingEngine, Traffic
from minicpmo_triton.errors import RETRYABLE, Code, StepError
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import TtsRequest, TtsResult
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.pool_kv import PoolKv, tts_kv
from minicpmo_triton.stages.tts import ChunkRules, TtsSession, TtsStage, with_tts_sampling

from .conftest import MODEL_REPOSITORY, ensure_exported

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(scope="module")
def preset():
    ensure_exported()
    return load_stage_config(MODEL_REPOSITORY / "tts" / "1")


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    """The exported graph's weights: the same seed builds the same module."""
    return build_modules(tiny(), TINY_SEED)["tts"].state_dict()


def paged(preset, weights, device: str = "cpu", **kw: Any) -> PoolKv:
    """The TTS's device KV (its engine core): gather attention, fp32 (the parity tests hold it to the graph's)."""
    kw = {"pool_size": 0.01, "attention": "gather", "dtype": torch.float32, "max_tokens": 8192, **kw}
    return tts_kv(weights, preset, device=device, **kw)


class Recording:
    """An engine's logits per forward, in the rows' order (both paths drop finished rows the same way)."""

    def __init__(self) -> None:
        self.logits: list[np.ndarray] = []


def recording_onnx(rec: Recording, traffic: Traffic | None = None) -> Any:
    engine = load_engine(MODEL_REPOSITORY / "tts" / "1")
    if traffic is not None:
        engine = CountingEngine(engine, traffic)
    run = engine.run

    def recorded(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = run(feeds)
        rec.logits.append(np.asarray(out["logits"], np.float32).copy())
        return out

    engine.run = recorded  # type: ignore[method-assign]
    return engine


def recording_paged(rec: Recording, kv: PoolKv) -> PoolKv:
    """The logits of each forward's deciding rows copied for the test (off the traffic ledger: the core keeps them
    on the device), in the rows' order, as the host path's forward has them."""
    head = kv.core.runner.head
    choose = head.choose

    def recorded(raw: torch.Tensor, rows: Any, state: Any, was_live: torch.Tensor, *args: Any) -> None:
        if bool(was_live.any()):
            rec.logits.append(raw[was_live].detach().cpu().numpy().copy())
        choose(raw, rows, state, was_live, *args)

    head.choose = recorded  # type: ignore[method-assign]
    return kv


def request(preset, corr: int, chunk: int, texts: int, **kw: Any) -> TtsRequest:
    rng = np.random.default_rng(corr * 100 + chunk)
    return TtsRequest(text_ids=rng.integers(0, preset.tts.num_text_tokens, texts).astype(np.int64),
                      tts_hidden=rng.standard_normal((texts, preset.llm.hidden)).astype(np.float32), seed=corr, **kw)


# per session: its text tokens per chunk and codes per chunk (ragged: rows end at different iterations); session 4
# samples at the stage's defaults, the others are greedy
SESSIONS: dict[int, dict[str, Any]] = {1: {"texts": 9, "n_tokens": 25, "temperature": 0.0},
                                       2: {"texts": 3, "n_tokens": 10, "temperature": 0.0},
                                       3: {"texts": 0, "n_tokens": 3, "temperature": 0.0},
                                       4: {"texts": 5, "n_tokens": 25}}
# a turn of three chunks (its start resets, its end drops the cache), then a new turn
TURNS = [{"turn_start": True}, {}, {"turn_end": True}, {"turn_start": True}]


def speak(st: TtsStage, preset, sessions: dict[int, dict[str, Any]] = SESSIONS) -> list[list[Any]]:
    out = []
    for chunk, turn in enumerate(TURNS):
        calls = [StageCall(request(preset, c, chunk, **s, **turn), c, start=chunk == 0) for c, s in sessions.items()]
        out.append(st.run(calls))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_the_paged_tts_says_what_the_onnx_graph_says(preset, weights, device: str) -> None:
    ref_rec, new_rec = Recording(), Recording()
    ref = speak(TtsStage(recording_onnx(ref_rec), preset, 600.0), preset)
    new = speak(TtsStage(recording_paged(new_rec, paged(preset, weights, device)), preset, 600.0), preset)
    for ref_chunk, new_chunk in zip(ref, new, strict=True):
        for a, b in zip(ref_chunk, new_chunk, strict=True):
            assert isinstance(a, TtsResult) and isinstance(b, TtsResult), (a, b)
            assert a.speech_tokens.tolist() == b.speech_tokens.tolist()
            assert a.kv_length == b.kv_length
    assert len(ref_rec.logits) == len(new_rec.logits) > 4 * 25
    for a, b in zip(ref_rec.logits, new_rec.logits, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
    assert len({r.kv_length for r in ref[1]}) == len(SESSIONS)  # ragged: each row's history its own length


def test_a_turn_end_gives_back_all_but_the_admission_room_and_end_frees_the_rest(preset, weights) -> None:
    eng = paged(preset, weights)
    st = TtsStage(eng, preset, 600.0)
    pool = eng.pool
    for chunk in (0, 1):  # two chunks of one turn: past the room each session was admitted with
        st.run([StageCall(request(preset, c, chunk, **s, turn_start=chunk == 0), c, start=chunk == 0)
                for c, s in SESSIONS.items()])
    floor = pool.shape.blocks_for(st.admit_tokens)
    held = pool.num_blocks - pool.free_blocks
    assert held > floor * len(SESSIONS)
    st.run([StageCall(request(preset, c, 2, **s, turn_end=True), c) for c, s in SESSIONS.items()])
    assert pool.num_blocks - pool.free_blocks == floor * len(SESSIONS)
    assert all(st.store.get(c).cache.length == 0 for c in SESSIONS)
    st.run([StageCall(TtsRequest(n_tokens=0), 1, end=True)])
    assert 1 not in st.store and len(pool.tables) == 3
    st.store.ttl_s = -1.0  # every session is past its idle time
    assert sorted(st.store.evict_expired()) == [2, 3, 4]
    assert pool.free_blocks == pool.num_blocks and not pool.tables


def test_a_full_pool_refuses_with_a_retryable_code_and_the_others_go_on(preset, weights) -> None:
    """A pool of 8 blocks of 16 tokens: two sessions are admitted (room for a spoken second each), a third is
    refused at its START; a chunk too long for what is left is refused at its check, and the other row of its
    batch speaks."""
    eng = paged(preset, weights, pool_tokens=8 * 16)
    st = TtsStage(eng, preset, 600.0)
    floor = eng.pool.shape.blocks_for(st.admit_tokens)
    assert 2 * floor <= 8 < 3 * floor
    out = st.run([StageCall(request(preset, c, 0, 3, n_tokens=5, turn_start=True), c, start=True)
                  for c in (1, 2, 3)])
    assert isinstance(out[0], TtsResult) and isinstance(out[1], TtsResult)
    assert isinstance(out[2], StepError) and out[2].code == Code.POOL_FULL and out[2].code in RETRYABLE
    out = st.run([StageCall(request(preset, 1, 1, 3, n_tokens=8 * 16), 1),
                  StageCall(request(preset, 2, 1, 3, n_tokens=5), 2)])
    assert isinstance(out[0], StepError) and out[0].code == Code.POOL_FULL
    assert isinstance(out[1], TtsResult) and len(out[1].speech_tokens) == 5


def _chunk_bytes(st: TtsStage, traffic: Traffic, preset, history: int) -> int:
    """Bytes host<->device of one 25-code chunk (5 text tokens) of a session `history` codes into its turn."""
    first = st.run([StageCall(request(preset, 9, 0, 5, n_tokens=history, temperature=0.0, turn_start=True), 9,
                             start=True)])[0]
    assert isinstance(first, TtsResult) and len(first.speech_tokens) == history
    traffic.reset()
    st.run([StageCall(request(preset, 9, 1, 5, n_tokens=25, temperature=0.0), 9)])
    total = traffic.total()
    st.run([StageCall(TtsRequest(n_tokens=0), 9, end=True)])
    return total


@pytest.mark.parametrize("device", DEVICES)
def test_bytes_per_chunk_do_not_grow_with_the_turn_on_the_paged_path(preset, weights, device: str) -> None:
    """At 50 and 500 codes into a turn, a chunk moves the same bytes on the paged path (up to a block id or
    two), and no logits: each code's [1, 6562] fp32 logits stay on the device, only the code comes back. Today's
    path, counted the same way, moves its whole cache in and out at every code, and the logits."""
    eng = paged(preset, weights, device)
    traffic = Traffic()
    onnx = TtsStage(recording_onnx(Recording(), traffic), preset, 600.0)
    ledger = eng.pool.traffic
    new = {h: _chunk_bytes(TtsStage(eng, preset, 600.0), ledger, preset, h) for h in (50, 500)}
    assert ledger.by_kind()["logits"] == 0
    # per iteration of the chunk (26 codes chosen, and the one the overlap launched before the last was read): the
    # row's code and its flags, int64
    assert ledger.to_host["outputs"] <= 27 * 2 * 8, ledger.to_host
    old = {h: _chunk_bytes(onnx, traffic, preset, h) for h in (50, 500)}
    assert abs(new[500] - new[50]) <= 64, new
    assert old[500] > 4 * old[50], old
    assert new[500] < old[50]
    logits_per_chunk = 26 * preset.tts.num_audio_tokens * 4
    assert new[500] < logits_per_chunk / 10, (new, logits_per_chunk)


def test_the_tts_engine_choice() -> None:
    assert pick_engine("auto", cuda=False, key="tts_engine") == "onnx"
    assert pick_engine("auto", cuda=True, key="tts_engine") == "paged"
    assert pick_engine("paged", cuda=False, key="tts_engine") == "paged"
    with pytest.raises(ValueError, match="tts_engine"):
        pick_engine("trt", cuda=True, key="tts_engine")


def test_export_prints_the_tts_pool_n_sessions_need() -> None:
    """The TTS pool: 30% of the sessions speaking one turn that long (its bound), the rest holding their admission
    room (one spoken second); fp8 halves bf16."""
    from export.memory import BF16, FP8, pool_bytes, pool_report
    from export.presets import minicpmo45

    real = minicpmo45()
    d, dx = real.tts.decoder, real.duplex
    token = 2 * d.layers * d.kv_heads * d.head_dim * BF16
    per_s = dx.max_new_speak_tokens_per_chunk + 1 + 25
    assert pool_bytes(real, 128, 60, BF16, "tts") == 38 * 60 * per_s * token + 90 * per_s * token
    assert pool_bytes(real, 128, 300, FP8, "tts") * 2 == pool_bytes(real, 128, 300, BF16, "tts")
    assert "TTS KV pool" in "\n".join(pool_report(real))


def _rows_with_history(preset, weights, rng: np.random.Generator, n: int, **sampling: Any
                       ) -> tuple[TtsStage, list[ChunkRules]]:
    """n rows of the stage's rules: temperatures 0 / 0.3 / 0.8 / 1.7, histories of 0 to 40 codes (past the window
    of 16, with repeats), EOS allowed or not. `sampling`: the stage's top_k / top_p (default: off, the reference's)."""
    if sampling:
        preset = with_tts_sampling(preset, sampling["top_k"], sampling["top_p"])
    st = TtsStage(paged(preset, weights), preset, 600.0)
    vocab = preset.tts.num_audio_tokens
    rows = []
    for r in range(n):
        req = TtsRequest(n_tokens=64, temperature=[0.0, 0.3, 0.8, 1.7][r % 4], turn_end=r % 3 == 0)
        rules = ChunkRules(st, req, TtsSession(None, np.random.default_rng(r)), opened=r % 5 == 0)  # type: ignore[arg-type]
        rules.codes = rng.integers(0, vocab - 1, int(rng.integers(0, 40))).tolist()
        rules.codes += rules.codes[:3] * 2  # repeats: the penalty goes per occurrence
        rows.append(rules)
    return st, rows


def _on_device(st: TtsStage, rows: list[ChunkRules], weights: dict[str, torch.Tensor], device: str) -> Any:
    """A TTS head on `device` holding the rows' rules and windows (the chunk's last 16 codes) in rows 0..n-1."""
    kv = paged(st.preset, weights, device)
    head = kv.core.runner.head
    head.admit(list(range(len(rows))), [r.row for r in rows])
    kv.pool.flush()
    window = st.preset.duplex.tts_repetition_window
    for r, rules in enumerate(rows):
        codes = rules.codes[-window:]
        head.ring[r, : len(codes)] = torch.tensor(codes)
        head.steps[r] = len(rules.codes)  # where the next code goes in the window (its uniform: set by the test)
    return kv


@pytest.mark.parametrize("sampling", [{}, {"top_k": 20, "top_p": 0.7}], ids=["default", "top_k_top_p"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_device_tts_rules_keep_the_host_rules(preset, weights, device: str, sampling: dict[str, Any]) -> None:
    """For the same logits and history, the device's adjusted logits (temperature, per-occurrence penalty, EOS mask)
    and its distribution (the whole vocabulary by default, as the reference; top-k / top-p when the settings turn
    them on) equal the host's (`ChunkRules.adjusted`, `sampling.distribution`) within 1e-6; with the host's uniform
    draws it picks the host's codes (greedy and sampled); and its draws follow that distribution (20000 draws per
    row, each probability within 0.015: checked over top-k's 20 codes, the draw being the same for any width)."""
    from minicpmo_triton.rules.sampling import distribution, sample

    rng = np.random.default_rng(7)
    st, rows = _rows_with_history(preset, weights, rng, 12, **sampling)
    kv = _on_device(st, rows, weights, device)
    head, runner = kv.core.runner.head, kv.core.runner
    vocab = preset.tts.num_audio_tokens
    logits = (rng.standard_normal((12, vocab)) * 3).astype(np.float32)
    logits[:, st.eos] = 9.0  # EOS would win where it is allowed
    raw = torch.as_tensor(logits, device=device)
    adjusted = head.adjusted(raw, slice(0, 12))
    ids, probs = value_ordered(adjusted.to(torch.float64), head.ks[:12], runner.topk, head.top_p[:12])
    for r in range(12):
        host = rows[r].adjusted(logits[r])
        np.testing.assert_allclose(adjusted[r].cpu().numpy(), host, rtol=1e-6, atol=0)
        if rows[r].params().greedy:
            continue  # the argmax: checked by the codes below
        top, p = distribution(host, rows[r].params())
        # each code's probability (the order of equal logits is the sort's own: the whole vocabulary has ties)
        want, got = np.zeros(vocab), np.zeros(vocab)
        want[top], got[ids[r].cpu().numpy()] = p, probs[r].cpu().numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # the codes: each row's uniform as `sample` would draw it from the session's rng
    host_rngs = [np.random.default_rng(r) for r in range(12)]
    device_rngs = [np.random.default_rng(r) for r in range(12)]
    ring, steps = head.ring.clone(), head.steps.clone()
    for trial in range(50):
        head.ring.copy_(ring)
        head.steps.copy_(steps)
        for r in range(12):
            if rows[r].req.temperature > 0:
                head.uniforms[r, int(steps[r]) % head.steps_cap] = float(device_rngs[r].random())
        head.choose(raw, slice(0, 12), runner.state, torch.ones(12, dtype=torch.bool, device=device), runner.topk)
        out = runner.state.out[:12].cpu().numpy()
        assert not (out[:, 1] & NOT_FINITE).any()
        for r in range(12):
            assert out[r, 0] == sample(rows[r].adjusted(logits[r]), rows[r].params(), host_rngs[r]), (trial, r)
    if not sampling:
        return
    # statistics: the device's own draws at many uniforms
    draws = 20_000
    u = torch.rand(draws, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(device)
    for r in (1, 2, 3, 6):  # sampled rows
        top, p = distribution(rows[r].adjusted(logits[r]), rows[r].params())
        got = inverse_cdf(ids[r : r + 1].expand(draws, -1), probs[r : r + 1].expand(draws, -1), u).cpu().numpy()
        freq = np.bincount(got, minlength=vocab)[top] / draws
        assert np.abs(freq - p).max() < 0.015, (r, freq, p)


def test_a_row_with_broken_logits_fails_alone_on_the_device(preset, weights) -> None:
    st, rows = _rows_with_history(preset, weights, np.random.default_rng(1), 3)
    kv = _on_device(st, rows, weights, "cpu")
    head, runner = kv.core.runner.head, kv.core.runner
    logits = torch.zeros(3, preset.tts.num_audio_tokens)
    logits[1, 5] = float("nan")
    head.choose(logits, slice(0, 3), runner.state, torch.ones(3, dtype=torch.bool), runner.topk)
    flags = runner.state.out[:3, 1].tolist()
    assert [bool(f & NOT_FINITE) for f in flags] == [False, True, False]
    with pytest.raises(StepError) as err:
        rows[1].confirm(int(runner.state.out[1, 0]), flags[1])
    assert err.value.code == Code.NUMERIC_ERROR


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_tts_rules_are_the_reference_generate_chunks(preset, weights, device: str) -> None:
    """The device's adjusted logits against MiniCPM-o's own code, run: `generate_chunk`'s temperature
    (modeling_minicpmo_unified.py:6792), its `CustomRepetitionPenaltyLogitsProcessorRepeat` over the chunk's codes
    with its own 16-code window (:6794-6806, :6950-6968, built by `gen_logits` :6975-6988) and its EOS mask
    (:6809-6810), for the same logits and history, within 1e-6 (the reference raises 1.05 to the count in float32,
    the host in float64)."""
    from .reference_demo import demo_module

    modeling = demo_module("modeling_minicpmo_unified")
    rng = np.random.default_rng(11)
    st, rows = _rows_with_history(preset, weights, rng, 8)
    vocab, dx = preset.tts.num_audio_tokens, preset.duplex
    processor = modeling.gen_logits(num_code=vocab, repetition_penalty=dx.tts_repetition_penalty)[1]
    logits = (rng.standard_normal((8, vocab)) * 3).astype(np.float32)
    head = _on_device(st, rows, weights, device).core.runner.head
    got = head.adjusted(torch.as_tensor(logits, device=device), slice(0, 8)).cpu().numpy()
    for r in range(8):
        req = rows[r].req
        want = torch.as_tensor(logits[r : r + 1]).clone()
        if req.temperature > 0:
            want /= torch.tensor([[req.temperature]], dtype=torch.float32)
        if rows[r].codes:  # `if not audio_bos`: from the chunk's second code on
            for proc in processor:
                want = proc(torch.tensor([rows[r].codes]), want)
        if not rows[r].allow_eos:
            want[:, st.eos] = -torch.inf
        np.testing.assert_allclose(got[r], want[0].numpy(), rtol=1e-6, atol=0)

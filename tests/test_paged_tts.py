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
from minicpmo_triton.engines import load_engine
from minicpmo_triton.errors import RETRYABLE, Code, StepError
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.paged.protocol import pick_engine
from minicpmo_triton.paged.traffic import CountingEngine, Traffic
from minicpmo_triton.paged.tts import PagedTtsEngine
from minicpmo_triton.stage_io import TtsRequest, TtsResult
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.tts import TtsStage

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


def paged(preset, weights, device: str = "cpu", **kw: Any) -> PagedTtsEngine:
    kw = {"pool_size": 0.01, "attention": "gather", "dtype": torch.float32, "max_tokens": 8192, **kw}
    return PagedTtsEngine.build(weights, preset.tts, device=device, **kw)


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


def recording_paged(rec: Recording, engine: PagedTtsEngine) -> PagedTtsEngine:
    logits = engine.logits

    def recorded(*args: Any) -> np.ndarray:
        out = logits(*args)
        rec.logits.append(out.copy())
        return out

    engine.logits = recorded  # type: ignore[method-assign]
    return engine


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


def test_bytes_per_chunk_do_not_grow_with_the_turn_on_the_paged_path(preset, weights) -> None:
    """At 50 and 500 codes into a turn, a chunk moves the same bytes on the paged path (up to a block id or
    two); today's path, counted the same way, moves its whole cache in and out at every code."""
    eng = paged(preset, weights)
    traffic = Traffic()
    onnx = TtsStage(recording_onnx(Recording(), traffic), preset, 600.0)
    new = {h: _chunk_bytes(TtsStage(eng, preset, 600.0), eng.traffic, preset, h) for h in (50, 500)}
    old = {h: _chunk_bytes(onnx, traffic, preset, h) for h in (50, 500)}
    assert abs(new[500] - new[50]) <= 64, new
    assert old[500] > 4 * old[50], old
    assert new[500] < old[50]


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

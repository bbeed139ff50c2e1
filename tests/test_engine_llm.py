"""The LLM on the engine core (KV pool on the device, attention over blocks in place, sampling and the duplex rules
on the device, the next iteration launched before the host reads this one's tokens) against the host path (the
exported ONNX graph, host KV caches), on `tiny`: same logits within 1e-4, same tokens (greedy and sampled, same
seeds), ragged batches, rows ending at different iterations, rollback, undo after a failing row, END and eviction
freeing blocks, the pool-full refusal. Each on the CPU and, where one exists, on CUDA (there in fp32 for the tokens,
and as served: bf16, flex, CUDA graphs)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from export.presets import TINY_SEED, tiny
from export.stages import build_modules
from minicpmo_triton.engine.attention import Decode, FlexAttention, GatherAttention, Rows
from minicpmo_triton.engine.exported import load_engine
from minicpmo_triton.engine.kv_batch import KvBatch, KvCache, right_pad
from minicpmo_triton.engine.pool import KvPool, PoolShape
from minicpmo_triton.engine.protocol import NOT_FINITE, Prefill
from minicpmo_triton.engine.request import Request
from minicpmo_triton.engine.traffic import CountingEngine, Traffic
from minicpmo_triton.errors import RETRYABLE, Code, StepError
from minicpmo_triton.media.tokenizer import load_tokenizer
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import LlmRequest
from minicpmo_triton.stages.audio_encoder import AudioStreamEncoder
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.llm import LlmStage
from minicpmo_triton.stages.pool_kv import PoolKv, llm_kv

from .conftest import MODEL_REPOSITORY, ensure_exported

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(scope="module")
def preset():
    ensure_exported()
    return load_stage_config(MODEL_REPOSITORY / "llm" / "1")


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    """The exported graph's weights: the same seed builds the same module (export/torch_engine.py does too)."""
    return build_modules(tiny(), TINY_SEED)["llm"].state_dict()


def tokenizer(preset):
    return load_tokenizer(preset, MODEL_REPOSITORY / "duplex" / "1")


def paged_engine(preset, weights, device: str = "cpu", **kw: Any) -> PoolKv:
    """The LLM's device KV (its engine core): gather attention on the CPU unless asked otherwise."""
    kw = {"pool_size": 0.01, "attention": "gather", **kw}
    return llm_kv(weights, preset, tokenizer(preset), device=device, **kw)


def stage(preset, engine: Any, **kw: Any) -> LlmStage:
    encoder = AudioStreamEncoder(load_engine(MODEL_REPOSITORY / "audio_encoder" / "1", name="stream"), preset.audio,
                                 preset.samples_per_audio_token)
    return LlmStage(engine, preset, tokenizer(preset), 600.0, encoder, **kw)


def onnx_stage(preset) -> LlmStage:
    return stage(preset, load_engine(MODEL_REPOSITORY / "llm" / "1"))


def chunk(preset, corr: int, step: int, **settings: Any) -> LlmRequest:
    tk = preset.tokens
    audio = (np.random.default_rng(corr * 1000 + step).standard_normal(16_000) * 0.1).astype(np.float32)
    return LlmRequest(input_ids=np.array([tk.unit] + [tk.audio_placeholder] * 10, np.int64), audio=audio,
                      seed=corr, **settings)


# greedy with chunks of 4, 13 and 20 tokens (rows end at different iterations), sampled at the defaults, a
# teacher-forced text, a turn-based (chat) row sampled
SESSIONS: dict[int, dict[str, Any]] = {1: {"temperature": 0.0, "max_new_tokens": 4},
                                       2: {"temperature": 0.0, "max_new_tokens": 13, "length_penalty": 1.3},
                                       3: {"max_new_tokens": 7}, 4: {"temperature": 0.0},
                                       5: {"forced_ids": np.frombuffer(b"Hello there, how are you", np.uint8)
                                           .astype(np.int64), "temperature": 0.0},
                                       6: {"chat": True, "max_new_tokens": 6, "repetition_penalty": 1.3}}


def run(st: LlmStage, preset, steps: int, sessions: dict[int, dict[str, Any]], *, first: int = 0,
        change: Any = None) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for step in range(first, first + steps):
        calls = [StageCall(chunk(preset, c, step, **s), c, start=step == 0) for c, s in sessions.items()]
        if change is not None:
            calls = [change(step, call) for call in calls]
        for call, res in zip(calls, st.run(calls), strict=True):
            out.setdefault(call.corr_id, []).append(res)
    return out


def assert_same(a: Any, b: Any, hidden_atol: float = 1e-4) -> None:
    assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
    assert a.generated.tolist() == b.generated.tolist()
    assert a.text_ids.tolist() == b.text_ids.tolist()
    assert (a.kv_length, a.is_listen, a.end_of_turn, a.turn_start) == (b.kv_length, b.is_listen, b.end_of_turn,
                                                                       b.turn_start)
    np.testing.assert_allclose(a.tts_hidden, b.tts_hidden, atol=hidden_atol)


def test_logits_of_a_ragged_batch_match_the_onnx_graph(preset, weights) -> None:
    """Three rows of 5, 12 and 1 new tokens (one with audio embeddings), then one decode token each on their
    ragged pasts: the paged forward's logits are the ONNX graph's within 1e-4."""
    d, rng = preset.llm, np.random.default_rng(0)
    onnx = load_engine(MODEL_REPOSITORY / "llm" / "1")
    eng = paged_engine(preset, weights)
    lengths = [5, 12, 1]
    rows = []
    for n in lengths:
        ids = rng.integers(0, d.vocab, n)
        use = np.zeros(n, bool)
        use[1 : n // 2] = True
        rows.append(Prefill(ids, rng.standard_normal((int(use.sum()), d.hidden)).astype(np.float32) * 0.1, use))
    seqs = [eng.pool.open(64) for _ in rows]
    batch = KvBatch([KvCache.empty(d.layers, d.kv_heads, d.head_dim) for _ in rows])
    pasts = [0, 0, 0]
    for step in range(2):
        if step:
            rows = [Prefill(rng.integers(0, d.vocab, 1), np.zeros((0, d.hidden), np.float32), np.zeros(1, bool))
                    for _ in rows]
        new = np.array([len(r.ids) for r in rows])
        embeds = []
        for r in rows:
            full = np.zeros((len(r.ids), d.hidden), np.float32)
            full[r.use] = r.embeds
            embeds.append(full)
        ref = onnx.run({"input_ids": right_pad([r.ids for r in rows]), "embeds": right_pad(embeds),
                        "use_embeds": right_pad([r.use for r in rows]), **batch.feeds(new)})
        batch.advance(ref["present_key"], ref["present_value"], new)
        got = eng.core.runner.logits(seqs, pasts, rows)
        np.testing.assert_allclose(got.cpu().numpy(), ref["logits"], atol=1e-4)
        pasts = [p + n for p, n in zip(pasts, new, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_stage_on_the_paged_engine_says_what_it_says_on_onnx(preset, weights, device: str) -> None:
    """Six sessions in one batch for five steps (greedy and sampled, chunks of different lengths, a length penalty,
    teacher forcing, a chat row): the same tokens, text, cache lengths and decisions, the TTS's hidden rows
    within 1e-4. On CUDA the engine runs fp32 (flex attention), so its tokens can be held to the ONNX graph's."""
    ref = run(onnx_stage(preset), preset, 5, SESSIONS)
    got = run(stage(preset, paged_engine(preset, weights, device, attention="auto", dtype=torch.float32)), preset, 5,
              SESSIONS)
    for corr, results in got.items():
        for a, b in zip(results, ref[corr], strict=True):
            assert_same(a, b, 1e-4 if device == "cpu" else 1e-3)
    assert max(len(r.generated) for rs in got.values() for r in rs) > 4, "the sessions decode"


def test_rollback_truncates_the_pool_as_it_cuts_the_host_cache(preset, weights) -> None:
    """After three steps, each session rolls back to 9 tokens before its end; both paths go on alike."""
    def roll(step: int, call: StageCall) -> StageCall:
        if step != 3:
            return call
        return dataclasses.replace(call, request=dataclasses.replace(call.request, rollback_to=kv[call.corr_id] - 9))

    outs = []
    for st in (onnx_stage(preset), stage(preset, paged_engine(preset, weights))):
        first = run(st, preset, 3, SESSIONS)
        kv = {c: rs[-1].kv_length for c, rs in first.items()}
        outs.append(run(st, preset, 2, SESSIONS, first=3, change=roll))
    for corr in SESSIONS:
        for a, b in zip(outs[1][corr], outs[0][corr], strict=True):
            assert_same(a, b)


def test_a_failing_row_is_undone_and_the_others_are_unchanged(preset, weights) -> None:
    """A row whose forward raises fails the batch; each row runs again alone from its state before it: the clean
    rows get what today's path gives them, the broken row an error and its length back, so its next step is
    today's too; its blocks are not lost (after END the pool is whole)."""
    tk = preset.tokens
    eng = breaking(paged_engine(preset, weights), tk.audio_start)

    def poison(step: int, call: StageCall) -> StageCall:
        if step != 1 or call.corr_id != 2:
            return call
        ids = np.concatenate([[tk.audio_start], call.request.input_ids])
        return dataclasses.replace(call, request=dataclasses.replace(call.request, input_ids=ids))

    paged = stage(preset, eng)
    got = run(paged, preset, 3, SESSIONS, change=poison)
    ref_stage = onnx_stage(preset)
    ref = run(ref_stage, preset, 1, SESSIONS)
    calls = [StageCall(chunk(preset, c, 1, **s), c) for c, s in SESSIONS.items() if c != 2]
    for call, res in zip(calls, ref_stage.run(calls), strict=True):
        ref[call.corr_id].append(res)
    more = run(ref_stage, preset, 1, SESSIONS, first=2)
    for corr, rs in got.items():
        expected = [ref[corr][0], ref[corr][1] if corr != 2 else None, more[corr][0]]
        for a, b in zip(rs, expected, strict=True):
            if b is None:
                assert isinstance(a, RuntimeError), a
            else:
                assert_same(a, b)
    paged.run([StageCall(LlmRequest(decode=False), c, end=True) for c in SESSIONS])
    assert eng.pool.free_blocks == eng.pool.num_blocks and not eng.pool.tables


def breaking(kv: PoolKv, token: int) -> PoolKv:
    """The core's iterations raise whenever a prefill in them holds `token` (a forward with no row to blame)."""
    runner = kv.core.runner
    step = runner.step

    def failing(batch: Any) -> Any:
        if any(token in p.request.prefill.ids for p in batch.prefills):
            raise RuntimeError("the forward failed")
        return step(batch)

    runner.step = failing  # type: ignore[method-assign]
    return kv


def test_end_and_eviction_give_the_blocks_back(preset, weights) -> None:
    eng = paged_engine(preset, weights)
    st = stage(preset, eng)
    run(st, preset, 2, SESSIONS)
    assert eng.pool.free_blocks < eng.pool.num_blocks
    st.run([StageCall(LlmRequest(decode=False), 1, end=True)])
    held = eng.pool.num_blocks - eng.pool.free_blocks
    assert len(eng.pool.tables) == len(SESSIONS) - 1 and held > 0
    st.store.ttl_s = -1.0  # every session is past its idle time
    assert sorted(st.store.evict_expired()) == sorted(SESSIONS)[1:]
    assert eng.pool.free_blocks == eng.pool.num_blocks and not eng.pool.tables


def test_a_full_pool_refuses_a_new_session_with_a_retryable_code(preset, weights) -> None:
    """A pool of 40 blocks of 16 tokens admits two sessions needing room for 256 tokens each, refuses the third
    at its START (pool_full, retryable), and admits it once one has ended."""
    small = paged_engine(preset, weights, pool_tokens=40 * 16)
    assert small.pool.num_blocks == 40
    st = stage(preset, small, admit_tokens=256)
    calls = [StageCall(chunk(preset, c, 0, temperature=0.0), c, start=True) for c in (1, 2, 3)]
    out = st.run(calls)
    assert not isinstance(out[0], Exception) and not isinstance(out[1], Exception)
    assert isinstance(out[2], StepError) and out[2].code == Code.POOL_FULL and out[2].code in RETRYABLE
    st.run([StageCall(LlmRequest(decode=False), 1, end=True)])
    assert not isinstance(st.run([calls[2]])[0], Exception)


def _step_bytes(st: LlmStage, traffic: Traffic, preset, history: int) -> int:
    """Bytes host<->device of one duplex step (11-token chunk, 8 decoded tokens) of a session `history` tokens in."""
    tk = preset.tokens
    system = np.full(history, tk.unit, np.int64)  # any text: the cache's length is what counts
    st.run([StageCall(LlmRequest(input_ids=system, decode=False), 7, start=True)])
    traffic.reset()
    res = st.run([StageCall(chunk(preset, 7, 1, temperature=0.0, max_new_tokens=8), 7)])[0]
    assert not isinstance(res, Exception) and res.cached_tokens == history
    return traffic.total()


def test_bytes_per_step_do_not_grow_with_context_on_the_paged_path(preset, weights) -> None:
    """Counted the same way (every feed in, every output out, per engine call): today's path moves the whole
    cache each token, so a step 4000 tokens in costs ~20x one 200 in; the paged path moves ids, the chunk's
    embeddings, a repetition window, tokens and the TTS's hidden rows, the same at 200 and 4000."""
    traffic = Traffic()
    onnx = stage(preset, CountingEngine(load_engine(MODEL_REPOSITORY / "llm" / "1"), traffic))
    paged = stage(preset, paged_engine(preset, weights))
    new = {h: _step_bytes(paged, paged.kv.pool.traffic, preset, h) for h in (200, 4000)}  # type: ignore[attr-defined]
    old = {h: _step_bytes(onnx, traffic, preset, h) for h in (200, 4000)}
    assert new[200] > 0
    assert abs(new[4000] - new[200]) <= 0.05 * new[200], new
    assert old[4000] > 10 * old[200], old
    assert old[200] > new[200], (old, new)


def _interleaved_pool(device: str, lens: list[tuple[int, int]], block: int) -> tuple[KvPool, list[int]]:
    """A pool whose sessions' blocks interleave (reserved a block at a time, in turn), random keys and values."""
    pool = KvPool(PoolShape(1, 2, 32, block), 64, device=device)
    pool.key[0][:-1].normal_()
    pool.value[0][:-1].normal_()
    seqs = [pool.open(1) for _ in lens]
    for grow in range(1, max(p + c for p, c in lens) + 1, block):
        for seq, (past, count) in zip(seqs, lens, strict=True):
            pool.reserve(seq, min(grow, past + count))
    pool.flush()
    return pool, seqs


@pytest.mark.parametrize("device", DEVICES)
def test_the_flex_backend_attends_as_the_gather_does(device: str) -> None:
    """Three rows (3 new tokens on 5, 1 on 40 blocks' worth, 20 on 17) whose blocks interleave in the pool, as a
    varlen forward; then one token a row on the same sessions as a static decode batch of a bucket of 4 rows (the
    fourth idle: the trash block) and the pool's whole table width: torch's flex_attention over the pool with its
    block mask from the tables and the pool's owner / logical maps (compiled on CUDA, unfused on the CPU) gives the
    reference gather's output."""
    torch.manual_seed(0)
    block = 16 if device == "cpu" else 128
    lens = list(zip([5, 40 * block // 16, 17], [3, 1, 20], strict=True))
    pool, seqs = _interleaved_pool(device, lens, block)
    seq_t = torch.tensor(seqs, device=device)
    width = max(pool.shape.blocks_for(p + c) for p, c in lens)
    rows = Rows(pool.device_tables[seq_t, :width], [p for p, _ in lens], [c for _, c in lens], seq=seq_t)
    q = torch.randn(sum(c for _, c in lens), 4, 32, device=device)
    flex = FlexAttention(pool, compiled=device == "cuda")
    tol = {"atol": 2e-3 if device == "cuda" else 1e-5, "rtol": 0}
    torch.testing.assert_close(flex(q, pool.key[0], pool.value[0], rows),
                               GatherAttention()(q, pool.key[0], pool.value[0], rows), **tol)
    idle = torch.tensor([pool.trash_seq], device=device)
    seq4 = torch.cat([seq_t, idle])
    table = pool.device_tables.index_select(0, seq4)  # the whole width: the trash block past each row's blocks
    length = torch.tensor([p + c for p, c in lens] + [1], device=device)
    decode = Decode(table, length, seq4)
    q = torch.randn(4, 4, 32, device=device)
    got = flex(q, pool.key[0], pool.value[0], decode)
    torch.testing.assert_close(got, GatherAttention()(q, pool.key[0], pool.value[0], decode), **tol)
    assert torch.isfinite(got).all()


def test_export_prints_the_pool_n_sessions_need() -> None:
    """`python -m export`'s memory report: the LLM pool for N sessions after 60 s and 300 s, bf16 and fp8; fp8
    halves bf16, and 128 sessions at 60 s hold 128 x (30% speaking, 70% listening) sessions' tokens."""
    from export.memory import FP8, pool_bytes, pool_report
    from export.presets import minicpmo45

    real = minicpmo45()
    token = 2 * real.llm.layers * real.llm.kv_heads * real.llm.head_dim * 2
    assert pool_bytes(real, 128, 60, 2) == 38 * 60 * (13 + 20) * token + 90 * 60 * 13 * token
    assert pool_bytes(real, 128, 60, FP8) * 2 == pool_bytes(real, 128, 60, 2)
    report = "\n".join(pool_report(real))
    assert "128" in report and "300 s" in report and "bf16 / fp8" in report


def test_an_fp8_pool_holds_four_times_the_tokens_and_stays_close(preset, weights) -> None:
    """`kv_dtype=fp8`: the same pool budget holds 4x an fp32 pool's tokens (2x bf16's); keys and values stored in
    e4m3 move the logits of a 30-token prefill by a few percent of their range, no more."""
    rng = np.random.default_rng(0)
    rows = [Prefill(rng.integers(0, preset.llm.vocab, n), np.zeros((0, preset.llm.hidden), np.float32),
                    np.zeros(n, bool)) for n in (30, 7)]
    logits, blocks = {}, {}
    for kv in ("auto", "fp8"):
        eng = paged_engine(preset, weights, kv_dtype=kv)
        seqs = [eng.pool.open(64) for _ in rows]
        logits[kv] = eng.core.runner.logits(seqs, [0, 0], rows)
        blocks[kv] = eng.pool.num_blocks
    assert abs(blocks["fp8"] - 4 * blocks["auto"]) < 4  # the budget divided in whole blocks
    scale = logits["auto"].abs().max().item()
    assert 0 < (logits["fp8"] - logits["auto"]).abs().max().item() < 0.05 * scale


class Greedy:
    """A row's rules: greedy, nothing forbidden, no penalty, `n` tokens, each fed (the device's rules agree: no
    terminator among the tokens this test's rows choose)."""

    def __init__(self, n: int, vocab: int) -> None:
        from minicpmo_triton.engine.protocol import DUPLEX, LlmRow

        self.n, self.tokens = n, []
        self.row = LlmRow(DUPLEX, 0.0, 0, 1.0, 1.0, 1.0, n + 1, [], [], True, np.zeros(0))

    n_hidden = 0

    def confirm(self, token: int, flags: int) -> bool:
        self.tokens.append(token)
        return len(self.tokens) < self.n

    def done(self) -> None:
        pass


def test_a_session_admitted_mid_decode_joins_the_running_batch(preset, weights) -> None:
    """In-flight batching in the core: a session whose 20-token prefill arrives while another decodes joins the
    next iteration, its prefill beside the other's one-token step; both decide exactly what they decide alone, and
    the pair takes 3 + 12 iterations (14 with the overlapped one), not 12 + 12."""
    rng = np.random.default_rng(3)
    prompts = [Prefill(rng.integers(0, 256, n), np.zeros((0, preset.llm.hidden), np.float32), np.zeros(n, bool))
               for n in (9, 20)]

    def core() -> Any:  # nothing forbidden: the rows' tokens are their greedy argmax
        kv = paged_engine(preset, weights)
        kv.core.runner.head.forbidden.zero_()
        return kv

    alone, iterations = [], 0
    for i, prompt in enumerate(prompts):
        kv = core()
        req = Request(i, kv.pool.open(64), 0, prompt, Greedy(12, preset.llm.vocab))
        kv.core.run([req])
        alone.append(req.rules.tokens)
        iterations += kv.core.iterations
    kv = core()
    first = Request(0, kv.pool.open(64), 0, prompts[0], Greedy(12, preset.llm.vocab))
    kv.core.add(first)
    kv.core.step()
    kv.core.step()
    second = Request(1, kv.pool.open(64), 0, prompts[1], Greedy(12, preset.llm.vocab))
    kv.core.add(second)
    while kv.core.has_work:
        kv.core.step()
    assert [first.rules.tokens, second.rules.tokens] == alone
    assert (first.length, second.length) == (9 + 11, 20 + 11)  # the last token of each is decided, not fed
    assert second.join_iteration == 2 and kv.core.iterations <= 3 + 12 < iterations


@pytest.mark.parametrize("chat", [False, True])
def test_broken_logits_are_a_numeric_error_on_the_device_too(preset, weights, chat: bool) -> None:
    """As the host's `check_finite`: a row whose logits hold NaN is flagged by the device's rules and its host rules
    make it a coded error, never a token; the other row chooses."""
    kv = paged_engine(preset, weights)
    st = stage(preset, kv)
    calls = [StageCall(chunk(preset, c, 0, chat=chat, temperature=t), c, start=True) for c, t in ((1, 0.0), (2, 0.7))]
    for call in calls:
        st.enter(call)
    rows = [st.prepare(call.request, st.store.get(call.corr_id), call.request.embeds.reshape(-1, preset.llm.hidden))
            for call in calls]
    head, runner = kv.core.runner.head, kv.core.runner
    head.admit([0, 1], [r.row for _, r in rows])
    kv.pool.flush()
    raw = torch.zeros(2, preset.llm.vocab)
    raw[1, 97] = float("nan")  # "a": a token both rule sets allow (a masked one's NaN is -inf to them, as on the host)
    head.choose(raw, slice(0, 2), runner.state, torch.ones(2, dtype=torch.bool), runner.topk, chat)
    flags = runner.state.out[:2, 1].tolist()
    assert not flags[0] & NOT_FINITE and flags[1] & NOT_FINITE
    with pytest.raises(StepError) as info:
        rows[1][1].confirm(int(runner.state.out[1, 0]), flags[1])
    assert info.value.code == Code.NUMERIC_ERROR

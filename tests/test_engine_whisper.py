"""The paged streaming Whisper (each session's encoder KV cache in a pool of its own, written in place) against
today's path (the exported `stream.onnx` graph, a host cache per session padded into each batch), on `tiny`: the
same embeddings within 1e-4 chunk by chunk over many chunks, with ragged batches (sessions joining at different
chunks, so different pasts side by side, and chunks of different lengths), the cache's restart before
`max_positions`; the keys in the pool equal to the graph's cache; END and eviction freeing blocks; the pool-full
refusal (coded, retryable) before the batch; the bytes a chunk moves staying flat as the history grows (today's
path, counted the same way, grows). On the CPU and, where one exists, on CUDA (at fp32 weights)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from minicpmo_triton.engine.attention import FlexAttention, GatherAttention, Rows
from minicpmo_triton.engine.build import load_weights
from minicpmo_triton.engine.exported import load_engine
from minicpmo_triton.engine.pool import KvPool, PoolShape
from minicpmo_triton.engine.protocol import PagedCache, pick_engine
from minicpmo_triton.engine.traffic import CountingEngine, Traffic
from minicpmo_triton.engine.whisper import PagedWhisper
from minicpmo_triton.errors import RETRYABLE, Code, StepError
from minicpmo_triton.media.tokenizer import load_tokenizer
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import LlmRequest
from minicpmo_triton.stages.audio_encoder import AudioStream, AudioStreamEncoder
from minicpmo_triton.stages.base import StageCall, _restore, _snapshot
from minicpmo_triton.stages.llm import LlmStage

from .conftest import MODEL_REPOSITORY, ensure_exported

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
FOLDER = MODEL_REPOSITORY / "audio_encoder" / "1"


@pytest.fixture(scope="module")
def preset():
    ensure_exported()
    return load_stage_config(MODEL_REPOSITORY / "llm" / "1")


@pytest.fixture(scope="module")
def weights(preset) -> dict[str, torch.Tensor]:
    """What the export wrote for the paged encoder (`audio_encoder/1/weights.safetensors`): the graph's own."""
    return load_weights(FOLDER, "cpu")


def paged(preset, weights, device: str = "cpu", dims: Any = None, **kw: Any) -> AudioStreamEncoder:
    kw = {"pool_size": 0.01, "attention": "gather", "dtype": torch.float32, **kw}
    whisper = PagedWhisper.build(weights, dims or preset.audio, device=device, **kw)
    return AudioStreamEncoder(whisper, dims or preset.audio, preset.samples_per_audio_token)


def onnx(preset, dims: Any = None, traffic: Traffic | None = None) -> AudioStreamEncoder:
    engine: Any = load_engine(FOLDER, name="stream")
    if traffic is not None:
        engine = CountingEngine(engine, traffic)
    return AudioStreamEncoder(engine, dims or preset.audio, preset.samples_per_audio_token)


def audio(seed: int, seconds: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(16_000 * seconds)
    t = np.arange(n) / 16_000
    return (rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(150, 400) * t)
            + 0.05 * rng.standard_normal(n)).astype(np.float32)


def pool_keys(enc: AudioStreamEncoder, stream: AudioStream, layer: int) -> np.ndarray:
    """A stream's keys gathered from the pool, as the graph's cache holds them: [heads, length, head_dim]."""
    assert isinstance(enc.kv, PagedWhisper) and isinstance(stream.cache, PagedCache)
    pool, cache = enc.kv.pool, stream.cache
    slots = torch.as_tensor(pool.slots(cache.seq, 0, cache.length)).to(pool.device)
    flat = pool.key[layer].view(-1, pool.shape.kv_heads, pool.shape.head_dim)
    return flat[slots].transpose(0, 1).float().cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
def test_embeddings_match_the_onnx_graph_over_many_chunks(preset, weights, device: str) -> None:
    """Four sessions over 14 steps, the cache restarting every few chunks (max_positions 200 here): session 1
    from step 0 with 1 s chunks, 2 from step 2, 3 from step 5 (ragged pasts in one batch), 4 from step 1 with
    0.5 s chunks (a group of its own beside theirs, its restarts at other steps). Every chunk's embeddings are
    the graph's within 1e-4 and the pool holds the graph's keys; both paths restart at the same chunks."""
    dims = dataclasses.replace(preset.audio, max_positions=200)
    ref, new = onnx(preset, dims), paged(preset, weights, device, dims)
    joins = {1: (0, 1.0), 2: (2, 1.0), 3: (5, 1.0), 4: (1, 0.5)}
    streams = {k: {c: AudioStream() for c in joins} for k in ("onnx", "paged")}
    restarts = 0
    for step in range(14):
        live = [c for c, (first, _) in joins.items() if step >= first]
        chunks = {c: audio(100 * c + step, joins[c][1]) for c in live}
        lengths = {c: streams["onnx"][c].cache.length if streams["onnx"][c].cache is not None else 0 for c in live}
        want = ref.run([(chunks[c], streams["onnx"][c]) for c in live])
        for c in live:
            new.reserve(streams["paged"][c], len(chunks[c]))  # as LlmStage.check does
        got = new.run([(chunks[c], streams["paged"][c]) for c in live])
        for c, w, g in zip(live, want, got, strict=True):
            assert g.shape == w.shape == (int(10 * joins[c][1]), preset.llm.hidden)
            np.testing.assert_allclose(g.cpu().numpy(), w, atol=1e-4, err_msg=f"session {c} step {step}")
            o, p = streams["onnx"][c].cache, streams["paged"][c].cache
            assert isinstance(p, PagedCache) and o is not None and p.length == o.length
            restarts += o.length < lengths[c]
            np.testing.assert_allclose(pool_keys(new, streams["paged"][c], 1), o.key[1], atol=1e-4)
    assert restarts >= 6


def test_end_and_eviction_free_the_streams_blocks(preset, weights) -> None:
    """In the LLM stage (where the duplex audio is encoded): two sessions' chunks take blocks; END gives one
    session's back, the idle sweep the other's."""
    enc = paged(preset, weights)
    pool = enc.kv.pool  # type: ignore[attr-defined]
    llm = LlmStage(load_engine(MODEL_REPOSITORY / "llm" / "1"), preset,
                   load_tokenizer(preset, MODEL_REPOSITORY / "duplex" / "1"), 600.0, enc)
    tk = preset.tokens

    def call(corr: int, step: int, **kw: Any) -> StageCall[LlmRequest]:
        req = LlmRequest(input_ids=np.array([tk.unit] + [tk.audio_placeholder] * 10, np.int64),
                         audio=audio(corr * 10 + step), temperature=0.0, max_new_tokens=2, seed=corr)
        return StageCall(req, corr, start=step == 0, **kw)

    for step in range(3):
        assert not any(isinstance(r, Exception) for r in llm.run([call(1, step), call(2, step)]))
    assert len(pool.tables) == 2 and pool.free_blocks < pool.num_blocks
    llm.run([StageCall(LlmRequest(decode=False), 1, end=True)])
    assert len(pool.tables) == 1
    llm.store.ttl_s = -1.0
    assert llm.store.evict_expired() == [2]
    assert pool.free_blocks == pool.num_blocks and not pool.tables


def test_a_full_pool_refuses_before_the_batch_with_a_retryable_code(preset, weights) -> None:
    """A pool of 6 blocks of 16 frames: a session is admitted with room for one chunk (50 frames, 4 blocks), so
    a second session is refused at its reserve (pool_full, retryable) and so is the first one's second chunk;
    once the second session's blocks are back, both go on. Nothing is written before the refusal."""
    enc = paged(preset, weights, pool_tokens=6 * 16)
    pool = enc.kv.pool  # type: ignore[attr-defined]
    a, b = AudioStream(), AudioStream()
    enc.reserve(a, 16_000)
    with pytest.raises(StepError) as refused:
        enc.reserve(b, 16_000)
    assert refused.value.code == Code.POOL_FULL and refused.value.code in RETRYABLE and b.cache is None
    enc.run([(audio(1), a)])
    with pytest.raises(StepError) as grown:
        enc.reserve(a, 16_000)
    assert grown.value.code == Code.POOL_FULL and a.cache == PagedCache(0, 50)
    enc.release(a)
    assert pool.free_blocks == pool.num_blocks
    enc.reserve(b, 16_000)
    assert enc.run([(audio(2), b)])[0].shape == (10, preset.llm.hidden)


def _chunk_bytes(enc: AudioStreamEncoder, traffic: Traffic, history: int) -> int:
    """Bytes host<->device of one 1 s chunk of a session `history` chunks in."""
    stream = AudioStream()
    for i in range(history):
        enc.reserve(stream, 16_000)
        enc.run([(audio(i), stream)])
    traffic.reset()
    enc.reserve(stream, 16_000)
    enc.run([(audio(history), stream)])
    enc.release(stream)
    return traffic.total()


def test_bytes_per_chunk_stay_flat_as_the_history_grows(preset, weights) -> None:
    """Counted the same way (every feed in, every output out): today's graph takes the session's whole cache in
    and gives it back grown, so a chunk 20 chunks in costs several times one 2 chunks in; the paged encoder moves
    the chunk's mel, its positions and slots and the embeddings, the same at 2 and 20."""
    traffic = Traffic()
    old_enc, new_enc = onnx(preset, traffic=traffic), paged(preset, weights)
    new = {h: _chunk_bytes(new_enc, new_enc.kv.traffic, h) for h in (2, 20)}  # type: ignore[attr-defined]
    old = {h: _chunk_bytes(old_enc, traffic, h) for h in (2, 20)}
    print(f"bytes per 1 s chunk, tiny: onnx {old}, paged {new}")
    assert new[2] > 0
    assert abs(new[20] - new[2]) <= 0.05 * new[2], new
    assert old[20] > 4 * old[2], old
    assert old[2] > new[2], (old, new)


@pytest.mark.parametrize("device", DEVICES)
def test_the_flex_backend_attends_non_causally_as_the_gather_does(device: str) -> None:
    """A chunk's frames see each other and their row's past (an encoder's rows): flex's mask as the gather's."""
    torch.manual_seed(0)
    block = 16 if device == "cpu" else 128
    pool = KvPool(PoolShape(1, 4, 16, block), 32, device=device)
    pool.key[0][:-1].normal_()
    pool.value[0][:-1].normal_()
    lens = [(0, 25), (50, 25), (100, 25)]
    seqs = [pool.open(1) for _ in lens]
    for seq, (past, count) in zip(seqs, lens, strict=True):
        pool.reserve(seq, past + count)
    pool.flush()
    seq_t = torch.tensor(seqs, device=device)
    width = max(pool.shape.blocks_for(p + c) for p, c in lens)
    rows = Rows(pool.device_tables[seq_t, :width], [p for p, _ in lens], [c for _, c in lens], causal=False,
                seq=seq_t)
    q = torch.randn(sum(c for _, c in lens), 4, 16, device=device)
    ref = GatherAttention()(q, pool.key[0], pool.value[0], rows)
    got = FlexAttention(pool, compiled=device == "cuda")(q, pool.key[0], pool.value[0], rows)
    torch.testing.assert_close(got, ref, atol=2e-3 if device == "cuda" else 1e-5, rtol=0)
    causal = GatherAttention()(q, pool.key[0], pool.value[0], dataclasses.replace(rows, causal=True))
    assert (causal - ref).abs().max() > 1e-3  # the flag changes what the rows see


def test_audio_engine_choice() -> None:
    assert pick_engine("auto", True, "audio_engine") == "paged"
    assert pick_engine("auto", False, "audio_engine") == "onnx"
    with pytest.raises(ValueError, match="audio_engine"):
        pick_engine("trt", False, "audio_engine")


def test_export_prints_the_whisper_pool_n_sessions_need() -> None:
    """`python -m export`'s pool table has the Whisper's: its bound is 30 s of encoder frames a session
    (`max_positions`, where the stream restarts), whatever the session's age or whether it speaks."""
    from export.memory import BF16, pool_bytes, pool_report
    from export.presets import minicpmo45

    real = minicpmo45()
    a = real.audio
    bound = 128 * a.max_positions * 2 * a.layers * a.d_model * BF16
    assert pool_bytes(real, 128, 60, BF16, "audio_encoder") == pool_bytes(real, 128, 300, BF16, "audio_encoder")
    assert pool_bytes(real, 128, 60, BF16, "audio_encoder") == bound
    assert "Whisper KV pool" in "\n".join(pool_report(real))


def test_a_stream_undone_after_its_restart_restarts_again(preset, weights) -> None:
    """A failed row is undone (`base._restore`: the stream's fields as they were). Undone after a chunk that
    restarted the cache, its old length would lie over frames the restart rewrote: its next chunk restarts instead,
    as the graph's path does from an empty cache with the same mel stream (not the same as never failing, but
    never attention over overwritten frames)."""
    dims = dataclasses.replace(preset.audio, max_positions=200)  # 3 chunks of 50, the 4th restarts
    new, ref = paged(preset, weights, dims=dims), onnx(preset, dims)
    stream = AudioStream()
    for i in range(3):
        new.reserve(stream, 16_000)
        new.run([(audio(i), stream)])
    before = _snapshot(stream)
    new.reserve(stream, 16_000)
    new.run([(audio(3), stream)])
    assert stream.cache == PagedCache(0, 50)  # restarted
    _restore(stream, before)
    assert stream.cache == PagedCache(0, 150)
    twin = AudioStream(mel=copy.deepcopy(stream.mel))  # the graph's path from an empty cache, the same mel stream
    chunk = audio(9, 0.5)
    new.reserve(stream, len(chunk))
    got = new.run([(chunk, stream)])[0]
    assert stream.cache == PagedCache(0, 25)
    np.testing.assert_allclose(got.cpu().numpy(), ref.run([(chunk, twin)])[0], atol=1e-4)


def test_the_device_mel_is_the_host_streams(preset) -> None:
    """The duplex stream's mel on the device (engine/mel.py: every row's frames through one `torch.fft.rfft`, the
    floor's maxima kept on the device) against `MelStream.push` on the host, chunk for chunk: three streams joining
    at different chunks (one in 0.5 s chunks), 40 chunks, past the 5 s floor and the 30 s slide, batched together."""
    from minicpmo_triton.engine.mel import DeviceMel
    from minicpmo_triton.engine.staging import DeviceWrites, Staging
    from minicpmo_triton.media.audio_mel import MelStream, mel_filterbank

    filters = mel_filterbank(preset.audio.n_mels)
    device = DeviceMel(filters, DeviceWrites(Staging(torch.device("cpu"), Traffic())))
    joins = {1: (0, 1.0), 2: (3, 1.0), 3: (1, 0.5)}
    host = {c: MelStream() for c in joins}
    dev = {c: MelStream() for c in joins}
    compared = 0
    for step in range(40):
        live = [c for c, (first, _) in joins.items() if step >= first]
        chunks = {c: audio(10 * c + step, joins[c][1]) for c in live}
        got = device.push([(dev[c], chunks[c]) for c in live])
        for c, g in zip(live, got, strict=True):
            want = host[c].push(chunks[c], filters)
            assert g.first == want.first
            np.testing.assert_allclose(g.mel.numpy(), want.mel, atol=1e-6, rtol=0, err_msg=f"stream {c} step {step}")
            np.testing.assert_allclose(dev[c].maxima.numpy(), host[c].maxima, atol=1e-9, rtol=0)
            compared += 1
    assert host[1].base_frame > 0, "the 30 s slide was crossed"
    assert compared == 40 + 37 + 39

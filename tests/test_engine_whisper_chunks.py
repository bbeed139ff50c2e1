"""The streaming Whisper's fixed-shape chunk (engine/whisper_chunks.py: rows padded to a bucket, 50 encoder frames a
row, a short chunk padded and masked, every per-call input in persistent device buffers written by one staging copy),
on `tiny`'s exported weights: its embeddings and pool writes are the varlen forward's (host lists, packed rows)
within 1e-5 for ragged rows on both attention backends; the step makes the host wait for nothing (engine/syncs.py's
ledger) and reads and writes the same storages every call of a (bucket, width) key -- what its CUDA graph replays;
on CUDA, the graph's replays give the eager step's embeddings (skipped without a GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from minicpmo_triton.engine.build import load_weights
from minicpmo_triton.engine.syncs import SyncLedger
from minicpmo_triton.engine.whisper import PagedWhisper
from minicpmo_triton.model_config import load_stage_config

from .conftest import MODEL_REPOSITORY, ensure_exported
from .test_engine_core import Storages
from .test_engine_whisper import FOLDER, preset, weights

__all__ = ["preset", "weights"]  # the fixtures, used by name
pytestmark = pytest.mark.engines  # the device engine on the CPU: a .ci/run step of its own (-m engines)

def chunk_pair(preset, weights, attention: str, device: str = "cpu", **kw: Any) -> tuple[PagedWhisper, PagedWhisper]:
    """Two encoders over the same weights, their pools handed out alike: one runs the padded path, one the varlen."""
    build = {"pool_tokens": 4 * 512, "max_sessions": 4, "attention": attention, "dtype": torch.float32,
             "device": device, **kw}
    return PagedWhisper.build(weights, preset.audio, **build), PagedWhisper.build(weights, preset.audio, **build)


def chunk_rows(preset, rng: np.random.Generator, rows: list[tuple[bool, int]]) -> tuple[list[np.ndarray], list[int],
                                                                                        np.ndarray, np.ndarray]:
    """Rows of `count` encoder frames each (first: no left context): each row's mel, its first real frame in the
    group's layout, and the varlen path's input (each row at the end of the group's frames, the rest masked)."""
    count = rows[0][1]
    frames = 2 * count + 4
    mels = [rng.standard_normal((preset.audio.n_mels, frames - (2 if first else 0))).astype(np.float32)
            for first, _ in rows]
    lo = [frames - m.shape[1] for m in mels]
    mel = np.zeros((len(rows), preset.audio.n_mels, frames), np.float32)
    mask = np.ones((len(rows), frames), bool)
    for r, m in enumerate(mels):
        mel[r, :, lo[r]:] = m
        mask[r, : lo[r]] = False
    return mels, lo, mel, mask


# each step: groups of rows (session, first chunk, encoder frames); a group shares its frames, as the stage's groups
CHUNK_SCRIPT = [
    [[(0, True, 50)]],
    [[(0, False, 50), (1, True, 50)]],  # ragged pasts side by side
    [[(0, False, 50), (1, False, 50), (2, True, 50), (3, True, 50)]],
    # 0 restarts; 3 rows in the bucket of 4 (its padded row must not redo the last call's row 3); 3 goes on in 0.5 s
    [[(0, True, 50), (1, False, 50), (2, False, 50)], [(3, False, 25)]],
    [[(1, False, 25), (2, False, 25), (3, False, 25)], [(0, False, 50)]],  # short last chunks beside a full one
]


@pytest.mark.parametrize("attention", ["gather", "flex"])
def test_the_padded_chunk_is_the_varlen_forward(preset, weights, attention: str) -> None:
    """The fixed-shape step (rows padded to a bucket, 50 frames a row, a short chunk padded and masked, a first
    chunk's left context masked) against the varlen forward over host lists, same weights, same pool layout: the
    embeddings within 1e-5 for ragged rows (sessions at different pasts, a stream restarting, 0.5 s chunks) and the
    pools holding the same keys."""
    padded, varlen = chunk_pair(preset, weights, attention)
    rng = np.random.default_rng(0)
    seqs = [[enc.pool.open(50) for _ in range(4)] for enc in (padded, varlen)]
    past = [0] * 4
    for step, groups in enumerate(CHUNK_SCRIPT):
        for group in groups:
            for s, first, _ in group:
                if first:
                    past[s] = 0
                    for enc, seq in zip((padded, varlen), seqs, strict=True):
                        enc.pool.truncate(seq[s], 0)
            mels, lo, mel, mask = chunk_rows(preset, rng, [(first, n) for _, first, n in group])
            rows, pasts, count = [s for s, _, _ in group], [past[s] for s, _, _ in group], group[0][2]
            got = padded.forward_chunks([seqs[0][s] for s in rows], pasts, mels, lo, count)
            want = varlen.forward([seqs[1][s] for s in rows], pasts, mel, mask)
            assert got.shape == want.shape == (len(rows), count // preset.audio.pool, preset.llm.hidden)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"step {step} rows {rows}")
            for s in rows:
                past[s] += count
    for s in range(4):
        for layer in range(preset.audio.layers):
            keys = [enc.pool.key[layer].view(-1, enc.pool.shape.kv_heads, enc.pool.shape.head_dim)[
                torch.as_tensor(enc.pool.slots(seq[s], 0, past[s]))] for enc, seq in zip((padded, varlen), seqs,
                                                                                          strict=True)]
            torch.testing.assert_close(keys[0], keys[1], atol=1e-5, rtol=0)


def test_the_chunk_step_waits_for_nothing_and_reads_the_same_storages(preset, weights) -> None:
    """Over chunks of a bucket (3 and 4 rows: one key, the pasts growing), the step makes the host wait for nothing
    (the sync ledger: no `item`, no boolean indexing, no upload from Python data, no download) and reads and writes
    the same storages every call, all of them the encoder's persistent ones (the batch's buffers, the pool, the
    weights): what a CUDA graph of the step replays. The gather's (torch's dispatch modes cannot look inside eager
    flex_attention on the CPU; flex's step is held by its CUDA graph's capture, which fails on a sync)."""
    enc = chunk_pair(preset, weights, "gather")[0]
    step = enc._chunk_step
    seen: list[tuple[Any, set[int], int]] = []

    def recorded(*key: Any) -> None:
        storages = Storages()
        with SyncLedger() as ledger, storages:
            step(*key)
        seen.append((key, storages.used, ledger.total))

    enc._chunk_step = recorded  # type: ignore[method-assign, assignment]
    seqs = [enc.pool.open(200) for _ in range(4)]
    rng = np.random.default_rng(1)
    for n in (3, 4, 3, 4):
        mels, lo, _, _ = chunk_rows(preset, rng, [(False, 50)] * n)
        device_mels = [torch.as_tensor(m) for m in mels]  # as the device mel hands them over
        with SyncLedger() as call:
            enc.forward_chunks(seqs[:n], [100 + 5 * len(seen)] * n, device_mels, lo, 50)  # pasts of one width
        assert call.total == 0, dict(call.counts)  # the call's host side too: one staging copy, no upload
    assert {key for key, _, _ in seen} == {(4, 16)}  # 4 rows; 150-165 frames: 10-11 blocks, bucketed
    assert [syncs for _, _, syncs in seen] == [0] * 4
    persistent = {t.untyped_storage().data_ptr() for t in [
        *enc.net.parameters(), *enc.pool.key, *enc.pool.value, enc.pool.device_tables, enc.pool.owner,
        enc.pool.logical, *(v for v in vars(enc.chunks).values() if isinstance(v, torch.Tensor))]}
    used = [u for _, u, _ in seen]
    assert all(u == used[0] for u in used[1:])
    assert used[0] <= persistent, "the step read a storage that is not one of the encoder's persistent buffers"
    assert enc.chunks.meta.untyped_storage().data_ptr() in used[0]
    assert enc.chunks.embeds.untyped_storage().data_ptr() in used[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_the_chunk_graphs_replay_the_eager_step() -> None:
    """On CUDA (flex compiled, as served): the chunk step captured as a CUDA graph per (bucket, width) and replayed
    gives the eager step's embeddings, call after call, ragged pasts, a bucket's padded rows."""
    ensure_exported()
    preset = load_stage_config(MODEL_REPOSITORY / "llm" / "1")
    weights = load_weights(FOLDER, "cuda")
    graphed, eager = (chunk_pair(preset, weights, "flex", "cuda", graphs=g)[0] for g in (True, False))
    rng = np.random.default_rng(2)
    seqs = [[enc.pool.open(300) for _ in range(3)] for enc in (graphed, eager)]
    for call in range(5):
        mels, lo, _, _ = chunk_rows(preset, rng, [(call == 0, 50)] * 3)
        pasts = [50 * call + 50 * r for r in range(3)] if call else [0, 0, 0]
        got = graphed.forward_chunks(seqs[0], pasts, [torch.as_tensor(m, device="cuda") for m in mels], lo, 50)
        want = eager.forward_chunks(seqs[1], pasts, [torch.as_tensor(m, device="cuda") for m in mels], lo, 50)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"call {call}")
    assert graphed.graphs is not None and graphed.graphs.captures >= 1 and graphed.graphs.replays >= 3

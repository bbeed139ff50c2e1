"""Each stage exported to ONNX matches PyTorch, and the served artefacts are the tiny preset's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.onnx_export import check_parity, export_onnx
from export.presets import TINY_SEED, tiny
from export.stages import STAGE_NAMES, build_modules, stage_graphs
from minicpmo_triton.model_config import load_stage_config

from .conftest import MODEL_REPOSITORY, ensure_exported


@pytest.fixture(scope="module")
def graphs():
    return {g.name: g for g in stage_graphs(tiny(), build_modules(tiny(), TINY_SEED))}


# audio_encoder also holds the streaming graph; token2wav exports three (token2wav/1/{encoder,estimator,vocoder}.onnx)
GRAPH_NAMES = (*(s for s in STAGE_NAMES if s != "token2wav"), "audio_encoder_stream", "token2wav_encoder",
               "token2wav_estimator", "token2wav_vocoder")


@pytest.mark.parametrize("stage", GRAPH_NAMES)
def test_fresh_export_matches_pytorch(graphs, stage: str, tmp_path: Path) -> None:
    path = tmp_path / f"{stage}.onnx"
    export_onnx(graphs[stage], path)
    result = check_parity(graphs[stage], path)
    assert result.ok, f"{stage}: max |ort - torch| = {result.max_abs_diff}"
    assert result.max_abs_diff < 1e-4


@pytest.mark.parametrize("stage", GRAPH_NAMES)
def test_served_artefacts_are_the_tiny_preset(graphs, stage: str) -> None:
    ensure_exported()
    graph = graphs[stage]
    result = check_parity(graph, MODEL_REPOSITORY / graph.folder / "1" / graph.file, seed=7)
    assert result.ok, f"{stage}: the model repository's ONNX differs from the tiny preset ({result.max_abs_diff})"
    assert load_stage_config(MODEL_REPOSITORY / graph.folder / "1") == tiny()


def test_llm_graph_handles_an_empty_past_and_padded_rows(graphs) -> None:
    """The first prefill has no past; rows of a batch have different past lengths."""
    ensure_exported()
    d = tiny().llm
    sess = ort.InferenceSession(str(MODEL_REPOSITORY / "llm" / "1" / "model.onnx"))
    ids = np.array([[5, 6, 7], [8, 9, 10]], np.int64)
    feeds = {"input_ids": ids, "embeds": np.zeros((2, 3, d.hidden), np.float32), "use_embeds": np.zeros((2, 3), bool),
             "position_ids": np.tile(np.arange(3), (2, 1)), "past_mask": np.zeros((2, 0), bool),
             "past_key": np.zeros((d.layers, 2, d.kv_heads, 0, d.head_dim), np.float32),
             "past_value": np.zeros((d.layers, 2, d.kv_heads, 0, d.head_dim), np.float32),
             "last_index": np.array([2, 1])}
    logits, hidden, key, _ = sess.run(None, feeds)
    assert key.shape == (d.layers, 2, d.kv_heads, 3, d.head_dim)
    with torch.no_grad():
        ref = graphs["llm"].module(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    np.testing.assert_allclose(logits, ref[0].numpy(), atol=1e-4)

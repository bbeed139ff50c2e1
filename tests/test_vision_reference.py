"""The vision stage against its references, not against itself.

- `vpm.*`: transformers' SiglipVisionModel (PyPI). Its positions are NaViT's for a slice the size of the
  position table; for other grids the reference NaViT embedding (below) feeds SigLIP's own encoder layers.
- What PyPI has no reference for is MiniCPM-o 4.5's own code (OpenBMB/MiniCPM-o-Demo @28b60cf, vendored
  unchanged under tests/reference_code/), run as is: MiniCPMO45/modeling_navit_siglip.py
  `SiglipVisionEmbeddings` (NaViT positions), modeling_minicpmo_unified.py `Resampler` (its 2D sin-cos
  table), and processing_minicpmo.py `MiniCPMVImageProcessor` (slicing, normalizing, `reshape_by_patch`).
The checkpoint is written under the real names, loaded through export.checkpoint, exported to ONNX and
run with ONNX Runtime.
"""

from __future__ import annotations

import functools
import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from export.checkpoint import load_checkpoint
from export.config import preset_from_config
from export.modules.vision import VisionEncoder
from export.onnx_export import export_onnx
from export.presets import minicpmo45
from export.stages import vision_graph
from minicpmo_triton.media.images import ImageError, image_slices, navit_position_ids, slice_grid

from .reference_demo import demo_module

LLM_HIDDEN = 256  # resampler: 2 heads of 128
CONFIG = {  # the real config.json's vision keys at a CPU test's size; the table is 16x16 patches
    "hidden_size": LLM_HIDDEN, "query_num": 64, "image_size": 448, "drop_vision_last_layer": True,
    "slice_config": {"max_slice_nums": 9, "patch_size": 14, "scale_resolution": 448},
    "vision_config": {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 64,
                      "image_size": 224, "patch_size": 14, "model_type": "siglip"},
}
TOLERANCE = 1e-4


# ---- the reference, run as published (tests/reference_code/MiniCPMO45/, tests/reference_demo.py) ----

def image_processor() -> Any:
    """`MiniCPMVImageProcessor` (processing_minicpmo.py:125-407) at preprocessor_config.json's values: slicing
    (`get_sliced_grid`, `slice_image`), normalizing and `reshape_by_patch`."""
    return demo_module("processing_minicpmo").MiniCPMVImageProcessor(max_slice_nums=9, scale_resolution=448,
                                                                     patch_size=14)


def reference_resampler(num_queries: int, embed_dim: int, kv_dim: int) -> nn.Module:
    """modeling_minicpmo_unified.py:5625 `Resampler` (its 2D sin-cos table from `get_2d_sincos_pos_embed`,
    :5574), built as `MiniCPMO.init_resampler` does: a head per 128 channels. Its queries start at zero;
    drawn here, so that each query attends differently."""
    resampler = demo_module("modeling_minicpmo_unified").Resampler(num_queries, embed_dim, max(1, embed_dim // 128),
                                                                    kv_dim)
    with torch.no_grad():
        resampler.query.normal_(0, 0.02)
    return resampler


def reference_embeddings(vision_config: dict[str, Any]) -> nn.Module:
    """modeling_navit_siglip.py:303 `SiglipVisionEmbeddings`: patches plus NaViT's positions, bucketed onto the
    position table per slice (`forward`, :324-369)."""
    navit = demo_module("modeling_navit_siglip")
    return navit.SiglipVisionEmbeddings(navit.SiglipVisionConfig(**vision_config)).eval()


@functools.cache
def position_reader(side: int) -> nn.Module:
    """`SiglipVisionEmbeddings` on a side x side table whose output is the position id: a one-channel patch
    embedding of zeros, and a position table that holds each id as its embedding. Patches of one pixel: the
    positions depend on the patch counts only, and the convolution costs nothing."""
    embeddings = reference_embeddings({"hidden_size": 1, "image_size": side, "patch_size": 1, "num_channels": 1})
    with torch.no_grad():
        embeddings.patch_embedding.weight.zero_()
        embeddings.patch_embedding.bias.zero_()
        embeddings.position_embedding.weight.copy_(torch.arange(side * side, dtype=torch.float32)[:, None])
    return embeddings


def ref_navit_position_ids(rows: int, cols: int, side: int) -> list[int]:
    """The position ids `SiglipVisionEmbeddings.forward` gives a slice of rows x cols patches."""
    with torch.no_grad():  # the reference's layout: a slice's patches side by side in one row (`reshape_by_patch`)
        out = position_reader(side)(torch.zeros(1, 1, 1, rows * cols),
                                    torch.ones(1, 1, rows * cols, dtype=torch.bool),
                                    torch.tensor([[rows, cols]], dtype=torch.int32))
    return out[0, :, 0].round().long().tolist()


def ref_preprocess(data: bytes, max_slice_nums: int) -> list[tuple[np.ndarray, tuple[int, int]]]:
    """`MiniCPMVImageProcessor.preprocess` (processing_minicpmo.py:348-404): each slice's patches and its
    (rows, cols), overview first."""
    out = image_processor().preprocess(Image.open(io.BytesIO(data)), max_slice_nums=max_slice_nums)
    [pixels], [tgt_sizes] = out["pixel_values"], out["tgt_sizes"]
    return [(p, (int(r), int(c))) for p, (r, c) in zip(pixels, tgt_sizes, strict=True)]


# ---- fixtures ----

def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """SiglipVisionModel + the reference resampler, saved as a checkpoint under the real names."""
    from safetensors.torch import save_file
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(7)
    v = CONFIG["vision_config"]
    used = v["num_hidden_layers"] - 1  # drop_vision_last_layer: the checkpoint holds the layers that run
    siglip = SiglipVisionModel(SiglipVisionConfig(**{**v, "num_hidden_layers": used}, layer_norm_eps=1e-6,
                                                  vision_use_head=False, attn_implementation="eager")).eval()
    resampler = reference_resampler(CONFIG["query_num"], LLM_HIDDEN, v["hidden_size"]).eval()
    with torch.no_grad():  # LayerNorms away from 1/0, so a swapped or missing one shows
        for m in [*siglip.modules(), *resampler.modules()]:
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    tensors = {"vpm." + k.removeprefix("vision_model."): t for k, t in siglip.state_dict().items()}
    tensors |= {"resampler." + k: t for k, t in resampler.state_dict().items()}
    folder = tmp_path_factory.mktemp("vision_ckpt")
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder, siglip, resampler


@pytest.fixture(scope="module")
def onnx_session(reference):
    import onnxruntime as ort

    folder = reference[0]
    preset = preset_from_config(minicpmo45(), json.loads((folder / "config.json").read_text()))
    module = VisionEncoder(preset.vision, preset.llm.hidden)
    loaded = load_checkpoint(folder, {"vision_encoder": module}, preset, require=("vision_encoder",))
    assert loaded == ["vision_encoder"]
    path = folder / "onnx" / "model.onnx"
    export_onnx(vision_graph(preset.vision, module), path)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), preset.vision


def _run(session, pixels: torch.Tensor, tgt_sizes: list[tuple[int, int]], table_side: int) -> np.ndarray:
    position_ids = np.zeros((len(tgt_sizes), pixels.shape[-1] // 14), np.int64)
    for i, (r, c) in enumerate(tgt_sizes):
        position_ids[i, : r * c] = navit_position_ids(r, c, table_side)
    return session.run(["embeds"], {"pixels": pixels.numpy(), "position_ids": position_ids,
                                    "tgt_sizes": np.array(tgt_sizes, np.int64)})[0]


# ---- tests ----

def test_config_keys_set_the_vision_dims() -> None:
    d = preset_from_config(minicpmo45(), CONFIG).vision
    assert (d.image_size, d.table_side, d.scale_resolution, d.layers, d.eps) == (224, 16, 448, 2, 1e-6)
    assert d.resampler_heads == 2 and d.queries == 64
    real = minicpmo45().vision
    assert (real.image_size, real.table_side, real.scale_resolution, real.layers, real.d_model) == (
        980, 70, 448, 26, 1152)


def test_a_full_table_slice_matches_siglip(reference, onnx_session) -> None:
    """A square slice the table's size: NaViT's positions are SigLIP's, so SiglipVisionModel is the reference."""
    _, siglip, resampler = reference
    session, d = onnx_session
    side = d.table_side
    assert navit_position_ids(side, side, side).tolist() == list(range(side * side))
    image = torch.rand(1, 3, side * 14, side * 14, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        hidden = siglip(pixel_values=image).last_hidden_state
        expected = resampler(hidden, torch.tensor([[side, side]])).numpy()
    pixels = torch.from_numpy(image_processor().reshape_by_patch(image[0].numpy()))[None]
    got = _run(session, pixels, [(side, side)], side)
    diff = float(np.abs(got - expected).max())
    print(f"vision_encoder: ONNX vs SiglipVisionModel + reference resampler, max abs diff {diff:.3g} "
          f"(tolerance {TOLERANCE:g})")
    assert diff <= TOLERANCE


def test_a_padded_batch_of_grids_matches_navit(reference, onnx_session) -> None:
    """Slices of different grids (one past the table's side) in one padded batch: the reference NaViT
    embedding, SigLIP's own encoder layers under the reference's key mask, then the reference resampler."""
    _, siglip, resampler = reference
    session, d = onnx_session
    grids = [(16, 16), (5, 9), (12, 7), (3, 40), (1, 1)]
    tgt = torch.tensor(grids, dtype=torch.int32)
    length = max(r * c for r, c in grids)
    g = torch.Generator().manual_seed(4)
    slices = [torch.rand(3, r * 14, c * 14, generator=g) * 2 - 1 for r, c in grids]
    reshape_by_patch = image_processor().reshape_by_patch
    flat = [torch.from_numpy(reshape_by_patch(s.numpy())).flatten(end_dim=1).permute(1, 0) for s in slices]
    pixels = torch.nn.utils.rnn.pad_sequence(flat, batch_first=True).permute(0, 2, 1).reshape(len(grids), 3, -1,
                                                                                             length * 14)
    mask = torch.zeros(len(grids), 1, length, dtype=torch.bool)
    for i, (r, c) in enumerate(grids):
        mask[i, 0, : r * c] = True
    vm = getattr(siglip, "vision_model", siglip)  # transformers 5 folds SiglipVisionTransformer in
    navit = reference_embeddings({k: v for k, v in CONFIG["vision_config"].items() if k != "model_type"})
    navit.load_state_dict(vm.embeddings.state_dict())  # SigLIP's patch embedding and position table
    with torch.no_grad():
        embeds = navit(pixels, mask, tgt)
        keys = mask.view(len(grids), -1)  # _prepare_4d_attention_mask: padded keys get the dtype's minimum
        additive = (~keys)[:, None, None, :].float().expand(-1, 1, length, -1) * torch.finfo(torch.float32).min
        hidden = vm.post_layernorm(vm.encoder(inputs_embeds=embeds, attention_mask=additive).last_hidden_state)
        expected = resampler(hidden, tgt).numpy()
    got = _run(session, pixels, grids, d.table_side)
    diff = float(np.abs(got - expected).max())
    print(f"vision_encoder: ONNX vs reference NaViT + SigLIP layers + resampler ({len(grids)} padded slices), "
          f"max abs diff {diff:.3g} (tolerance {TOLERANCE:g})")
    assert diff <= TOLERANCE
    alone = _run(session, pixels[1:2, :, :, : 45 * 14], [grids[1]], d.table_side)  # padding changes nothing
    assert float(np.abs(alone - got[1:2]).max()) <= TOLERANCE


@pytest.mark.parametrize("side", [70, 16, 5])
def test_navit_positions_follow_the_reference(side: int) -> None:
    grids = [(r, c) for r in range(1, 150, 3) for c in (1, 7, 28, 32, 49, 70, 98, 141)]
    for r, c in grids:
        assert navit_position_ids(r, c, side).tolist() == ref_navit_position_ids(r, c, side), (r, c)


@pytest.mark.parametrize("size", [(640, 480), (1344, 448), (448, 448), (300, 200), (2000, 500), (500, 2000),
                                  (1000, 1000), (60, 3000), (4000, 3000), (449, 449), (17, 13)])
@pytest.mark.parametrize("max_slice_nums", [1, 4, 9])
def test_slicing_follows_the_reference(size: tuple[int, int], max_slice_nums: int) -> None:
    width, height = size
    data = _png(width, height, seed=width + height)
    grid = image_processor().get_sliced_grid(size, max_slice_nums)
    assert slice_grid(width, height, max_slice_nums, 448) == (None if grid is None else (grid[1], grid[0]))
    expected = ref_preprocess(data, max_slice_nums)
    sliced = image_slices(data, max_slice_nums)
    assert sliced.grid == slice_grid(width, height, max_slice_nums, 448)
    got = sliced.slices
    assert [(s.rows, s.cols) for s in got] == [tgt for _, tgt in expected]  # tgt_sizes
    for s, (pixels, _) in zip(got, expected, strict=True):
        np.testing.assert_allclose(s.pixels, pixels, atol=1e-6)
        assert s.rows * s.cols <= preset_from_config(minicpmo45(), {}).vision.max_patches


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("side", [20_000, 10_000, 5_000])
def test_a_decompression_bomb_is_a_bad_image(side: int) -> None:
    """A header claiming 20000x20000 (PIL's DecompressionBombError), 10000x10000 (its warning) and
    5000x5000 (our own limit) are refused before any pixel is decoded."""
    with pytest.raises(ImageError):
        image_slices(_png_header(side, side), 9)


def test_position_table_is_the_checkpoint_tensor(reference) -> None:
    from safetensors import safe_open

    with safe_open(str(Path(reference[0]) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("vpm.embeddings.position_embedding.weight").get_shape() == [16 * 16, 32]
    for name in ("vpm.embeddings.patch_embedding.weight", "vpm.encoder.layers.1.self_attn.q_proj.weight",
                 "vpm.encoder.layers.1.self_attn.out_proj.bias", "vpm.post_layernorm.weight", "resampler.query",
                 "resampler.kv_proj.weight", "resampler.attn.in_proj_weight", "resampler.attn.out_proj.weight",
                 "resampler.ln_q.weight", "resampler.ln_kv.bias", "resampler.ln_post.weight", "resampler.proj"):
        assert name in names
    assert "resampler.pos_embed" not in names and "vpm.encoder.layers.2.mlp.fc1.weight" not in names


def test_an_image_too_narrow_for_the_engine_is_a_bad_image() -> None:
    """1x16000 px: the reference would make one slice of 4048 patches, past the engine's 2048."""
    assert [(s.rows, s.cols) for s in image_slices(_png(4, 4000, 1), 9).slices][0] == (1012, 1)  # 1000:1 still serves
    with pytest.raises(ImageError, match="too narrow"):
        image_slices(_png(1, 16_000, 1), 9)


def test_the_stage_batches_any_grids_as_each_alone() -> None:
    """Requests of different image sizes share padded batches (and chunks of `batch_slices`): each image's
    embeddings are what it gets alone; a bad image fails only its own request."""
    import dataclasses

    from minicpmo_triton.engine.exported import load_engine
    from minicpmo_triton.model_config import load_stage_config
    from minicpmo_triton.stage_io import VisionEncoderRequest
    from minicpmo_triton.stages.vision_encoder import VisionEncoderStage

    from .conftest import MODEL_REPOSITORY, ensure_exported

    ensure_exported()
    folder = MODEL_REPOSITORY / "vision_encoder" / "1"
    dims = dataclasses.replace(load_stage_config(folder).vision, batch_slices=4)
    stage = VisionEncoderStage(load_engine(folder), dims)

    def request(*images: tuple[bytes, int]) -> VisionEncoderRequest:
        return VisionEncoderRequest(images=np.array([d for d, _ in images], dtype=np.object_),
                                    max_slice_nums=np.array([n for _, n in images], np.int64))

    wide, tall, small = (_png(900, 300, 1), 9), (_png(300, 1200, 2), 4), (_png(100, 80, 3), 1)
    together = stage.run([request(wide, small), request((b"not an image", 1)), request(tall)])
    assert isinstance(together[1], ImageError)
    alone = [stage.run([request(image)])[0] for image in (wide, small, tall)]
    assert alone[0].slices[0] > 1 and alone[2].slices[0] > 1  # an overview and HD slices
    assert together[0].slices.tolist() == [alone[0].slices[0], 1]
    assert together[2].slices.tolist() == alone[2].slices.tolist()
    np.testing.assert_allclose(together[0].embeds, np.concatenate([alone[0].embeds, alone[1].embeds]), atol=1e-5)
    np.testing.assert_allclose(together[2].embeds, alone[2].embeds, atol=1e-5)


def test_tiny_is_the_real_vision_architecture_from_config_keys() -> None:
    from export.modules.vision import dims_from_config
    from export.presets import TINY_VISION_CONFIG, tiny

    preset = tiny()
    assert dims_from_config(minicpmo45().vision, TINY_VISION_CONFIG, preset.llm.hidden) == preset.vision

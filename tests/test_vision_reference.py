"""The vision stage against its references, not against itself.

- `vpm.*`: transformers' SiglipVisionModel (PyPI). Its positions are NaViT's for a slice the size of the
  position table; for other grids the reference NaViT embedding (below) feeds SigLIP's own encoder layers.
- What PyPI has no reference for is copied below ONLY as the reference, from OpenBMB/MiniCPM-o-Demo @28b60cf:
  MiniCPMO45/modeling_navit_siglip.py `SiglipVisionEmbeddings.forward` (NaViT positions),
  MiniCPMO45/modeling_minicpmo.py `Resampler` + `get_2d_sincos_pos_embed*`, and
  MiniCPMO45/processing_minicpmo.py `MiniCPMVImageProcessor` (slicing, `reshape_by_patch`).
The checkpoint is written under the real names, loaded through export.checkpoint, exported to ONNX and
run with ONNX Runtime.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zlib
from functools import partial
from pathlib import Path

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
from minicpmo_triton.images import ImageError, image_slices, navit_position_ids, slice_grid

LLM_HIDDEN = 256  # resampler: 2 heads of 128
CONFIG = {  # the real config.json's vision keys at a CPU test's size; the table is 16x16 patches
    "hidden_size": LLM_HIDDEN, "query_num": 64, "image_size": 448, "drop_vision_last_layer": True,
    "slice_config": {"max_slice_nums": 9, "patch_size": 14, "scale_resolution": 448},
    "vision_config": {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 64,
                      "image_size": 224, "patch_size": 14, "model_type": "siglip"},
}
TOLERANCE = 1e-4


# ---- the reference, copied (modeling_minicpmo.py) ----

def ref_get_2d_sincos_pos_embed(embed_dim, image_size):
    grid_h_size, grid_w_size = image_size[0], image_size[1]
    grid_h = np.arange(grid_h_size, dtype=np.float32)
    grid_w = np.arange(grid_w_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)  # here w goes first
    grid = np.stack(grid, axis=0)
    emb_h = ref_get_1d_sincos_pos_embed_from_grid_new(embed_dim // 2, grid[0])
    emb_w = ref_get_1d_sincos_pos_embed_from_grid_new(embed_dim // 2, grid[1])
    return np.concatenate([emb_h, emb_w], axis=-1)


def ref_get_1d_sincos_pos_embed_from_grid_new(embed_dim, pos):
    omega = np.arange(embed_dim // 2, dtype=np.float32)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000**omega
    out = np.einsum("hw,d->hwd", pos, omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=-1)


class RefResampler(nn.Module):
    def __init__(self, num_queries, embed_dim, num_heads, kv_dim, max_size=(70, 70)):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.max_size = max_size
        self.query = nn.Parameter(torch.randn(num_queries, embed_dim) * 0.02)
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.ln_q = norm_layer(embed_dim)
        self.ln_kv = norm_layer(embed_dim)
        self.ln_post = norm_layer(embed_dim)
        self.proj = nn.Parameter((embed_dim**-0.5) * torch.randn(embed_dim, embed_dim))
        self.embed_dim = embed_dim
        self._set_2d_pos_cache(self.max_size)

    def _set_2d_pos_cache(self, max_size):
        pos_embed = torch.from_numpy(ref_get_2d_sincos_pos_embed(self.embed_dim, max_size)).float()
        self.register_buffer("pos_embed", pos_embed, persistent=False)

    def forward(self, x, tgt_sizes):
        bs = x.shape[0]
        patch_len = tgt_sizes[:, 0] * tgt_sizes[:, 1]
        max_h, max_w = torch.max(tgt_sizes[:, 0]), torch.max(tgt_sizes[:, 1])
        if max_h > self.max_size[0] or max_w > self.max_size[1]:  # _adjust_pos_cache
            self.max_size = [max(max_h, self.max_size[0]), max(max_w, self.max_size[1])]
            self._set_2d_pos_cache(self.max_size)
        max_patch_len = torch.max(patch_len)
        key_padding_mask = torch.zeros((bs, max_patch_len), dtype=torch.bool)
        pos_embed = []
        for i in range(bs):
            tgt_h, tgt_w = tgt_sizes[i]
            pos_embed.append(self.pos_embed[:tgt_h, :tgt_w, :].reshape((tgt_h * tgt_w, -1)))
            key_padding_mask[i, patch_len[i]:] = True
        pos_embed = torch.nn.utils.rnn.pad_sequence(pos_embed, batch_first=True, padding_value=0.0).permute(1, 0, 2)
        x = self.kv_proj(x)
        x = self.ln_kv(x).permute(1, 0, 2)
        q = self.ln_q(self.query)
        out = self.attn(q.unsqueeze(1).repeat(1, bs, 1), x + pos_embed, x, key_padding_mask=key_padding_mask)[0]
        x = out.permute(1, 0, 2)
        return self.ln_post(x) @ self.proj


# ---- the reference, copied (modeling_navit_siglip.py SiglipVisionEmbeddings.forward) ----

def ref_navit_position_ids(patch_attention_mask, tgt_sizes, num_patches_per_side, max_patches):
    boundaries = torch.arange(1 / num_patches_per_side, 1.0, 1 / num_patches_per_side)
    position_ids = torch.full(size=(len(tgt_sizes), max_patches), fill_value=0)
    for batch_idx, p_attn_mask in enumerate(patch_attention_mask):
        nb_patches_h = tgt_sizes[batch_idx][0]
        nb_patches_w = tgt_sizes[batch_idx][1]
        fractional_coords_h = torch.arange(0, 1 - 1e-6, 1 / nb_patches_h)
        fractional_coords_w = torch.arange(0, 1 - 1e-6, 1 / nb_patches_w)
        bucket_coords_h = torch.bucketize(fractional_coords_h, boundaries, right=True)
        bucket_coords_w = torch.bucketize(fractional_coords_w, boundaries, right=True)
        pos_ids = (bucket_coords_h[:, None] * num_patches_per_side + bucket_coords_w).flatten()
        position_ids[batch_idx][p_attn_mask.view(-1).cpu()] = pos_ids
    return position_ids


# ---- the reference, copied (processing_minicpmo.py MiniCPMVImageProcessor) ----

def ref_ensure_divide(length, patch_size):
    return max(round(length / patch_size) * patch_size, patch_size)


def ref_find_best_resize(original_size, scale_resolution, patch_size, allow_upscale=False):
    width, height = original_size
    if (width * height > scale_resolution * scale_resolution) or allow_upscale:
        r = width / height
        height = int(scale_resolution / math.sqrt(r))
        width = int(height * r)
    return ref_ensure_divide(width, patch_size), ref_ensure_divide(height, patch_size)


def ref_get_refine_size(original_size, grid, scale_resolution, patch_size, allow_upscale=False):
    width, height = original_size
    grid_x, grid_y = grid
    refine_width = ref_ensure_divide(width, grid_x)
    refine_height = ref_ensure_divide(height, grid_y)
    best_grid_size = ref_find_best_resize((refine_width / grid_x, refine_height / grid_y), scale_resolution,
                                          patch_size, allow_upscale=allow_upscale)
    return best_grid_size[0] * grid_x, best_grid_size[1] * grid_y


def ref_split_to_patches(image, grid):
    patches = []
    width, height = image.size
    grid_x = int(width / grid[0])
    grid_y = int(height / grid[1])
    for i in range(0, height, grid_y):
        images = []
        for j in range(0, width, grid_x):
            images.append(image.crop((j, i, j + grid_x, i + grid_y)))
        patches.append(images)
    return patches


def ref_get_sliced_grid(image_size, max_slice_nums, scale_resolution=448):
    original_width, original_height = image_size
    log_ratio = math.log(original_width / original_height)
    ratio = original_width * original_height / (scale_resolution * scale_resolution)
    multiple = min(math.ceil(ratio), max_slice_nums)
    if multiple <= 1:
        return None
    candidate_split_grids_nums = [i for i in [multiple - 1, multiple, multiple + 1] if i != 1 and i <= max_slice_nums]
    candidate_grids = []
    for split_grids_nums in candidate_split_grids_nums:
        m = 1
        while m <= split_grids_nums:
            if split_grids_nums % m == 0:
                candidate_grids.append([m, split_grids_nums // m])
            m += 1
    best_grid = [1, 1]
    min_error = float("inf")
    for grid in candidate_grids:
        error = abs(log_ratio - math.log(grid[0] / grid[1]))
        if error < min_error:
            best_grid = grid
            min_error = error
    return best_grid


def ref_get_sliced_images(image, max_slice_nums, scale_resolution=448, patch_size=14):
    best_grid = ref_get_sliced_grid(image.size, max_slice_nums, scale_resolution)
    patches = []
    if best_grid is None:
        best_size = ref_find_best_resize(image.size, scale_resolution, patch_size, allow_upscale=True)
        source_image = image.resize(best_size, resample=Image.Resampling.BICUBIC)
    else:
        best_resize = ref_find_best_resize(image.size, scale_resolution, patch_size)
        source_image = image.copy().resize(best_resize, resample=Image.Resampling.BICUBIC)
        refine_size = ref_get_refine_size(image.size, best_grid, scale_resolution, patch_size, allow_upscale=True)
        refine_image = image.resize(refine_size, resample=Image.Resampling.BICUBIC)
        patches = ref_split_to_patches(refine_image, best_grid)
    return [source_image] + [p for row in patches for p in row], best_grid


def ref_reshape_by_patch(image, patch_size=14):
    image = torch.from_numpy(image)
    patches = torch.nn.functional.unfold(image, (patch_size, patch_size), stride=(patch_size, patch_size))
    patches = patches.reshape(image.size(0), patch_size, patch_size, -1)
    patches = patches.permute(0, 1, 3, 2).reshape(image.size(0), patch_size, -1)
    return patches.numpy()


def ref_preprocess(image, max_slice_nums):
    from transformers.image_transforms import normalize

    out = []
    for s in ref_get_sliced_images(image.convert("RGB"), max_slice_nums)[0]:
        arr = normalize(np.asarray(s).astype(np.float32) / 255, mean=[0.5] * 3, std=[0.5] * 3,
                        input_data_format="channels_last").transpose(2, 0, 1)
        out.append((ref_reshape_by_patch(np.ascontiguousarray(arr)), (arr.shape[1] // 14, arr.shape[2] // 14)))
    return out


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
    resampler = RefResampler(CONFIG["query_num"], LLM_HIDDEN, LLM_HIDDEN // 128, v["hidden_size"]).eval()
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
    pixels = torch.from_numpy(ref_reshape_by_patch(image[0].numpy()))[None]
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
    flat = [torch.from_numpy(ref_reshape_by_patch(s.numpy())).flatten(end_dim=1).permute(1, 0) for s in slices]
    pixels = torch.nn.utils.rnn.pad_sequence(flat, batch_first=True).permute(0, 2, 1).reshape(len(grids), 3, -1,
                                                                                             length * 14)
    mask = torch.zeros(len(grids), 1, length, dtype=torch.bool)
    for i, (r, c) in enumerate(grids):
        mask[i, 0, : r * c] = True
    vm = getattr(siglip, "vision_model", siglip)  # transformers 5 folds SiglipVisionTransformer in
    with torch.no_grad():
        embeds = vm.embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        embeds = embeds + vm.embeddings.position_embedding(ref_navit_position_ids(mask, tgt, d.table_side, length))
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
        mask = torch.ones(1, r, c, dtype=torch.bool)
        expected = ref_navit_position_ids(mask, torch.tensor([[r, c]], dtype=torch.int32), side, r * c)[0]
        assert navit_position_ids(r, c, side).tolist() == expected.tolist(), (r, c)


@pytest.mark.parametrize("size", [(640, 480), (1344, 448), (448, 448), (300, 200), (2000, 500), (500, 2000),
                                  (1000, 1000), (60, 3000), (4000, 3000), (449, 449), (17, 13)])
@pytest.mark.parametrize("max_slice_nums", [1, 4, 9])
def test_slicing_follows_the_reference(size: tuple[int, int], max_slice_nums: int) -> None:
    width, height = size
    data = _png(width, height, seed=width + height)
    grid = ref_get_sliced_grid(size, max_slice_nums)
    assert slice_grid(width, height, max_slice_nums, 448) == (None if grid is None else (grid[1], grid[0]))
    expected = ref_preprocess(Image.open(io.BytesIO(data)), max_slice_nums)
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

    from minicpmo_triton.engines import load_engine
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

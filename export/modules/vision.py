"""The vision encoder stage, as MiniCPM-o 4.5 runs it: NaViT SigLIP (`vpm`) -> 2D resampler -> LLM width.

A batch holds slices of different patch grids, each padded to the batch's longest:
  pixels       [B, 3, 14, L * 14]  each slice's patches side by side (MiniCPM-V's `reshape_by_patch`)
  position_ids [B, L] int64        rows of the 70x70 position table (NaViT bucketing, done by the caller:
                                   minicpmo_triton.media.images.navit_position_ids)
  tgt_sizes    [B, 2] int64        each slice's patch grid (rows, cols); patches past rows * cols are padding
Output: embeds [B, 64, H].

Names are the checkpoint's (`vpm.*`, `resampler.*`). Followed (OpenBMB/MiniCPM-o-Demo MiniCPMO45/):
modeling_navit_siglip.py (SiglipVisionTransformer, SiglipVisionEmbeddings, SiglipAttention,
SiglipEncoderLayer) and modeling_minicpmo.py (init_vision_module, init_resampler, get_vision_embedding,
Resampler, get_2d_sincos_pos_embed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from minicpmo_triton.model_config import PresetConfig, VisionDims

from ..tensor_names import Tensors

RESAMPLER_EPS = 1e-6  # the resampler's norm_layer: partial(nn.LayerNorm, eps=1e-6)
SINCOS_BASE = 10_000.0


PREFIXES = ("vpm.", "resampler.")


def read_config(preset: PresetConfig, config: dict) -> PresetConfig:
    return dataclasses.replace(preset, vision=dims_from_config(preset.vision, config, preset.llm.hidden))


def state_from_checkpoint(tensors: Tensors, preset: PresetConfig) -> Tensors:
    return tensors  # the module carries the checkpoint's names (SigLIP's separate q/k/v, the resampler's in_proj)


def dims_from_config(base: VisionDims, config: dict[str, Any], llm_hidden: int) -> VisionDims:
    """VisionDims from a MiniCPM-o config.json: `vision_config` (SigLIP), `slice_config`, top-level keys."""
    v = config.get("vision_config", {})
    drop = int(config.get("drop_vision_last_layer", True))  # the reference's default
    return dataclasses.replace(
        base,
        image_size=v.get("image_size", base.image_size),
        patch=v.get("patch_size", base.patch),
        d_model=v.get("hidden_size", base.d_model),
        layers=v["num_hidden_layers"] - drop if "num_hidden_layers" in v else base.layers,
        heads=v.get("num_attention_heads", base.heads),
        ffn=v.get("intermediate_size", base.ffn),
        eps=v.get("layer_norm_eps", base.eps),
        queries=config.get("query_num", base.queries),
        resampler_heads=max(1, llm_hidden // 128),  # init_resampler: num_heads = embed_dim // 128
        scale_resolution=config.get("slice_config", {}).get("scale_resolution",
                                                             config.get("image_size", base.scale_resolution)),
        batch_slices=config.get("vision_batch_size", base.batch_slices),
    )


def patch_mask(tgt_sizes: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L] bool: which of the L patch places hold a real patch."""
    count = tgt_sizes[:, 0:1] * tgt_sizes[:, 1:2]
    return torch.arange(length, device=tgt_sizes.device)[None, :] < count


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, d.d_model, d.patch, stride=d.patch)  # [D, 3, 14, 14]
        self.position_embedding = nn.Embedding(d.table_side**2, d.d_model)  # [4900, D]

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, D, 1, L] -> [B, L, D]
        return x + self.position_embedding(position_ids)


class SiglipAttention(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.heads = d.heads
        self.q_proj = nn.Linear(d.d_model, d.d_model)
        self.k_proj = nn.Linear(d.d_model, d.d_model)
        self.v_proj = nn.Linear(d.d_model, d.d_model)
        self.out_proj = nn.Linear(d.d_model, d.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # mask [B, 1, 1, L] additive
        b, n, width = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = (q @ k.transpose(-1, -2)) * (width // self.heads) ** -0.5 + mask
        out = torch.softmax(scores, dim=-1) @ v  # [B, heads, L, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(b, n, width))


class SiglipMLP(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d.d_model, d.ffn)
        self.fc2 = nn.Linear(d.ffn, d.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x), approximate="tanh"))  # gelu_pytorch_tanh


class SiglipEncoderLayer(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(d.d_model, eps=d.eps)
        self.self_attn = SiglipAttention(d)
        self.layer_norm2 = nn.LayerNorm(d.d_model, eps=d.eps)
        self.mlp = SiglipMLP(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(d) for _ in range(d.layers))  # the dropped last one absent


class SiglipVisionTransformer(nn.Module):
    """`vpm.*`: embeddings, encoder.layers.N, post_layernorm."""

    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(d)
        self.encoder = SiglipEncoder(d)
        self.post_layernorm = nn.LayerNorm(d.d_model, eps=d.eps)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels, position_ids)
        # padded patches are no keys (_prepare_4d_attention_mask); their own rows are computed and ignored
        mask = torch.where(valid, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.post_layernorm(x)


def sincos_2d(tgt_sizes: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """[B, L, dim]: the resampler's fixed 2D sin-cos embedding of each patch place (row-major in its slice's
    grid): [sin, cos] of the column, then [sin, cos] of the row (get_2d_sincos_pos_embed: the meshgrid puts w
    first). The reference caches a 70x70 table and grows it; computing it per patch is the same values."""
    place = torch.arange(length, device=tgt_sizes.device)[None, :]
    cols = tgt_sizes[:, 1:2]
    omega = 1.0 / SINCOS_BASE ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))

    def embed(pos: torch.Tensor) -> torch.Tensor:
        angle = pos.to(torch.float32)[..., None] * omega
        return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)

    return torch.cat([embed(place % cols), embed(place // cols)], dim=-1)


class Resampler(nn.Module):
    """`resampler.*`: `queries` learned queries cross-attend to the slice's patches (keys carry the 2D sin-cos
    positions, values do not), then ln_post and proj. `pos_embed` is a non-persistent buffer in the
    reference, so no tensor in the checkpoint."""

    def __init__(self, d: VisionDims, llm_hidden: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(d.queries, llm_hidden) * 0.02)  # [64, H]
        self.kv_proj = nn.Linear(d.d_model, llm_hidden, bias=False)  # [H, D]
        self.attn = nn.MultiheadAttention(llm_hidden, d.resampler_heads, batch_first=True)  # in_proj_*, out_proj.*
        self.ln_q = nn.LayerNorm(llm_hidden, eps=RESAMPLER_EPS)
        self.ln_kv = nn.LayerNorm(llm_hidden, eps=RESAMPLER_EPS)
        self.ln_post = nn.LayerNorm(llm_hidden, eps=RESAMPLER_EPS)
        self.proj = nn.Parameter(torch.randn(llm_hidden, llm_hidden) * llm_hidden**-0.5)  # [H, H]

    def forward(self, patches: torch.Tensor, tgt_sizes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        kv = self.ln_kv(self.kv_proj(patches))  # [B, L, H]
        keys = kv + sincos_2d(tgt_sizes, patches.shape[1], kv.shape[-1])
        q = self.ln_q(self.query).unsqueeze(0).expand(patches.shape[0], -1, -1)
        out = self.attn(q, keys, kv, key_padding_mask=~valid, need_weights=False)[0]
        return self.ln_post(out) @ self.proj


class VisionEncoder(nn.Module):
    def __init__(self, d: VisionDims, llm_hidden: int) -> None:
        super().__init__()
        self.vpm = SiglipVisionTransformer(d)
        self.resampler = Resampler(d, llm_hidden)

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor, tgt_sizes: torch.Tensor) -> torch.Tensor:
        valid = patch_mask(tgt_sizes, position_ids.shape[1])
        return self.resampler(self.vpm(pixels, position_ids, valid), tgt_sizes, valid)  # [B, 64, H]

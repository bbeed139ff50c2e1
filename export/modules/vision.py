"""The vision encoder stage: 448x448 slices -> SigLIP-style ViT -> 64-query resampler -> LLM width."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minicpmo_triton.model_config import PresetConfig, VisionDims

from ..tensor_names import Tensors, fuse_qkv, read_dims

PREFIXES = ("vpm.", "resampler.")


def read_config(preset: PresetConfig, config: dict) -> PresetConfig:
    """`vision_config` (SigLIP) + top-level `query_num`."""
    vision = read_dims(preset.vision, config.get("vision_config", {}), {
        "image_size": "image_size", "patch": "patch_size", "d_model": "hidden_size", "layers": "num_hidden_layers",
        "heads": "num_attention_heads", "ffn": "intermediate_size"})
    # MiniCPM-o's resampler: LLM width / 128 heads
    vision = dataclasses.replace(read_dims(vision, config, {"queries": "query_num"}),
                                 resampler_heads=max(1, preset.llm.hidden // 128))
    return dataclasses.replace(preset, vision=vision)


def state_from_checkpoint(tensors: Tensors, preset: PresetConfig) -> Tensors:
    return fuse_qkv(tensors)  # SigLIP's separate q/k/v; the resampler's attention keeps torch's names


class SiglipMLP(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d.d_model, d.ffn)
        self.fc2 = nn.Linear(d.ffn, d.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(d.d_model)
        self.self_attn = nn.MultiheadAttention(d.d_model, d.heads, batch_first=True)
        self.layer_norm2 = nn.LayerNorm(d.d_model)
        self.mlp = SiglipMLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer_norm1(x)
        x = x + self.self_attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, d.d_model, d.patch, stride=d.patch)
        self.position_embedding = nn.Embedding((d.image_size // d.patch) ** 2, d.d_model)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(pixels).flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipLayers(nn.Module):
    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(d) for _ in range(d.layers))


class SiglipEncoder(nn.Module):
    """`vpm.*` (Hugging Face SigLIP names): embeddings, encoder.layers, post_layernorm."""

    def __init__(self, d: VisionDims) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(d)
        self.encoder = SiglipLayers(d)
        self.post_layernorm = nn.LayerNorm(d.d_model)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, 3, 448, 448] -> [B, 1024, D]
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Resampler(nn.Module):
    """`resampler.*`: 64 learned queries cross-attend to the patches, projected to the LLM width."""

    def __init__(self, d: VisionDims, llm_hidden: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(d.queries, llm_hidden) * 0.02)
        self.kv_proj = nn.Linear(d.d_model, llm_hidden, bias=False)
        self.attn = nn.MultiheadAttention(llm_hidden, d.resampler_heads, batch_first=True)
        self.ln_q = nn.LayerNorm(llm_hidden)
        self.ln_kv = nn.LayerNorm(llm_hidden)
        self.ln_post = nn.LayerNorm(llm_hidden)
        self.proj = nn.Parameter(torch.randn(llm_hidden, llm_hidden) * llm_hidden**-0.5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        kv = self.ln_kv(self.kv_proj(patches))
        q = self.ln_q(self.query).unsqueeze(0).expand(patches.shape[0], -1, -1)
        return self.ln_post(self.attn(q, kv, kv, need_weights=False)[0]) @ self.proj


class VisionEncoder(nn.Module):
    def __init__(self, d: VisionDims, llm_hidden: int) -> None:
        super().__init__()
        self.vpm = SiglipEncoder(d)
        self.resampler = Resampler(d, llm_hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, 3, 448, 448] -> [B, 64, H]
        return self.resampler(self.vpm(pixels))

"""A Qwen3-style decoder (RMSNorm, RoPE, GQA with optional q/k norm, SwiGLU) with an explicit KV cache.

Used by the LLM and, without q/k norm, by the TTS (a Llama). The cache is stacked over layers,
[layers, batch, kv_heads, past, head_dim], and the caller passes a mask of the real past entries,
so sessions with different past lengths share one batched forward: each row's past is left-padded
(`past_mask` marks the real entries) and its new tokens right-padded (causality hides the padding).
"""

from __future__ import annotations

import torch
from torch import nn

from minicpmo_triton.model_config import DecoderDims


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, d: DecoderDims) -> None:
        super().__init__()
        self.d = d
        self.q_proj = nn.Linear(d.hidden, d.heads * d.head_dim, bias=False)
        self.k_proj = nn.Linear(d.hidden, d.kv_heads * d.head_dim, bias=False)
        self.v_proj = nn.Linear(d.hidden, d.kv_heads * d.head_dim, bias=False)
        self.o_proj = nn.Linear(d.heads * d.head_dim, d.hidden, bias=False)
        if d.qk_norm:
            self.q_norm = RMSNorm(d.head_dim, d.rms_eps)
            self.k_norm = RMSNorm(d.head_dim, d.rms_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.d
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, d.heads, d.head_dim)
        k = self.k_proj(x).view(b, t, d.kv_heads, d.head_dim)
        v = self.v_proj(x).view(b, t, d.kv_heads, d.head_dim).transpose(1, 2)
        if d.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q.transpose(1, 2), cos, sin)
        k = rope(k.transpose(1, 2), cos, sin)
        k_all = torch.cat([past_k, k], dim=2)
        v_all = torch.cat([past_v, v], dim=2)
        groups = d.heads // d.kv_heads
        k_rep = k_all.repeat_interleave(groups, dim=1)
        v_rep = v_all.repeat_interleave(groups, dim=1)
        scores = (q @ k_rep.transpose(-1, -2)) * (d.head_dim**-0.5) + mask
        out = torch.softmax(scores, dim=-1) @ v_rep
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d.heads * d.head_dim)), k, v


class MLP(nn.Module):
    def __init__(self, d: DecoderDims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.up_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.down_proj = nn.Linear(d.intermediate, d.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d: DecoderDims) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden, d.rms_eps)
        self.self_attn = Attention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.rms_eps)
        self.mlp = MLP(d)

    def forward(self, x, cos, sin, past_k, past_v, mask):
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, past_k, past_v, mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class DecoderModel(nn.Module):
    """`model.*` of a Qwen3/Llama checkpoint: embed_tokens, layers, norm."""

    def __init__(self, d: DecoderDims, vocab: int) -> None:
        super().__init__()
        self.d = d
        self.embed_tokens = nn.Embedding(max(vocab, 1), d.hidden)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(d.layers))
        self.norm = RMSNorm(d.hidden, d.rms_eps)
        inv = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.float32) / d.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [B, T, H]
        position_ids: torch.Tensor,  # [B, T] int64
        past_mask: torch.Tensor,  # [B, P] bool: which past keys are real
        past_key: torch.Tensor,  # [L, B, KV, P, D]
        past_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = inputs_embeds.shape[1]
        p = past_mask.shape[1]
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
        cos, sin = emb.cos(), emb.sin()
        # Query i sits at key index p + i; it sees real past keys and new keys up to itself.
        key_idx = torch.arange(p + t, device=past_mask.device)
        query_idx = torch.arange(t, device=past_mask.device) + p
        causal = key_idx[None, :] <= query_idx[:, None]  # [T, P + T]
        new_keys = torch.ones(inputs_embeds.shape[:2], dtype=torch.bool, device=past_mask.device)
        key_mask = torch.cat([past_mask, new_keys], dim=1)
        allowed = causal[None, None] & key_mask[:, None, None, :]
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        x = inputs_embeds
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, past_key[i], past_value[i], mask)
            new_k.append(k)
            new_v.append(v)
        present_key = torch.cat([past_key, torch.stack(new_k)], dim=3)
        present_value = torch.cat([past_value, torch.stack(new_v)], dim=3)
        return self.norm(x), present_key, present_value

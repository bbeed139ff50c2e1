"""The Qwen3-style decoder (RMSNorm, RoPE, GQA with optional q/k norm, SwiGLU) and the LLM over it: the one
definition the ONNX graph is traced from (export/stages.py, through a `DenseCache`) and the device engine runs
(`PagedDecoder`, through a `PoolCache`). The TTS's Llama is the same decoder without q/k norm (engine/tts_model.py).

Module names are the checkpoint's (`llm.*` less the prefix, as `export/modules/llm.py` maps them):
  model.embed_tokens.weight                 [vocab, hidden]
  model.layers.{i}.input_layernorm.weight   [hidden]
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  q: [heads * D, hidden], k/v: [kv_heads * D, hidden],
                                            o: [hidden, heads * D]
  model.layers.{i}.self_attn.{q,k}_norm.weight      [D] (Qwen3's q/k norm)
  model.layers.{i}.post_attention_layernorm.weight  [hidden]
  model.layers.{i}.mlp.{gate,up}_proj.weight        [intermediate, hidden]; down_proj: [hidden, intermediate]
  model.norm.weight                         [hidden]
  lm_head.weight                            [vocab, hidden]
Tokens come as [..., hidden]: a padded [B, T] batch for the ONNX graph, packed [N] on the device (a 300-token
prefill beside one-token decode rows costs no padding). Each layer is two steps around the cache's attention
(`attention_inputs`: norm, q/k/v, q/k norm, rope; `attention_output`: o_proj, residual, norm, MLP): on CUDA the
engine torch.compiles the two (every layer shares their two graphs: the weights are their inputs), elsewhere they
run as written. Norms and rope run in fp32 whatever the weights' dtype (bf16 on the GPU, fp32 on the CPU and in the
graph): Qwen3's activations overflow fp16.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional

from ..model_config import DecoderDims
from .attention import Meta, PagedAttention
from .cache import DenseCache, KvCache, PoolCache
from .pool import KvPool
from .traffic import Work, layer_weight_count


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
                * self.weight.to(torch.float32)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] rotated by its tokens' cos / sin [..., 1, D] (rotate-half, in fp32)."""
    half = x.shape[-1] // 2
    x32 = x.to(torch.float32)
    return (x32 * cos + torch.cat([-x32[..., half:], x32[..., :half]], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d: DecoderDims) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d.hidden, d.heads * d.head_dim, bias=False)
        self.k_proj = nn.Linear(d.hidden, d.kv_heads * d.head_dim, bias=False)
        self.v_proj = nn.Linear(d.hidden, d.kv_heads * d.head_dim, bias=False)
        self.o_proj = nn.Linear(d.heads * d.head_dim, d.hidden, bias=False)
        if d.qk_norm:
            self.q_norm = RMSNorm(d.head_dim, d.rms_eps)
            self.k_norm = RMSNorm(d.head_dim, d.rms_eps)


class MLP(nn.Module):
    def __init__(self, d: DecoderDims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.up_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.down_proj = nn.Linear(d.intermediate, d.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, d: DecoderDims) -> None:
        super().__init__()
        self.d = d
        self.input_layernorm = RMSNorm(d.hidden, d.rms_eps)
        self.self_attn = Attention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.rms_eps)
        self.mlp = MLP(d)

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> q [..., heads, D], k / v [..., kv_heads, D] (q and k normed and rotated)."""
        d, attn = self.d, self.self_attn
        h = self.input_layernorm(x)
        q = attn.q_proj(h).unflatten(-1, (d.heads, d.head_dim))
        k = attn.k_proj(h).unflatten(-1, (d.kv_heads, d.head_dim))
        v = attn.v_proj(h).unflatten(-1, (d.kv_heads, d.head_dim))
        if d.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def attention_output(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] the layer's input, a [..., heads, D] its attention -> the layer's output [..., hidden]."""
        x = x + self.self_attn.o_proj(a.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """`model.*` of a Qwen3/Llama checkpoint: embed_tokens, layers, norm."""

    def __init__(self, d: DecoderDims, vocab: int) -> None:
        super().__init__()
        self.d = d
        self.embed_tokens = nn.Embedding(max(vocab, 1), d.hidden)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(d.layers))
        self.norm = RMSNorm(d.hidden, d.rms_eps)
        self.compile_layers(False)

    def compile_layers(self, on: bool) -> None:
        """The layers' two steps torch.compiled (one graph for every layer; N changes with the batch, so it turns
        dynamic after one recompile) or eager."""
        self.compiled = on
        steps: tuple[Any, ...] = (DecoderLayer.attention_inputs, DecoderLayer.attention_output)
        self.steps = tuple(torch.compile(s) for s in steps) if on else steps

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., 1, D] (fp32) for `positions` [...]."""
        d = self.d
        inv_freq = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.float32,
                                                        device=positions.device) / d.head_dim))
        freqs = positions.to(torch.float32)[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]
        return emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KvCache) -> torch.Tensor:
        """x [..., hidden] the new tokens' inputs at `positions` [...]; their keys and values go into `cache`.
        Returns the final normed hidden states [..., hidden]."""
        cos, sin = self.rope(positions)
        inputs, output = self.steps
        for i, layer in enumerate(self.layers):
            q, k, v = inputs(layer, x, cos, sin)
            x = output(layer, x, cache.attend(i, q, k, v))
        return self.norm(x)


class Projector(nn.Module):
    """MiniCPM-o's `MultiModalProjector` (the audio encoder's `audio_projection_layer`, the TTS's
    `projector_semantic` / `projector_spk`): linear1 [d_out, d_in], ReLU, linear2 [d_out, d_out], with biases."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_in, d_out)
        self.linear2 = nn.Linear(d_out, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(functional.relu(self.linear1(x)))


class DuplexLLM(nn.Module):
    """`llm.*` in the MiniCPM-o checkpoint (`model.*`, `lm_head`). `forward` is the ONNX graph `llm/1/model.onnx`
    (tensor names in export/tensor_names.py); the device engine runs `model` over a pool (`PagedDecoder`)."""

    def __init__(self, d: DecoderDims) -> None:
        super().__init__()
        self.model = Decoder(d, d.vocab)
        self.lm_head = nn.Linear(d.hidden, d.vocab, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        embeds: torch.Tensor,  # [B, T, H] audio/vision embeddings where use_embeds
        use_embeds: torch.Tensor,  # [B, T] bool
        position_ids: torch.Tensor,  # [B, T] int64
        past_mask: torch.Tensor,  # [B, P] bool: which past keys are real (rows left-padded)
        past_key: torch.Tensor,  # [L, B, KV, P, D]
        past_value: torch.Tensor,
        last_index: torch.Tensor,  # [B] int64: the row's last real new token
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.where(use_embeds[..., None], embeds, self.model.embed_tokens(input_ids))
        cache = DenseCache.causal(past_mask, past_key, past_value, x.shape[1])
        hidden = self.model(x, position_ids, cache)
        last = hidden[torch.arange(hidden.shape[0]), last_index]
        return self.lm_head(last), hidden, *cache.present()


class DecoderNet(Protocol):
    model: Decoder  # the LLM's, the TTS's


class PagedDecoder:
    """A network's decoder (`net.model`: the LLM's, the TTS's) over a KV pool of its own: a forward takes every
    row's new tokens packed [N, hidden], writes their keys and values into the pool in place and attends over each
    row's blocks; either a static decode batch (one token a row of a bucket, everything read from persistent
    buffers: what a CUDA graph captures) or a varlen packed prefill."""

    def __init__(self, net: DecoderNet, pool: KvPool, attention: PagedAttention, dtype: torch.dtype,
                 work: Work | None = None, compile_layers: bool | None = None) -> None:
        self.net = net
        self.decoder = net.model
        self.d = self.decoder.d
        self.pool = pool
        self.attention = attention
        self.dtype = dtype
        self.device = pool.device
        self.work = work or Work()
        self.layer_bytes = layer_weight_count(self.d) * torch.empty(0, dtype=dtype).element_size()  # once a forward
        self.use_compiled(self.device.type == "cuda" if compile_layers is None else compile_layers)

    def use_compiled(self, on: bool) -> None:
        self.decoder.compile_layers(on)

    @property
    def compiled(self) -> bool:
        return self.decoder.compiled

    def count(self, past: Any, count: Any, head_rows: int, head_bytes: int) -> None:
        """The work ledger's bill for one forward (rows at `past` bringing `count` tokens each, host-known) and its
        head over `head_rows` rows."""
        self.work.count_forward(self.d, past, count, self.layer_bytes, self.pool.shape.token_bytes(self.pool.dtype))
        self.work.count_head(self.d, head_rows, head_bytes)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, meta: Meta) -> torch.Tensor:
        """x [N, hidden] the new tokens' inputs, positions/slots [N] int64 on the device. Returns the final
        normed hidden states [N, hidden] (they stay on the device)."""
        return self.decoder(x, positions, PoolCache(self.pool, self.attention, slots, meta))

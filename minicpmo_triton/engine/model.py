"""The LLM (a Qwen3 decoder + lm_head) over packed tokens and a KV pool: no padding, no cache copied.

Weights keep the checkpoint's names (`llm.*` less the prefix, as `export/modules/llm.py` loads them):
  model.embed_tokens.weight                 [vocab, hidden]
  model.layers.{i}.input_layernorm.weight   [hidden]
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  q: [heads * D, hidden], k/v: [kv_heads * D, hidden],
                                            o: [hidden, heads * D]
  model.layers.{i}.self_attn.{q,k}_norm.weight      [D] (Qwen3's q/k norm)
  model.layers.{i}.post_attention_layernorm.weight  [hidden]
  model.layers.{i}.mlp.{gate,up}_proj.weight        [intermediate, hidden]; down_proj: [hidden, intermediate]
  model.norm.weight                         [hidden]
  lm_head.weight                            [vocab, hidden]
A forward takes every row's new tokens packed in one [N, hidden] batch (a 300-token prefill beside one-token
decode rows costs no padding), writes their keys and values into the pool in place and attends over each row's
blocks. Each layer is two pure functions around the attention (`attention_inputs`: norm, q/k/v, q/k norm, rope;
`attention_output`: o_proj, residual, norm, MLP), weights passed as arguments: on CUDA they are torch.compile'd
once and all layers share the two graphs (elementwise work fused, far fewer launches; the `engine_compile` setting
turns it off), on the CPU they run eagerly as written. A forward is either a static decode batch (one token a row
of a bucket, everything read from persistent buffers: what a CUDA graph captures) or a varlen packed prefill.
Norms and softmax run in fp32 whatever the weights' dtype (bf16 on the GPU, fp32 on the CPU): Qwen3's
activations overflow fp16, and fp32 here keeps the CPU path within 1e-4 of the ONNX graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

from ..model_config import DecoderDims
from .attention import Meta, PagedAttention
from .pool import KvPool
from .traffic import Work, layer_weight_count


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x32 = x.to(torch.float32)
    return (x32 * cos + torch.cat([-x32[..., half:], x32[..., :half]], dim=-1) * sin).to(x.dtype)


def attention_inputs(x: torch.Tensor, ln: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float, heads: int, kv_heads: int, head_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, hidden] -> q [N, heads, D], k / v [N, kv_heads, D] (q and k normed and rotated)."""
    n = x.shape[0]
    h = _norm(x, ln, eps)
    q = functional.linear(h, wq).view(n, heads, head_dim)
    k = functional.linear(h, wk).view(n, kv_heads, head_dim)
    v = functional.linear(h, wv).view(n, kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = _norm(q, q_norm, eps), _norm(k, k_norm, eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def attention_output(x: torch.Tensor, a: torch.Tensor, wo: torch.Tensor, ln: torch.Tensor, w_gate: torch.Tensor,
                     w_up: torch.Tensor, w_down: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, hidden] the layer's input, a [N, heads, D] its attention -> the layer's output [N, hidden]."""
    x = x + functional.linear(a.reshape(a.shape[0], -1), wo)
    h = _norm(x, ln, eps)
    gate = functional.silu(functional.linear(h, w_gate))
    return x + functional.linear(gate * functional.linear(h, w_up), w_down)


class PagedDecoder:
    def __init__(self, weights: dict[str, torch.Tensor], dims: DecoderDims, pool: KvPool, attention: PagedAttention,
                 dtype: torch.dtype, work: Work | None = None, compile_layers: bool | None = None) -> None:
        self.d = dims
        self.pool = pool
        self.attention = attention
        self.dtype = dtype
        self.device = pool.device
        self.work = work or Work()
        self.w = {name: t.detach().to(self.device, dtype) for name, t in weights.items()}
        elt = torch.empty(0, dtype=dtype).element_size()
        self.layer_bytes = layer_weight_count(dims) * elt  # read once per forward, whatever the batch
        self.head_bytes = dims.vocab * dims.hidden * elt
        d = dims
        self.inv_freq = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, dtype=torch.float32,
                                                             device=self.device) / d.head_dim))
        self.use_compiled(self.device.type == "cuda" if compile_layers is None else compile_layers)

    def use_compiled(self, on: bool) -> None:
        """The layers' two functions compiled (the same graph for every layer: weights are arguments; N changes
        with the batch, so it turns dynamic after one recompile) or eager."""
        self.compiled = on
        self._inputs: Any = torch.compile(attention_inputs) if on else attention_inputs
        self._output: Any = torch.compile(attention_output) if on else attention_output

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w["model.embed_tokens.weight"][ids]

    def count(self, past: Any, count: Any, head_rows: int, head_bytes: int) -> None:
        """The work ledger's bill for one forward (rows at `past` bringing `count` tokens each, host-known) and its
        head over `head_rows` rows."""
        self.work.count_forward(self.d, past, count, self.layer_bytes, self.pool.shape.token_bytes(self.pool.dtype))
        self.work.count_head(self.d, head_rows, head_bytes)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, meta: Meta) -> torch.Tensor:
        """x [N, hidden] the new tokens' inputs, positions/slots [N] int64 on the device. Returns the final
        normed hidden states [N, hidden] (they stay on the device)."""
        d, w = self.d, self.w
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [N, 1, D]
        cos, sin = emb.cos(), emb.sin()
        for i in range(d.layers):
            p = f"model.layers.{i}."
            q_norm = w[p + "self_attn.q_norm.weight"] if d.qk_norm else None
            k_norm = w[p + "self_attn.k_norm.weight"] if d.qk_norm else None
            q, k, v = self._inputs(x, w[p + "input_layernorm.weight"], w[p + "self_attn.q_proj.weight"],
                                   w[p + "self_attn.k_proj.weight"], w[p + "self_attn.v_proj.weight"], q_norm, k_norm,
                                   cos, sin, d.rms_eps, d.heads, d.kv_heads, d.head_dim)
            self.pool.write(i, slots, k, v)
            a = self.attention(q, self.pool.key[i], self.pool.value[i], meta)
            x = self._output(x, a, w[p + "self_attn.o_proj.weight"], w[p + "post_attention_layernorm.weight"],
                             w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"],
                             d.rms_eps)
        return _norm(x, w["model.norm.weight"], d.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, vocab] fp32 for the rows' last hidden states; they never leave the device."""
        return functional.linear(hidden, self.w["lm_head.weight"]).to(torch.float32)

"""The streaming Whisper (the duplex audio encoder) over a KV pool of its own: each session's encoder keys and
values stay where the model runs and a chunk's are written in place, instead of the whole cache going into the
`stream.onnx` graph and coming back grown each chunk.

The layers are `export/modules/audio_encoder.py`'s `WhisperEncoder.stream` (the reference's
`get_audio_embedding_streaming`, MiniCPMO45/modeling_minicpmo_unified.py), written as plain functions over the
checkpoint's weights (`apm.*`, `audio_projection_layer.*`, as the export writes them to
`audio_encoder/1/weights.safetensors`): conv stem, learned positions, pre-LayerNorm layers with biased q/v/out
projections and GELU, the final LayerNorm, the projector and the pooling. A Whisper layer is not a Qwen3 layer
(LayerNorm, biases, no rope, its own widths), so it does not run through `PagedDecoder`; it shares the pool
(`KvPool`), its builder and the attention backends, with non-causal rows: a chunk's frames see each other and the
session's whole past, as the graph's mask lets them.
Norms and softmax run in fp32 whatever the weights' dtype (bf16 on the GPU, fp32 on the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from ..audio_mel import CONTEXT_FRAMES
from ..model_config import AudioEncoderDims
from .attention import PagedAttention, Rows
from .build import build_pool, load_weights
from .pool import KvPool, PoolShape


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return functional.layer_norm(x.to(torch.float32), x.shape[-1:], weight.to(torch.float32),
                                 bias.to(torch.float32), 1e-5).to(x.dtype)


class PagedWhisper:
    name = "paged"

    def __init__(self, weights: dict[str, torch.Tensor], dims: AudioEncoderDims, pool: KvPool,
                 attention: PagedAttention, dtype: torch.dtype) -> None:
        self.d = dims
        self.pool = pool
        self.attention = attention
        self.dtype = dtype
        self.device = pool.device
        self.traffic = pool.traffic
        self.w = {name: t.detach().to(self.device, dtype) for name, t in weights.items()}

    @classmethod
    def build(cls, weights: dict[str, torch.Tensor], dims: AudioEncoderDims, *, block_size: int = 16,
              **build: Any) -> PagedWhisper:
        """`build`: `build.build_pool`'s settings (the pool's size, dtypes, attention backend). A session holds
        at most `max_positions` encoder frames (the stream restarts before it would pass them)."""
        shape = PoolShape(dims.layers, dims.heads, dims.d_model // dims.heads, block_size)
        pool, backend, dtype = build_pool(shape, weights, max_tokens=dims.max_positions, **build)
        return cls(weights, dims, pool, backend, dtype)

    def _stem(self, mel: torch.Tensor, mel_mask: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, F] -> [B, T, D]: `WhisperEncoder.stem`, less the context frames."""
        w = self.w
        x = functional.gelu(functional.conv1d(mel, w["apm.conv1.weight"], w["apm.conv1.bias"], padding=1))
        x = x * mel_mask[:, None, :].to(x.dtype)
        x = functional.gelu(functional.conv1d(x, w["apm.conv2.weight"], w["apm.conv2.bias"], stride=2, padding=1))
        drop = (CONTEXT_FRAMES + 1) // 2
        return x.transpose(1, 2)[:, drop:-drop]

    def _layer(self, i: int, x: torch.Tensor, slots: torch.Tensor, rows: Rows) -> torch.Tensor:
        """One pre-norm Whisper layer over the packed frames x [N, D]; its keys and values go into the pool."""
        w, p = self.w, f"apm.layers.{i}."
        heads = self.d.heads
        n, hd = x.shape[0], self.d.d_model // heads
        h = _layer_norm(x, w[p + "self_attn_layer_norm.weight"], w[p + "self_attn_layer_norm.bias"])
        q = functional.linear(h, w[p + "self_attn.q_proj.weight"], w[p + "self_attn.q_proj.bias"]).view(n, heads, hd)
        k = functional.linear(h, w[p + "self_attn.k_proj.weight"]).view(n, heads, hd)  # k_proj has no bias
        v = functional.linear(h, w[p + "self_attn.v_proj.weight"], w[p + "self_attn.v_proj.bias"]).view(n, heads, hd)
        self.pool.write(i, slots, k, v)
        a = self.attention(q, self.pool.key[i], self.pool.value[i], rows)  # scaled by hd ** -0.5, as Whisper's q
        o = w[p + "self_attn.out_proj.weight"], w[p + "self_attn.out_proj.bias"]
        x = x + functional.linear(a.reshape(n, -1), *o)
        h = _layer_norm(x, w[p + "final_layer_norm.weight"], w[p + "final_layer_norm.bias"])
        h = functional.gelu(functional.linear(h, w[p + "fc1.weight"], w[p + "fc1.bias"]))
        return x + functional.linear(h, w[p + "fc2.weight"], w[p + "fc2.bias"])

    def encode(self, seqs: list[int], pasts: list[int], mel: np.ndarray, mel_mask: np.ndarray) -> np.ndarray:
        """Rows of equal frames: mel [B, n_mels, F] (a chunk and its context), mel_mask [B, F]; row r's encoder
        frames go to positions pasts[r] .. of pool session seqs[r]. Returns the embeddings [B, T / pool, H] on
        the host (the only thing that comes back)."""
        w, up = self.w, self.traffic.upload
        x = self._stem(up("inputs", mel, self.device).to(self.dtype), up("inputs", mel_mask, self.device))
        b, t, dim = x.shape
        for seq, past in zip(seqs, pasts, strict=True):
            self.pool.reserve(seq, past + t)  # a no-op when the stage reserved the chunk at its check
        positions = np.concatenate([np.arange(p, p + t) for p in pasts])
        x = (x.reshape(b * t, dim) + w["apm.embed_positions.weight"][up("inputs", positions, self.device)])
        slots = up("inputs", torch.cat([self.pool.slots(s, p, t) for s, p in zip(seqs, pasts, strict=True)]),
                   self.device)
        rows = Rows(self.pool.block_table(seqs, [p + t for p in pasts]), list(pasts), [t] * b, causal=False)
        for i in range(self.d.layers):
            x = self._layer(i, x, slots, rows)
        x = _layer_norm(x, w["apm.layer_norm.weight"], w["apm.layer_norm.bias"])
        x = functional.linear(functional.relu(functional.linear(x, w["audio_projection_layer.linear1.weight"],
                                                                w["audio_projection_layer.linear1.bias"])),
                              w["audio_projection_layer.linear2.weight"], w["audio_projection_layer.linear2.bias"])
        pooled = x.view(b, t // self.d.pool, self.d.pool, -1).to(torch.float32).mean(dim=2)  # AvgPool(pool)
        return self.traffic.download("outputs", pooled)


def load_paged_whisper(folder: Path, dims: AudioEncoderDims, device: str, **build: Any) -> PagedWhisper:
    """The paged streaming Whisper over the exported weights (`folder`/weights.safetensors) on `device`."""
    return PagedWhisper.build(load_weights(folder, device), dims, device=device, **build)

"""The audio encoder: Whisper's encoder (`apm.*`) -> projector (`audio_projection_layer.*`) -> AvgPool(pool), the one
definition the ONNX graphs are traced from (export/modules/audio_encoder.py: a whole utterance, `model.onnx`; a
duplex chunk against the session's past, `stream.onnx`, through a `DenseCache`) and the device engine runs
(`PagedWhisper` in engine/whisper.py: the chunk through a `PoolCache`).

Names and shapes are the checkpoint's (transformers' `WhisperEncoder` under `apm.`, MiniCPM-o's
`audio_projection_layer.linear1/linear2`), so a state dict loads without renaming:
  apm.conv1.{weight,bias}             [D, n_mels, 3], [D]
  apm.conv2.{weight,bias}             [D, D, 3], [D] (stride 2: 50 frames/s)
  apm.embed_positions.weight          [max_positions, D]
  apm.layers.{i}.self_attn_layer_norm.{weight,bias}, final_layer_norm.{weight,bias}  [D]
  apm.layers.{i}.self_attn.{q,v,out}_proj.{weight,bias}  [D, D], [D]; k_proj.weight [D, D] (no bias, as Whisper)
  apm.layers.{i}.fc1.{weight,bias}     [ffn, D], [ffn]; fc2: [D, ffn], [D]
  apm.layer_norm.{weight,bias}        [D]
  audio_projection_layer.linear{1,2}  [H, D], [H, H] (H: the LLM's width)
A streamed chunk is MiniCPM-o 4.5's `get_audio_embedding_streaming` (OpenBMB/MiniCPM-o-Demo
MiniCPMO45/modeling_minicpmo_unified.py): the chunk's mel with CONTEXT_FRAMES of context each side through the
conv stem, the context frames dropped, positions continuing the session's, every frame seeing the session's whole
past and the whole chunk. Norms and softmax run in fp32 whatever the weights' dtype (bf16 on the GPU).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from ..media.audio_mel import CONTEXT_FRAMES
from ..model_config import AudioEncoderDims
from .cache import DenseCache, KvCache
from .model import Projector


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.layer_norm(x.to(torch.float32), self.normalized_shape, self.weight.to(torch.float32),
                                     self.bias.to(torch.float32), self.eps).to(x.dtype)


class WhisperAttention(nn.Module):
    """`apm.layers.N.self_attn`: separate q/k/v/out projections; k_proj has no bias. The cache scales q k^T by
    D ** -0.5, which is Whisper's scaling of q."""

    def __init__(self, d: AudioEncoderDims) -> None:
        super().__init__()
        self.heads, self.head_dim = d.heads, d.d_model // d.heads
        self.q_proj = nn.Linear(d.d_model, d.d_model)
        self.k_proj = nn.Linear(d.d_model, d.d_model, bias=False)
        self.v_proj = nn.Linear(d.d_model, d.d_model)
        self.out_proj = nn.Linear(d.d_model, d.d_model)

    def forward(self, x: torch.Tensor, cache: KvCache, layer: int) -> torch.Tensor:  # [..., D] -> [..., D]
        heads = (self.heads, self.head_dim)
        q, k, v = (p(x).unflatten(-1, heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(cache.attend(layer, q, k, v).flatten(-2))


class WhisperLayer(nn.Module):
    def __init__(self, d: AudioEncoderDims) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(d)
        self.self_attn_layer_norm = LayerNorm(d.d_model)
        self.fc1 = nn.Linear(d.d_model, d.ffn)
        self.fc2 = nn.Linear(d.ffn, d.d_model)
        self.final_layer_norm = LayerNorm(d.d_model)

    def forward(self, x: torch.Tensor, cache: KvCache, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cache, layer)
        return x + self.fc2(functional.gelu(self.fc1(self.final_layer_norm(x))))


def block_causal_mask(frames: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, T, T] additive: frame i sees frames of its own `chunk`-frame block and every block before it, as the
    reference's `subsequent_chunk_mask(size, chunk_size, num_left_chunks=-1)` (MiniCPMO45/modeling_minicpmo_unified.py)
    that `get_audio_embedding(chunk_length=1.0)` applies to whole utterances."""
    block = torch.arange(frames) // chunk
    allowed = block[None, :] <= block[:, None]
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


class WhisperEncoder(nn.Module):
    """`apm.*`: conv stem (stride 2 -> 50 frames/s), learned positions [max_positions, D], pre-norm layers."""

    def __init__(self, d: AudioEncoderDims) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(d.n_mels, d.d_model, 3, padding=1)
        self.conv2 = nn.Conv1d(d.d_model, d.d_model, 3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(d.max_positions, d.d_model)
        self.layers = nn.ModuleList(WhisperLayer(d) for _ in range(d.layers))
        self.layer_norm = LayerNorm(d.d_model)

    def stem(self, mel: torch.Tensor, frame_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n_mels, F] -> [B, ceil(F / 2), D]; `frame_mask` zeroes conv1's output where a row has no frame,
        as conv2's own zero padding would at the start of a stream."""
        x = functional.gelu(self.conv1(mel))
        if frame_mask is not None:
            x = x * frame_mask[:, None, :].to(x.dtype)
        return functional.gelu(self.conv2(x)).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: KvCache) -> torch.Tensor:
        """x [B, T, D] the frames with their positions added -> [B, T, D], their keys and values into `cache`."""
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i)
        return self.layer_norm(x)


class AudioEncoder(nn.Module):
    """`apm.*`, `audio_projection_layer.*` (the pooler has no weights)."""

    def __init__(self, d: AudioEncoderDims, llm_hidden: int) -> None:
        super().__init__()
        self.apm = WhisperEncoder(d)
        self.audio_projection_layer = Projector(d.d_model, llm_hidden)
        self.pool = d.pool
        self.chunk_frames = d.chunk_frames

    def project(self, states: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T / pool, H] fp32
        x = self.audio_projection_layer(states).to(torch.float32)
        return functional.avg_pool1d(x.transpose(1, 2), self.pool, self.pool).transpose(1, 2)

    def encode(self, mel: torch.Tensor) -> torch.Tensor:  # [B, n_mels, F] -> [B, F / 2 / pool, H]
        """A whole utterance, block-causal in `chunk_frames` blocks (0: full attention)."""
        x = self.apm.stem(mel)
        t = x.shape[1]
        x = x + self.apm.embed_positions.weight[:t]
        mask = None if self.chunk_frames <= 0 else block_causal_mask(t, self.chunk_frames, x.dtype)
        return self.project(self.apm(x, DenseCache(mask)))

    def stream(
        self,
        mel: torch.Tensor,  # [B, n_mels, 2 + F + 2]: a chunk with CONTEXT_FRAMES of context on each side
        mel_mask: torch.Tensor,  # [B, 2 + F + 2] bool: False on a first chunk's (absent) left context
        position_ids: torch.Tensor,  # [B, F / 2]: the session's positions so far, then on
        cache: KvCache,  # the session's past keys and values (every frame sees all of them and the whole chunk)
    ) -> torch.Tensor:  # [B, F / 2 / pool, H] fp32
        drop = (CONTEXT_FRAMES + 1) // 2  # context frames after the stride-2 conv, as the reference removes them
        x = self.apm.stem(mel, mel_mask)[:, drop:-drop]
        return self.project(self.apm(x + self.apm.embed_positions(position_ids), cache))

"""The streaming Whisper (the duplex audio encoder) over a KV pool of its own: each session's encoder keys and
values stay where the model runs and a chunk's are written in place, instead of the whole cache going into the
`stream.onnx` graph and coming back grown each chunk.

It is the stream's KV interface on the device (`stages.audio_encoder.StreamKv`): each stream's place in the pool,
its restarts (a truncation in place), and a group of equal chunks encoded with only the chunks' mel, positions and
slots going up (the pool's one staging copy) and the embeddings staying on the device for the LLM to splice in.

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

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from ..media.audio_mel import CONTEXT_FRAMES, MelChunk, MelStream
from ..model_config import AudioEncoderDims
from .attention import PagedAttention, Rows
from .build import build_pool, load_weights
from .mel import DeviceMel
from .pool import KvPool, PoolShape
from .protocol import PagedCache


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return functional.layer_norm(x.to(torch.float32), x.shape[-1:], weight.to(torch.float32),
                                 bias.to(torch.float32), 1e-5).to(x.dtype)


class PagedWhisper:
    """`stages.audio_encoder.StreamKv` on the device: each stream's encoder keys and values in a pool of its own."""

    name = "paged"

    def __init__(self, weights: dict[str, torch.Tensor], dims: AudioEncoderDims, pool: KvPool,
                 attention: PagedAttention, dtype: torch.dtype) -> None:
        self.d = dims
        self.pool = pool
        self.attention = attention
        self.dtype = dtype
        self.device = pool.device
        self.traffic = pool.traffic
        self.staging = pool.writes.staging
        self.w = {name: t.detach().to(self.device, dtype) for name, t in weights.items()}
        self._restarted: dict[int, int] = {}  # restarts of each pool entry (its frames rewritten from 0)
        self._mel: DeviceMel | None = None
        # the pool's host tables and its staging: a stream's reservation or release (the engine thread) and an
        # encode's staging (the preparation thread) take it; the compute runs outside it
        self.lock = threading.RLock()

    @classmethod
    def build(cls, weights: dict[str, torch.Tensor], dims: AudioEncoderDims, *, block_size: int = 16,
              **build: Any) -> PagedWhisper:
        """`build`: `build.build_pool`'s settings (the pool's size, dtypes, attention backend). A session holds
        at most `max_positions` encoder frames (the stream restarts before it would pass them)."""
        shape = PoolShape(dims.layers, dims.heads, dims.d_model // dims.heads, block_size)
        pool, backend, dtype = build_pool(shape, max_tokens=dims.max_positions, **build)
        return cls(weights, dims, pool, backend, dtype)

    # ---- the streams' places in the pool (`StreamKv`) ----
    def _due(self, length: int, frames_after_conv: int) -> bool:
        return length + frames_after_conv >= self.d.max_positions

    def reserve(self, stream: Any, frames: int) -> None:
        if not isinstance(stream.cache, PagedCache):
            stream.cache = PagedCache(self.pool.open(frames), 0)
        elif not self._due(stream.cache.length, frames + 2):  # a restart needs no more than the stream holds
            self.pool.reserve(stream.cache.seq, stream.cache.length + frames)

    def release(self, stream: Any) -> None:
        if isinstance(stream.cache, PagedCache):
            self.pool.free(stream.cache.seq)
            self._restarted.pop(stream.cache.seq, None)
        stream.cache = None

    def restart(self, stream: Any, due: bool) -> None:
        """A restart is a truncation: the stream keeps its place (and its admitted room). A stream undone after its
        entry restarted holds a length over frames the restart rewrote: it restarts too."""
        cache = stream.cache
        assert isinstance(cache, PagedCache)
        if due or stream.restarts != self._restarted.get(cache.seq, 0):
            self.pool.truncate(cache.seq, 0)
            stream.cache = cache.truncated(0)
            stream.restarts = self._restarted[cache.seq] = self._restarted.get(cache.seq, 0) + 1

    def mels(self, items: list[tuple[MelStream, np.ndarray]], filters: np.ndarray) -> list[MelChunk]:
        """The chunks' mel on the device, batched (engine/mel.py)."""
        if self._mel is None:
            self._mel = DeviceMel(filters, self.pool.writes, self.lock)
        return self._mel.push(items)

    def encode(self, streams: list[Any], chunks: list[MelChunk], frames: int) -> torch.Tensor:
        """The rows' mel laid out on the device (each at the end of `frames`, its missing context masked)."""
        mel = torch.zeros((len(chunks), self.d.n_mels, frames), device=self.device)
        mask = torch.ones((len(chunks), frames), dtype=torch.bool, device=self.device)
        for r, chunk in enumerate(chunks):
            m = torch.as_tensor(chunk.mel, device=self.device)
            mel[r, :, frames - m.shape[1]:] = m
            mask[r, : frames - m.shape[1]] = False
        return self._encode(streams, mel, mask)

    def _encode(self, streams: list[Any], mel: torch.Tensor, mel_mask: torch.Tensor) -> torch.Tensor:
        caches = [s.cache for s in streams]
        embeds = self.forward([c.seq for c in caches], [c.length for c in caches], mel, mel_mask)
        new = (mel.shape[2] - 2 * CONTEXT_FRAMES) // 2
        for stream, cache in zip(streams, caches, strict=True):
            stream.cache = cache.truncated(cache.length + new)
        return embeds

    # ---- the encoder ----
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

    def forward(self, seqs: list[int], pasts: list[int], mel: Any, mel_mask: Any) -> torch.Tensor:
        """Rows of equal frames: mel [B, n_mels, F] (a chunk and its context), mel_mask [B, F], host arrays or
        device tensors; row r's encoder frames go to positions pasts[r] .. of pool session seqs[r]. Returns the
        embeddings [B, T / pool, H] (fp32, on the device: the LLM splices them in there). Its host inputs go in the
        pool's one staging copy."""
        b = len(seqs)
        t = (mel.shape[2] - 2 * CONTEXT_FRAMES) // 2
        put = self.staging.put
        host_mel = isinstance(mel, np.ndarray)
        with self.lock:
            for seq, past in zip(seqs, pasts, strict=True):
                self.pool.reserve(seq, past + t)  # a no-op when the stage reserved the chunk at its check
            staged = (put(np.concatenate([np.arange(p, p + t) for p in pasts])),
                      put(np.concatenate([self.pool.slots(s, p, t) for s, p in zip(seqs, pasts, strict=True)])),
                      put(np.asarray(seqs, np.int64)))
            if host_mel:
                mel_h, mask_h = put(np.asarray(mel, np.float32)), put(np.asarray(mel_mask))
            self.pool.flush()  # the views stay valid until the next flush: the encoder's next (one at a time)
        positions, slots, seq_t = (self.staging.view(h) for h in staged)
        mel_t, mask_t = (self.staging.view(mel_h), self.staging.view(mask_h)) if host_mel else (mel, mel_mask)
        w = self.w
        x = self._stem(mel_t.to(self.dtype), mask_t)
        dim = x.shape[2]
        x = x.reshape(b * t, dim) + w["apm.embed_positions.weight"][positions]
        width = max(self.pool.shape.blocks_for(p + t) for p in pasts)
        rows = Rows(self.pool.device_tables.index_select(0, seq_t)[:, :width], list(pasts), [t] * b, causal=False,
                    seq=seq_t)
        for i in range(self.d.layers):
            x = self._layer(i, x, slots, rows)
        x = _layer_norm(x, w["apm.layer_norm.weight"], w["apm.layer_norm.bias"])
        x = functional.linear(functional.relu(functional.linear(x, w["audio_projection_layer.linear1.weight"],
                                                                w["audio_projection_layer.linear1.bias"])),
                              w["audio_projection_layer.linear2.weight"], w["audio_projection_layer.linear2.bias"])
        return x.view(b, t // self.d.pool, self.d.pool, -1).to(torch.float32).mean(dim=2)  # AvgPool(pool)


def load_paged_whisper(folder: Path, dims: AudioEncoderDims, device: str, **build: Any) -> PagedWhisper:
    """The device streaming Whisper over the exported weights (`folder`/weights.safetensors) on `device`."""
    return PagedWhisper.build(load_weights(folder, device), dims, device=device, **build)

"""The streaming Whisper (the duplex audio encoder) over a KV pool of its own: each session's encoder keys and
values stay where the model runs and a chunk's are written in place, instead of the whole cache going into the
`stream.onnx` graph and coming back grown each chunk.

It is the stream's KV interface on the device (`stages.audio_encoder.StreamKv`): each stream's place in the pool,
its restarts (a truncation in place), and a group of equal chunks encoded with only the rows' sessions and lengths
going up (the pool's one staging copy) and the embeddings staying on the device for the LLM to splice in. A chunk
of at most 1 s (the duplex stream's) runs the fixed-shape step (engine/whisper_chunks.py: rows padded to a bucket,
50 frames a row), replayed as a CUDA graph per (bucket, table width) on a GPU (engine/graphs.py), eagerly elsewhere;
a longer one (a direct caller's) the varlen forward, eagerly.

The network is `AudioEncoder.stream` (engine/whisper_model.py, the one definition the `stream.onnx` graph is traced
from) over the exported weights (`audio_encoder/1/weights.safetensors`), its keys and values through a `PoolCache`.
A Whisper layer is not a Qwen3 layer (LayerNorm, biases, no rope, its own widths), so it does not run through
`PagedDecoder`; it shares the pool (`KvPool`), its builder and the attention backends, with non-causal rows: a
chunk's frames see each other and the session's whole past, as the graph's mask lets them.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..media.audio_mel import CONTEXT_FRAMES, MelChunk, MelStream
from ..model_config import AudioEncoderDims
from .attention import PagedAttention, Rows
from .build import build_pool, load_net, load_weights
from .cache import PoolCache
from .graphs import DecodeGraphs
from .mel import DeviceMel
from .pool import KvPool, PoolShape
from .protocol import PagedCache
from .scheduler import bucket
from .whisper_chunks import CHUNK_FRAMES, MEL_FRAMES, ChunkBatch, chunk_step
from .whisper_model import AudioEncoder


class PagedWhisper:
    """`stages.audio_encoder.StreamKv` on the device: each stream's encoder keys and values in a pool of its own."""

    name = "paged"

    def __init__(self, weights: dict[str, torch.Tensor], dims: AudioEncoderDims, pool: KvPool,
                 attention: PagedAttention, dtype: torch.dtype, graphs: bool | None = None) -> None:
        """`graphs`: the fixed-shape chunk step captured as CUDA graphs (None: on CUDA)."""
        self.d = dims
        self.pool = pool
        self.attention = attention
        self.dtype = dtype
        self.device = pool.device
        self.traffic = pool.traffic
        self.staging = pool.writes.staging
        # the network as its weights are (a stream may restart before its `max_positions` rows)
        net_dims = dataclasses.replace(dims, max_positions=weights["apm.embed_positions.weight"].shape[0])
        llm_hidden = weights["audio_projection_layer.linear1.weight"].shape[0]
        self.net = load_net(lambda: AudioEncoder(net_dims, llm_hidden), weights, self.device, dtype)
        self.chunks = ChunkBatch(pool.trash_seq, dims.n_mels, llm_hidden, dims.pool, pool)
        cuda = self.device.type == "cuda"
        self.graphs = DecodeGraphs(self._chunk_step) if (cuda if graphs is None else graphs) else None
        self._restarted: dict[int, int] = {}  # restarts of each pool entry (its frames rewritten from 0)
        self._mel: DeviceMel | None = None
        # the pool's host tables and its staging: a stream's reservation or release (the engine thread) and an
        # encode's staging (the preparation thread) take it; the compute runs outside it
        self.lock = threading.RLock()

    @classmethod
    def build(cls, weights: dict[str, torch.Tensor], dims: AudioEncoderDims, *, block_size: int = 16,
              graphs: bool | None = None, **build: Any) -> PagedWhisper:
        """`build`: `build.build_pool`'s settings (the pool's size, dtypes, attention backend). A session holds
        at most `max_positions` encoder frames (the stream restarts before it would pass them)."""
        shape = PoolShape(dims.layers, dims.heads, dims.d_model // dims.heads, block_size)
        pool, backend, dtype = build_pool(shape, max_tokens=dims.max_positions, **build)
        return cls(weights, dims, pool, backend, dtype, graphs)

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
        caches = [s.cache for s in streams]
        seqs, pasts = [c.seq for c in caches], [c.length for c in caches]
        new = (frames - 2 * CONTEXT_FRAMES) // 2
        if new <= CHUNK_FRAMES:  # the fixed-shape step
            lo = [frames - c.mel.shape[1] for c in chunks]
            embeds = self.forward_chunks(seqs, pasts, [c.mel for c in chunks], lo, new)
        else:
            mel = torch.zeros((len(chunks), self.d.n_mels, frames), device=self.device)
            mask = torch.ones((len(chunks), frames), dtype=torch.bool, device=self.device)
            for r, chunk in enumerate(chunks):
                m = torch.as_tensor(chunk.mel, device=self.device)
                mel[r, :, frames - m.shape[1]:] = m
                mask[r, : frames - m.shape[1]] = False
            embeds = self.forward(seqs, pasts, mel, mask)
        for stream, cache in zip(streams, caches, strict=True):
            stream.cache = cache.truncated(cache.length + new)
        return embeds

    # ---- the encoder ----
    def forward_chunks(self, seqs: list[int], pasts: list[int], mels: list[Any], lo: list[int], count: int
                       ) -> torch.Tensor:
        """Rows of `count` <= CHUNK_FRAMES new encoder frames through the fixed-shape step: row r's mel [n_mels, n]
        (device tensors, or host arrays: all one or the other) at mel frames lo[r] .. lo[r] + n of its row (before
        lo[r]: a first chunk's absent left context), its frames to positions pasts[r] .. of pool session seqs[r].
        Returns the embeddings [B, count / pool, H] (fp32, on the device: a copy, the batch's buffer is the next
        call's)."""
        b, batch = len(seqs), self.chunks
        rows = bucket(b)
        host = isinstance(mels[0], np.ndarray)
        with self.lock:
            for seq, past in zip(seqs, pasts, strict=True):
                self.pool.reserve(seq, past + count)  # a no-op when the stage reserved the chunk at its check
            meta = np.zeros((rows, 4), np.int64)
            meta[:, 0] = self.pool.trash_seq  # padded rows: the trash row's table, count 0
            meta[:b] = np.stack([seqs, pasts, np.full(b, count), lo], axis=1)  # `ChunkBatch.meta`'s columns
            self.pool.writes.rows(batch.meta, np.arange(rows), meta)
            if host:  # in the same copy
                mel = np.zeros((rows, self.d.n_mels, MEL_FRAMES), np.float32)
                for r, m in enumerate(mels):
                    mel[r, :, lo[r]: lo[r] + m.shape[1]] = m
                self.pool.writes.rows(batch.mel, np.arange(rows), mel)
            self.pool.flush()
        if not host:  # already on the device: laid out there
            batch.mel[:rows].zero_()
            for r, m in enumerate(mels):
                batch.mel[r, :, lo[r]: lo[r] + m.shape[1]].copy_(m)
        need = max(self.pool.shape.blocks_for(p + count) for p in pasts)
        width = self.pool.max_blocks if self.attention.name == "flex" else min(bucket(need), self.pool.max_blocks)
        if self.graphs is not None:
            self.graphs.run((rows, width))
        else:
            self._chunk_step(rows, width)
        return batch.embeds[:b, : count // self.d.pool].clone()

    def _chunk_step(self, rows: int, width: int) -> None:
        chunk_step(self.net, self.pool, self.attention, self.chunks, self.dtype, rows, width)

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
        width = max(self.pool.shape.blocks_for(p + t) for p in pasts)
        rows = Rows(self.pool.device_tables.index_select(0, seq_t)[:, :width], list(pasts), [t] * b, causal=False,
                    seq=seq_t)
        return self.net.stream(mel_t.to(self.dtype), mask_t, positions.view(b, t),
                               PoolCache(self.pool, self.attention, slots, rows))


def load_paged_whisper(folder: Path, dims: AudioEncoderDims, device: str, **build: Any) -> PagedWhisper:
    """The device streaming Whisper over the exported weights (`folder`/weights.safetensors) on `device`."""
    return PagedWhisper.build(load_weights(folder, device), dims, device=device, **build)

"""Attention over a KV pool's blocks: two kinds of batch, two backends.

A **decode** batch (`Decode`) is static: one new token per row of a batch bucket, every row's table, length and
pool session read from the persistent batch's device buffers, the shapes fixed by the bucket (rows) and the table
width; idle rows point at the pool's trash block and see one zero key. Nothing in it is data-dependent, so it runs
inside a CUDA graph and makes the host wait for nothing. A **varlen** batch (`Rows`: prefills, an encoder's chunks)
is packed without padding, its rows' counts known on the host; it runs eagerly, beside the decode graph. A
**chunk** batch (`Chunks`: the streaming Whisper's fixed-shape chunk) is static like a decode batch: every row T
queries (a 1 s chunk's 50 encoder frames, a shorter one's padded), each row's past, real frame count and pool session
read from device buffers, non-causal (a frame sees its row's past and every real frame of its chunk); a padded row
(count 0) reads the trash block, like an idle decode row. It runs inside the Whisper's CUDA graph per (rows, width).

Backends (`pick_attention`):
- `GatherAttention` (plain torch, any device; the CPU's): decode gathers each row's table into [B, W * block, ...]
  and masks past its length; varlen gathers each row's blocks in turn. Softmax in fp32.
- `FlexAttention` (CUDA): torch's `flex_attention` over the pool itself, [1, kv_heads, blocks * block_size, D],
  its block mask built from the same buffers (`BlockMask.from_kv_blocks`: a row's table and block count) with a
  mask_mod that reads the pool's per-block owner and logical index (`pool.py`), so each row visits only its own
  blocks, read in place. Decode is compiled at static shapes (the bucket's rows, the pool's whole table width:
  the fused kernel visits only the listed blocks), so inductor takes its split-KV decoding kernel (0.06 ms a layer
  on an H200 at 32 sessions against the generic kernel's 0.5) and the CUDA graph captures it.

Why flex and not FlashInfer's `BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True)` or flash-attn's
`flash_attn_with_kvcache(block_table=, cache_seqlens=)`: all three read a paged pool from static buffers and graph
well; flex ships inside torch (nothing to build or pin against the CUDA and torch versions, nothing to download on
a GPU host without internet), reads the pool layout we have (FlashInfer wants its own [blocks, 2, ...] layout and a
plan() per batch outside the graph; flash-attn wants 256-token blocks for its paged path and a build per CUDA
version), its decode kernel measured 0.06 ms a layer on the H200 (docs/performance.md), and the same masking code
runs unfused on the CPU, so it is tested here against the gather. Its costs: a compile per bucket, 128-token blocks
(its KV tile), and bf16 only (an fp8 pool is read by the gather's dequantising path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Rows:
    """A varlen forward: row r's new tokens are q[start[r] : start[r] + count[r]], at positions past[r] ..
    past[r] + count[r] - 1 of its session; `table` [B, W] its blocks (on the device)."""

    table: torch.Tensor
    past: list[int]
    count: list[int]
    causal: bool = True  # False: each new token sees all of its row's new tokens too (an encoder's chunk)
    seq: torch.Tensor | None = None  # [B] the rows' pool sessions (flex's mask)

    @property
    def start(self) -> list[int]:
        out, at = [], 0
        for n in self.count:
            out.append(at)
            at += n
        return out


@dataclass
class Decode:
    """A static decode batch: one query a row. All device tensors, views of persistent buffers or made from them."""

    table: torch.Tensor  # [B, W] int64 block ids (the trash block past a row's blocks, and for idle rows)
    length: torch.Tensor  # [B] int64 keys each row sees (its new token's included; 1 for an idle row)
    seq: torch.Tensor  # [B] int64 its pool session (the pool's trash row for an idle row)
    frames = 1  # queries a row

    @property
    def visible(self) -> torch.Tensor:
        return self.length


@dataclass
class Chunks:
    """A static encoder batch: B rows of `frames` queries each (q [B * frames, heads, D], row-major), non-causal. Row
    r's real frames are its first count[r], at positions past[r] ..; every frame sees keys [0, past[r] + count[r]) of
    its row (at least one: a padded row, count 0, sees the trash block's first key). All device tensors."""

    table: torch.Tensor  # [B, W] int64 block ids (the trash block past a row's blocks, and for padded rows)
    past: torch.Tensor  # [B] int64 frames the row's session held before this chunk
    count: torch.Tensor  # [B] int64 the chunk's real frames (0: a padded row)
    seq: torch.Tensor  # [B] int64 its pool session (the pool's trash row for a padded row)
    frames: int  # T: queries a row

    @property
    def visible(self) -> torch.Tensor:  # [B] keys each row's queries see
        return (self.past + self.count).clamp(min=1)


Meta = Rows | Decode | Chunks


class PoolMaps(Protocol):
    owner: torch.Tensor
    logical: torch.Tensor


class PagedAttention(Protocol):
    name: str

    def __call__(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: Meta) -> torch.Tensor:
        """q [N, heads, D] (new tokens, already written to the pool); key/value: one layer's pool
        [blocks, block_size, kv_heads, D]. Returns [N, heads, D]."""
        ...


class GatherAttention:
    name = "gather"

    def __call__(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: Meta) -> torch.Tensor:
        if isinstance(meta, Rows):
            return self.varlen(q, key, value, meta)
        return self.static(q, key, value, meta.table, meta.visible, meta.frames)

    @staticmethod
    def static(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: torch.Tensor, visible: torch.Tensor,
               t: int) -> torch.Tensor:
        """Rows of `t` queries each (q [B * t, heads, D], row-major), each over its table's first visible[b] keys."""
        n, heads, d = q.shape
        b = table.shape[0]
        block_size, kv_heads = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        width = table.shape[1] * block_size
        # [B, W * block, kv_heads, D] -> [B, kv_heads, D, K] and [B, kv_heads, K, D]
        k = key[table].reshape(b, width, kv_heads, d).to(torch.float32).permute(0, 2, 3, 1)
        v = value[table].reshape(b, width, kv_heads, d).to(torch.float32).transpose(1, 2)
        # [B * t, heads, D] -> [B, kv_heads, groups * t, D]: each KV head serves its group of queries as one matmul
        qr = q.to(torch.float32).view(b, t, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, d)
        scores = (qr @ k) * d**-0.5  # [B, kv_heads, groups * t, K]
        seen = torch.arange(width, device=q.device)[None, :] < visible[:, None]  # [B, K]
        scores = scores.masked_fill(~seen[:, None, None, :], torch.finfo(torch.float32).min)
        # past a row's keys the pool holds whatever it held (never written, or another session's): a weight of 0
        # times a NaN there would still be NaN
        v = v.masked_fill(~seen[:, None, :, None], 0.0)
        out = torch.softmax(scores, dim=-1) @ v  # [B, kv_heads, groups * t, D]
        return out.view(b, kv_heads, groups, t, d).permute(0, 3, 1, 2, 4).reshape(n, heads, d).to(q.dtype)

    @staticmethod
    def varlen(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: Rows) -> torch.Tensor:
        heads, d = q.shape[1], q.shape[2]
        block_size, kv_heads = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        out = torch.empty_like(q)
        for r, (start, past, count) in enumerate(zip(rows.start, rows.past, rows.count, strict=True)):
            total = past + count
            blocks = rows.table[r, : -(-total // block_size)]
            k = key[blocks].reshape(-1, kv_heads, d)[:total].to(torch.float32).permute(1, 2, 0)
            v = value[blocks].reshape(-1, kv_heads, d)[:total].to(torch.float32).transpose(0, 1)
            qr = q[start : start + count].to(torch.float32).reshape(count, kv_heads, groups, d)
            qr = qr.permute(1, 2, 0, 3).reshape(kv_heads, groups * count, d)
            scores = (qr @ k) * d**-0.5  # [kv_heads, groups * count, total]
            if count > 1 and rows.causal:  # token i of the row sees up to past + i
                query_pos = past + torch.arange(count, device=q.device).repeat(groups)
                visible = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]
                scores = scores.masked_fill(~visible[None], torch.finfo(torch.float32).min)
            o = torch.softmax(scores, dim=-1) @ v  # [kv_heads, groups * count, D]
            out[start : start + count] = o.reshape(kv_heads, groups, count, d).permute(2, 0, 1, 3).reshape(
                count, heads, d).to(q.dtype)
        return out


Q_BLOCK = 128  # flex's query tile: a decode row (one token) is one tile


def _flex_decode(*args: Any, **kwargs: Any) -> Any:
    """flex_attention under its own code object: its static-shape compiles are cached apart from the varlen ones."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


def _flex_chunks(*args: Any, **kwargs: Any) -> Any:
    """The Whisper's fixed-shape chunks: static compiles of their own (one per rows bucket)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


class FlexAttention:
    """flex_attention over the pool; the block mask from the batch's buffers and the pool's maps."""

    name = "flex"

    def __init__(self, maps: PoolMaps, compiled: bool) -> None:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        self.maps = maps
        self._block_mask = BlockMask
        self._flex: Any = torch.compile(flex_attention, dynamic=True) if compiled else flex_attention
        # decode: static shapes per bucket (inductor's decoding kernel takes only a static batch)
        self._decode: Any = torch.compile(_flex_decode, dynamic=False) if compiled else flex_attention
        self._chunks: Any = torch.compile(_flex_chunks, dynamic=False) if compiled else flex_attention
        self._mask: tuple[Meta, Any] | None = None  # one forward's mask, shared by its layers

    def _static_mask(self, table: torch.Tensor, visible: torch.Tensor, seq: torch.Tensor, t: int, n_blocks: int,
                     block_size: int) -> Any:
        """A static batch's (`Decode`, `Chunks`): row b's `t` queries see its blocks' first visible[b] keys."""
        owner, logical = self.maps.owner, self.maps.logical

        def mask_mod(b, h, q_idx, kv_idx):  # flex's signature: scalar tensors
            block = kv_idx // block_size
            return (owner[block] == seq[b]) & (logical[block] * block_size + kv_idx % block_size < visible[b])

        b, w = table.shape
        q_blocks = -(-t // Q_BLOCK)
        num = ((visible + block_size - 1) // block_size).to(torch.int32)[:, None, None].expand(b, 1, q_blocks)
        indices = table.to(torch.int32)[:, None, None, :].expand(b, 1, q_blocks, w)
        return self._block_mask.from_kv_blocks(num.contiguous(), indices.contiguous(),
                                               BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
                                               seq_lengths=(t, n_blocks * block_size), compute_q_blocks=False)

    def _varlen_mask(self, rows: Rows, n_blocks: int, block_size: int, dev: torch.device) -> tuple[Any, int]:
        b, t = len(rows.count), max(rows.count)
        owner, logical = self.maps.owner, self.maps.logical
        count = torch.tensor(rows.count, device=dev)  # a varlen forward is eager and its counts host-known
        past = torch.tensor(rows.past, device=dev)
        assert rows.seq is not None, "flex needs the rows' pool sessions"
        seq = rows.seq
        causal = rows.causal

        def mask_mod(bi, h, q_idx, kv_idx):
            block = kv_idx // block_size
            pos = logical[block] * block_size + kv_idx % block_size
            last = past[bi] + (torch.minimum(q_idx, count[bi] - 1) if causal else count[bi] - 1)
            return (owner[block] == seq[bi]) & (pos <= last)

        q_blocks = -(-t // Q_BLOCK)
        used = (past + count + block_size - 1) // block_size
        indices = rows.table.to(torch.int32)[:, None, None, :].expand(b, 1, q_blocks, rows.table.shape[1])
        num = used.to(torch.int32)[:, None, None].expand(b, 1, q_blocks)
        mask = self._block_mask.from_kv_blocks(num.contiguous(), indices.contiguous(),
                                               BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
                                               seq_lengths=(t, n_blocks * block_size), compute_q_blocks=False)
        return mask, t

    def __call__(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: Meta) -> torch.Tensor:
        n_blocks, block_size, kv_heads, d = key.shape
        k = key.reshape(1, n_blocks * block_size, kv_heads, d).transpose(1, 2).to(q.dtype)
        v = value.reshape(1, n_blocks * block_size, kv_heads, d).transpose(1, 2).to(q.dtype)
        if not isinstance(meta, Rows):  # a static batch: rows of `t` queries
            t = meta.frames
            if self._mask is None or self._mask[0] is not meta:
                self._mask = (meta, self._static_mask(meta.table, meta.visible, meta.seq, t, n_blocks, block_size))
            b = meta.table.shape[0]  # the pool is one "sequence" every row shares: a key batch of 1, broadcast
            flex = self._chunks if isinstance(meta, Chunks) else self._decode
            out = flex(q.view(b, t, q.shape[1], d).transpose(1, 2), k, v, block_mask=self._mask[1],
                       enable_gqa=True)  # [B, heads, t, D]
            return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], d)
        if self._mask is None or self._mask[0] is not meta:
            self._mask = (meta, self._varlen_mask(meta, n_blocks, block_size, q.device))
        mask, t = self._mask[1]
        b = len(meta.count)
        starts = torch.tensor(meta.start, device=q.device)
        counts = torch.tensor(meta.count, device=q.device)
        row_of = torch.repeat_interleave(torch.arange(b, device=q.device), counts, output_size=q.shape[0])
        col_of = torch.arange(q.shape[0], device=q.device) - starts[row_of]
        padded = q.new_zeros(b, t, q.shape[1], d)
        padded[row_of, col_of] = q
        out = self._flex(padded.transpose(1, 2), k, v, block_mask=mask, enable_gqa=True)  # [B, heads, t, D]
        return out.transpose(1, 2)[row_of, col_of]


def flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def pick_attention(device: torch.device, maps: PoolMaps, prefer: str = "auto", compiled: bool | None = None
                   ) -> PagedAttention:
    """`auto`: flex on CUDA where it imports, the gather elsewhere; `flex` / `gather` to choose. `compiled`: flex
    compiled (None: on CUDA)."""
    if prefer == "flex" or (prefer == "auto" and flex_available(device)):
        return FlexAttention(maps, compiled=device.type == "cuda" if compiled is None else compiled)
    return GatherAttention()


"""The streaming Whisper's fixed-shape chunk: what a CUDA graph captures per (rows bucket, table width).

Every row is CHUNK_FRAMES encoder frames (a 1 s chunk: 2 * 50 mel frames and CONTEXT_FRAMES of context each side);
a shorter chunk is padded after its right context with zeros and masked (its padded frames write to the pool's trash
slot and no real frame sees them), the rows padded to a bucket (1, 2, 4, ...) with rows of count 0 over the trash block.
What changes per call lives in persistent buffers (`ChunkBatch`): each row's (pool session, past frames, real
frames, first real mel frame) written by the pool's one staging copy, and the mel written in place (a device mel:
copied there on the device; a host one: in the same staging copy). The step derives everything else on the device
from them -- positions, slots, block tables, the mel mask, the attention's `Chunks` batch -- so it reads no host
list, makes the host wait for nothing and reads and writes the same storages every call of a key; its output goes to
`ChunkBatch.embeds`, which the caller copies out (the next call's step overwrites it).
"""

from __future__ import annotations

import torch

from ..media.audio_mel import CONTEXT_FRAMES
from .attention import Chunks, PagedAttention
from .cache import PoolCache
from .pool import KvPool
from .scheduler import bucket
from .whisper_model import AudioEncoder

CHUNK_FRAMES = 50  # encoder frames a row: a 1 s chunk (the stride-2 conv stem's 50 frames a second)
MEL_FRAMES = 2 * CHUNK_FRAMES + 2 * CONTEXT_FRAMES  # a row's mel: the chunk and its context on each side


class ChunkBatch:
    """The chunk step's persistent buffers, `rows` of them (the largest bucket)."""

    def __init__(self, max_rows: int, n_mels: int, hidden: int, pool_size: int, pool: KvPool) -> None:
        dev = pool.device
        self.rows = bucket(max_rows)
        self.mel = torch.zeros(self.rows, n_mels, MEL_FRAMES, device=dev)  # fp32, cast in the step
        # a row's (pool session, frames before the chunk, the chunk's real frames, its first real mel frame)
        self.meta = torch.zeros(self.rows, 4, dtype=torch.int64, device=dev)
        self.meta[:, 0] = pool.trash_seq
        self.embeds = torch.zeros(self.rows, CHUNK_FRAMES // pool_size, hidden, device=dev)  # [R, 10, H] fp32
        self.frames = torch.arange(CHUNK_FRAMES, device=dev)
        self.mel_frames = torch.arange(MEL_FRAMES, device=dev)


def chunk_step(net: AudioEncoder, pool: KvPool, attention: PagedAttention, batch: ChunkBatch, dtype: torch.dtype,
               rows: int, width: int) -> None:
    """Rows [0, rows) of `batch` through the encoder, each over `width` blocks of its table: their keys and values
    into the pool, their embeddings into `batch.embeds[:rows]`."""
    bs = pool.shape.block_size
    seq, past, count, lo = batch.meta[:rows].unbind(1)
    real = batch.frames[None, :] < count[:, None]  # [R, T]
    pos = past[:, None] + batch.frames[None, :]
    table = pool.device_tables.index_select(0, seq)[:, :width]  # [R, W]
    block = table.gather(1, (pos // bs).clamp(max=width - 1))
    slots = torch.where(real, block * bs + pos % bs, pool.trash_slot).flatten()  # [R * T]
    # before lo: a first chunk's absent left context, masked as the varlen path's conv stem sees it (after the chunk's
    # right context, a short chunk's zero padding feeds only its padded frames: the stride-2 stem's frame t reads
    # mel frames up to 2t + 1)
    mel_mask = batch.mel_frames[None, :] >= lo[:, None]
    meta = Chunks(table, past, count, seq, CHUNK_FRAMES)
    out = net.stream(batch.mel[:rows].to(dtype), mel_mask, torch.where(real, pos, 0),
                     PoolCache(pool, attention, slots, meta))
    batch.embeds[:rows].copy_(out)

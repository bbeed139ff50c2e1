"""A decoder's KV cache as one pool of fixed-size blocks, resident where the model runs (GPU memory on CUDA).

Every layer has one preallocated key tensor and one value tensor, [blocks + 1, block_size, kv_heads, head_dim];
a session owns a block table (its blocks in order), so a token at position p lives in block
`table[p // block_size]`, row `p % block_size`. New tokens are written in place and attention reads the blocks
in place: nothing is copied per step, nothing is padded to the longest session, nothing is concatenated.
Rollback, undo and a turn's reset are `truncate`; END and eviction are `free`. The pool never grows: a step
that would not fit is refused before it runs (`reserve` raises `PoolFull`, a retryable coded error).

The last block is the trash block: never handed out, zeroed, it takes the writes of a batch's idle rows and is
what their tables point at, so a static batch needs no mask to skip them. The device keeps, beside the tables,
each physical block's owner and its index in the owner's table (the attention's mask reads them); all three
change only when blocks are handed out or given back, by writes queued for the next iteration's one copy
(`staging.DeviceWrites`), never on the decode path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import Code, StepError
from .memory_plan import CPU_MEMORY
from .staging import DeviceWrites, Staging
from .traffic import Traffic


class PoolFull(StepError):
    """The KV pool has no room for this session now; the same request may succeed once others end."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.POOL_FULL, message)


@dataclass(frozen=True)
class PoolShape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int = 16

    def token_bytes(self, dtype: torch.dtype) -> int:
        """Keys and values of one token over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty(0, dtype=dtype).element_size()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def blocks_in_budget(shape: PoolShape, dtype: torch.dtype, budget_bytes: int) -> int:
    return budget_bytes // (shape.token_bytes(dtype) * shape.block_size)


def device_memory(device: torch.device) -> int:
    """The device's whole memory (a CPU counts as `memory_plan.CPU_MEMORY`): what the memory plan shares out."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return CPU_MEMORY


def budget_bytes(size: float, device: torch.device) -> int:
    """A pool built without a plan (tests, benches): `size` > 1 gigabytes, else that fraction of the device's memory.
    The models' pools come from the memory plan (`memory_plan.plan_pools`)."""
    return int(size * 2**30) if size > 1 else int(size * device_memory(device))


class KvPool:
    """`max_sessions` sessions of at most `max_tokens` tokens each; their block tables live on the device too
    (one row per session, written as blocks are handed out), so a step uploads no table."""

    def __init__(self, shape: PoolShape, num_blocks: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_sessions: int = 256, max_tokens: int = 8192,
                 traffic: Traffic | None = None, zeroed: bool = True, writes: DeviceWrites | None = None) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self.traffic = traffic or Traffic()
        self.writes = writes or DeviceWrites(Staging(self.device, self.traffic))
        self.trash = num_blocks  # the block idle rows write to and read from
        self.trash_seq = max_sessions  # the table row of idle rows: every entry the trash block
        dims = (num_blocks + 1, shape.block_size, shape.kv_heads, shape.head_dim)
        # unzeroed, a CPU pool's pages are committed only as blocks are first written (a reader that looks only at
        # a row's real positions never sees the rest); the trash block is zeroed either way
        alloc = torch.zeros if zeroed else torch.empty
        self.key = [alloc(dims, dtype=dtype, device=self.device) for _ in range(shape.layers)]
        self.value = [alloc(dims, dtype=dtype, device=self.device) for _ in range(shape.layers)]
        for t in (*self.key, *self.value):
            t[self.trash].zero_()
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest block is handed out first
        self._free_seqs = list(range(max_sessions - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self._floor: dict[int, int] = {}  # blocks a session keeps whatever its length (its admission's room)
        self.max_blocks = shape.blocks_for(max_tokens)
        self.device_tables = torch.full((max_sessions + 1, self.max_blocks), self.trash, dtype=torch.int64,
                                        device=self.device)
        # per physical block: the session that holds it (-1: free) and its index in that session's table
        self.owner = torch.full((num_blocks + 1,), -1, dtype=torch.int64, device=self.device)
        self.logical = torch.zeros(num_blocks + 1, dtype=torch.int64, device=self.device)
        self.owner[self.trash] = self.trash_seq

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.block_size * self.shape.token_bytes(self.dtype)

    @property
    def trash_slot(self) -> int:
        return self.trash * self.shape.block_size

    def room(self, tokens: int) -> bool:
        return self.shape.blocks_for(tokens) <= self.free_blocks

    def open(self, admit_tokens: int) -> int:
        """A new session's id, admitted only if `admit_tokens` fit now and a table row is free. Its first
        `admit_tokens` of room are its own from now on (truncation keeps them), so sessions admitted together
        cannot overcommit the pool."""
        if not self.room(admit_tokens) or not self._free_seqs:
            raise PoolFull(f"the KV pool has {self.free_blocks} free blocks of {self.num_blocks} and "
                           f"{len(self._free_seqs)} free sessions; a session needs room for {admit_tokens} tokens: "
                           "retry later")
        seq = self._free_seqs.pop()
        self.tables[seq] = []
        self._floor[seq] = self.shape.blocks_for(admit_tokens)
        self.reserve(seq, admit_tokens)
        return seq

    def reserve(self, seq: int, tokens: int) -> None:
        """Blocks for the first `tokens` positions of `seq`, all or nothing (so a step is refused, not cut)."""
        table = self.tables[seq]
        need = self.shape.blocks_for(tokens) - len(table)
        if need > len(self._free):
            raise PoolFull(f"the KV pool has {len(self._free)} free blocks; this step needs {need} more: "
                           "retry later")
        if tokens > self.max_blocks * self.shape.block_size:
            raise StepError(Code.CONTEXT_FULL, f"{tokens} tokens are past the pool's {self.max_blocks} blocks a "
                            "session")
        if need <= 0:
            return
        new = [self._free.pop() for _ in range(need)]
        cols = np.arange(len(table), len(table) + need)
        self.writes.rows(self.device_tables.view(-1), seq * self.max_blocks + cols, np.asarray(new))
        self.writes.rows(self.owner, new, np.full(need, seq))
        self.writes.rows(self.logical, new, cols)
        self.traffic.to_device["state"] += 8 * need  # the new blocks' ids: all a step's state upload is
        table.extend(new)

    def _give_back(self, seq: int, blocks: list[int]) -> None:
        if not blocks:
            return
        cols = np.arange(len(self.tables[seq]), len(self.tables[seq]) + len(blocks))
        self.writes.rows(self.device_tables.view(-1), seq * self.max_blocks + cols, np.full(len(blocks), self.trash))
        self.writes.rows(self.owner, blocks, np.full(len(blocks), -1))
        self._free.extend(reversed(blocks))

    def truncate(self, seq: int, tokens: int) -> None:
        """Keep the first `tokens` positions: the blocks past them go back to the pool."""
        table = self.tables[seq]
        keep = max(self.shape.blocks_for(tokens), self._floor.get(seq, 0))
        if len(table) > keep:
            gone = table[keep:]
            del table[keep:]
            self._give_back(seq, gone)

    def free(self, seq: int) -> None:
        if seq not in self.tables:
            return
        self._floor.pop(seq, None)
        gone = self.tables[seq]
        self.tables[seq] = []
        self._give_back(seq, gone)
        del self.tables[seq]
        self._free_seqs.append(seq)

    def slots(self, seq: int, start: int, count: int) -> np.ndarray:
        """Flat row indices (block * block_size + offset) of positions [start, start + count) of `seq`, on the host."""
        bs = self.shape.block_size
        pos = np.arange(start, start + count)
        table = np.asarray(self.tables[seq], np.int64)
        return table[pos // bs] * bs + pos % bs

    def flush(self) -> None:
        """Apply the queued table and map writes (the engine's iteration does it as part of its one copy)."""
        self.writes.flush()

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens' keys and values [N, kv_heads, head_dim] at flat `slots` [N], in place (an fp8 pool's
        bytes are copied as bytes: there is no fp8 index copy)."""
        flat = (-1, self.shape.kv_heads, self.shape.head_dim)
        for pool, new in ((self.key[layer], key), (self.value[layer], value)):
            new = new.to(self.dtype)
            if self.dtype.itemsize == 1:
                pool, new = pool.view(torch.uint8), new.view(torch.uint8)
            pool.view(flat).index_copy_(0, slots, new)

    def slid_copy(self, seq: int, preserve: int, count: int, length: int, theta: float, gap: int = 0) -> int:
        """A new session id holding `seq`'s first `length` tokens less [preserve, preserve + count): the prefix as
        it is, the suffix moved up to `preserve + gap` with its keys re-rotated to their new positions (the sliding
        window, `duplex_window.drop_tokens`; the `gap` tokens between are left for the caller to feed). A copy,
        not a move, so a step that fails after it can be undone: `seq` is untouched (the stage frees whichever of
        the two its session no longer holds)."""
        new = self.open(0)
        self.reserve(new, length - count + gap)
        kept = length - count - preserve
        src = self.writes.staging.put(np.concatenate([self.slots(seq, 0, preserve),
                                                      self.slots(seq, preserve + count, kept)]))
        dst = self.writes.staging.put(np.concatenate([self.slots(new, 0, preserve),
                                                      self.slots(new, preserve + gap, kept)]))
        self.flush()
        src_t, dst_t = self.writes.staging.view(src), self.writes.staging.view(dst)
        shape = (-1, self.shape.kv_heads, self.shape.head_dim)
        for layer in range(self.shape.layers):
            keys = self.key[layer].view(shape)[src_t].to(torch.float32)
            keys[preserve:] = realign_rope(keys[preserve:], preserve + count, preserve + gap, theta)
            self.write(layer, dst_t, keys, self.value[layer].view(shape)[src_t])
        return new


def _rope_cos_sin(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos()] * 2, -1)[:, None, :], torch.cat([angles.sin()] * 2, -1)[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def realign_rope(keys: torch.Tensor, old_start: int, new_start: int, theta: float) -> torch.Tensor:
    """`duplex_window.realign_rope` on the device: keys [n, kv_heads, D] encoded at old_start.. re-encoded at
    new_start.. (fp32)."""
    n, d = keys.shape[0], keys.shape[-1]
    pos = torch.arange(n, device=keys.device)
    cos_old, sin_old = _rope_cos_sin(d, pos + old_start, theta)
    base = cos_old * keys - sin_old * _rotate_half(keys)
    cos_new, sin_new = _rope_cos_sin(d, pos + new_start, theta)
    return cos_new * base + sin_new * _rotate_half(base)

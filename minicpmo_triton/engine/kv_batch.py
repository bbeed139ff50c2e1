"""Pack several sessions' KV caches into one batched forward and unpack them after.

Each row's past is left-padded to the longest past; `past_mask` marks real entries. After a forward,
the present cache (past + new tokens) becomes the next past, and the new tokens' validity is
appended to the mask, so a decode loop never repacks. A finished row is extracted compactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class KvCache:
    key: np.ndarray  # [layers, kv_heads, length, head_dim]
    value: np.ndarray

    @property
    def length(self) -> int:
        return int(self.key.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.key.nbytes + self.value.nbytes)

    def truncated(self, length: int) -> KvCache:
        return KvCache(self.key[:, :, :length].copy(), self.value[:, :, :length].copy())

    @classmethod
    def empty(cls, layers: int, kv_heads: int, head_dim: int) -> KvCache:
        z = np.zeros((layers, kv_heads, 0, head_dim), np.float32)
        return cls(z, z.copy())


class KvBatch:
    def __init__(self, caches: list[KvCache]) -> None:
        layers, kv_heads, _, head_dim = caches[0].key.shape
        past = max(c.length for c in caches)
        b = len(caches)
        self.key = np.zeros((layers, b, kv_heads, past, head_dim), np.float32)
        self.value = np.zeros_like(self.key)
        self.mask = np.zeros((b, past), bool)
        for row, cache in enumerate(caches):
            n = cache.length
            if n:
                self.key[:, row, :, past - n:] = cache.key
                self.value[:, row, :, past - n:] = cache.value
                self.mask[row, past - n:] = True
        self.positions = np.array([c.length for c in caches], np.int64)  # next position per row

    def feeds(self, new_len: np.ndarray) -> dict[str, np.ndarray]:
        """Cache inputs for a forward whose row r brings new_len[r] real tokens (right-padded)."""
        t = int(new_len.max())
        return {
            "position_ids": self.positions[:, None] + np.arange(t, dtype=np.int64)[None, :],
            "past_mask": self.mask,
            "past_key": self.key,
            "past_value": self.value,
            "last_index": (new_len - 1).astype(np.int64),
        }

    def advance(self, present_key: np.ndarray, present_value: np.ndarray, new_len: np.ndarray) -> None:
        t = present_key.shape[3] - self.key.shape[3]
        self.key, self.value = present_key, present_value
        new_valid = np.arange(t)[None, :] < new_len[:, None]
        self.mask = np.concatenate([self.mask, new_valid], axis=1)
        self.positions = self.positions + new_len

    def select(self, rows: list[int]) -> None:
        mask = self.mask[rows]
        # the past's leading columns that none of the kept rows uses (a longer row's, gone) are dropped with it
        start = int(mask.any(axis=0).argmax()) if mask.any() else mask.shape[1]
        self.key = self.key[:, rows, :, start:]
        self.value = self.value[:, rows, :, start:]
        self.mask = mask[:, start:]
        self.positions = self.positions[rows]

    def extract(self, row: int) -> KvCache:
        keep = self.mask[row]
        return KvCache(
            np.ascontiguousarray(self.key[:, row][:, :, keep]),
            np.ascontiguousarray(self.value[:, row][:, :, keep]),
        )


def right_pad(rows: list[np.ndarray], fill: float | int = 0) -> np.ndarray:
    """Stack 1-D or 2-D arrays of different lengths along a new batch axis, padding at the end."""
    t = max(len(r) for r in rows)
    out = np.full((len(rows), t, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out

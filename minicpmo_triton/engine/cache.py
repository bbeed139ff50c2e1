"""The cache a network's attention takes (gpt-fast's shape: the model is written once, the cache says where the
keys and values live). A layer hands its new tokens' q, k and v to `cache.attend(layer, q, k, v)`; the cache stores
k and v and returns q's attention over every key the layer holds for that row, scaled by D ** -0.5. The cache owns
the attention, not just the update: the pool's backends read its blocks in place (engine/attention.py), so there is
no gathered [past + new] tensor to hand back.

- `DenseCache`: the ONNX graphs' cache, past K/V in and present K/V out, rows padded in a [B, T] batch with an
  additive mask (the host path's `KvBatch` feeds it, export/stages.py traces it).
- `PoolCache`: the device engine's, the KV pool written in place at the new tokens' slots and read over each row's
  blocks (engine/pool.py, engine/attention.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .attention import Meta, PagedAttention
from .pool import KvPool


class KvCache(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [..., heads, D], k / v [..., kv_heads, D]: the new tokens' (rotated where the network rotates).
        Stores k and v; returns q's attention [..., heads, D]."""
        ...


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)


def _real_keys(past_mask: torch.Tensor, t: int) -> torch.Tensor:
    """[B, P + T]: the row's real past keys, then its T new ones."""
    return torch.cat([past_mask, torch.ones(past_mask.shape[0], t, dtype=torch.bool, device=past_mask.device)], dim=1)


class DenseCache:
    """past_key / past_value [L, B, kv_heads, P, D] (None: no past, no present) and `mask` [B or 1, 1, T, P + T]
    additive (None: every token sees every key); q, k, v come as [B, T, heads, D]."""

    def __init__(self, mask: torch.Tensor | None, past_key: torch.Tensor | None = None,
                 past_value: torch.Tensor | None = None) -> None:
        self.mask = mask
        self.past_key, self.past_value = past_key, past_value
        self.new_key: list[torch.Tensor] = []
        self.new_value: list[torch.Tensor] = []

    @classmethod
    def causal(cls, past_mask: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor, t: int) -> DenseCache:
        """A decoder's: each row's past left-padded (`past_mask` [B, P] marks its real keys), its T new tokens
        right-padded; new token i sits at key index P + i and sees the real past and the new keys up to itself
        (causality hides the padding)."""
        p, dev = past_mask.shape[1], past_mask.device
        causal = torch.arange(p + t, device=dev)[None, :] <= (torch.arange(t, device=dev) + p)[:, None]  # [T, P + T]
        return cls(_additive(causal[None, None] & _real_keys(past_mask, t)[:, None, None, :]), past_key, past_value)

    @classmethod
    def full(cls, past_mask: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor, t: int) -> DenseCache:
        """An encoder chunk's: every new token sees the row's real past and all of the chunk (no causality)."""
        return cls(_additive(_real_keys(past_mask, t))[:, None, None, :], past_key, past_value)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        self.new_key.append(k)
        self.new_value.append(v)
        if self.past_key is not None and self.past_value is not None:
            k = torch.cat([self.past_key[layer], k], dim=2)
            v = torch.cat([self.past_value[layer], v], dim=2)
        groups = q.shape[1] // k.shape[1]  # GQA: each KV head serves `groups` query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        if self.mask is not None:
            scores = scores + self.mask
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)  # [B, T, heads, D]

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, B, kv_heads, P + T, D]: the past with every layer's new keys and values after it."""
        assert self.past_key is not None and self.past_value is not None, "a cache without a past has no present"
        return (torch.cat([self.past_key, torch.stack(self.new_key)], dim=3),
                torch.cat([self.past_value, torch.stack(self.new_value)], dim=3))


class PoolCache:
    """The new tokens' keys and values written into `pool` at `slots` [N] (their flat rows), attention by the pool's
    backend over each row's blocks (`meta`: a static decode batch or a varlen one). q, k, v come as [..., heads, D]
    with N tokens in the leading dimensions (packed [N] or a batch of equal rows [B, T])."""

    def __init__(self, pool: KvPool, attention: PagedAttention, slots: torch.Tensor, meta: Meta) -> None:
        self.pool, self.attention, self.slots, self.meta = pool, attention, slots, meta

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool = self.pool
        pool.write(layer, self.slots, k.flatten(0, -3), v.flatten(0, -3))
        out = self.attention(q.flatten(0, -3), pool.key[layer], pool.value[layer], self.meta)
        return out.view(q.shape)

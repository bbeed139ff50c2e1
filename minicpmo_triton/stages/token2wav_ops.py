"""What the device path's flow (token2wav_flow, token2wav_dit) is built of: the official modules' weights called
as plain functions, and the one read and the one write of a slot cache's frames.

Why plain functions: at small widths (the tiny preset, a CPU instance) a chunk's cost is per call, and an
nn.Module's call machinery (hooks, __getattr__, dropout that does nothing in eval) cost as much as the ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F


@dataclass
class Linear:
    """nn.Linear's weights (shared with the module, not copied)."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None

    @classmethod
    def of(cls, m: Any) -> Linear:
        return cls(m.weight.detach(), None if m.bias is None else m.bias.detach())

    @classmethod
    def stacked(cls, *ms: Any) -> Linear:
        """Several linears of one input as one: their outputs side by side (q | k | v)."""
        return cls(torch.cat([m.weight for m in ms]).detach(), torch.cat([m.bias for m in ms]).detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class Norm:
    """nn.LayerNorm's, as `Linear`."""

    shape: tuple[int, ...]
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float

    @classmethod
    def of(cls, m: Any) -> Norm:
        w, b = (None, None) if m.weight is None else (m.weight.detach(), m.bias.detach())
        return cls(tuple(m.normalized_shape), w, b, m.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.layer_norm(x, self.shape, self.weight, self.bias, self.eps)  # F.layer_norm without its checks


@dataclass
class Conv:
    """nn.Conv1d (stride 1, no padding) as one matmul over its input's unfolded windows, channels-last: no
    transposes, and no oneDNN conv call (~0.1 ms a call at these widths)."""

    linear: Linear  # [out, in * k]: the conv's [out, in, k] flattened as unfold lays a window out
    channels: int  # in
    k: int

    @classmethod
    def of(cls, conv: Any) -> Conv:
        if conv.stride != (1,) or conv.padding != (0,) or conv.dilation != (1,) or conv.groups != 1:
            raise ValueError("only a plain conv (stride 1, no padding) is a matmul over windows")
        w = conv.weight.detach()
        return cls(Linear(w.reshape(w.shape[0], -1), conv.bias.detach()), w.shape[1], w.shape[2])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, T, C] -> [R, T - k + 1, out]."""
        r, t, _ = x.shape
        return self.linear(x.unfold(1, self.k, 1).reshape(r, t - self.k + 1, -1))  # windows [R, T-k+1, C * k]


def key_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, K] real keys -> [B, 1, 1, K]: 0 for a key, -inf for padding (added to the scores)."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, float("-inf"))[:, None, None]


def write_frames(frames: torch.Tensor, new: torch.Tensor, kv: torch.Tensor) -> None:
    """A chunk's keys|values kv [B, n, H, 2d] into their slots' frames [slots * F, H, 2d] at `new` [B, n] (flat
    ids), in place."""
    kv = kv.reshape(-1, *kv.shape[2:])
    frames.index_copy_(0, new.reshape(-1), kv if kv.dtype == frames.dtype else kv.to(frames.dtype))


def read_frames(frames: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' keys and values: frames [slots * F, H, 2d] at keys [B, K] -> k, v [B, H, K, d] (one gather)."""
    kv = frames.index_select(0, keys.reshape(-1)).view(*keys.shape, *frames.shape[1:]).transpose(1, 2)
    k, v = (kv if kv.dtype == dtype else kv.to(dtype)).chunk(2, dim=-1)
    return k, v

"""The DiT estimator's Euler step on slot caches, in few ops: the official `DiT` (cosyvoice2.flow.decoder_dit)'s
math on its own weights, laid out so a step is ~40 ops a block instead of ~90 module calls.

Why: a chunk runs 5 steps x depth blocks x 2 guidance rows; at small widths (the tiny preset, a CPU instance) the
cost is per op, not per FLOP, and eager torch's per-op and per-module-call cost made the estimator twice ONNX
Runtime's. What changes against the official forward (same numbers within float32 rounding,
tests/test_token2wav_ring.py and tests/test_token2wav_parity.py hold them):
- the input projection's columns split: mu, spk, cond are the same in every step, so their part of
  `in_proj(pack[x, mu, spk, cond])` is computed once per chunk (`condition`); a step projects x alone;
- q, k, v as one matmul (`to_q|to_k|to_v` stacked), heads kept channels-last, so the cache's keys|values layout
  [rows, frames, H, 2*hd] is written without a transpose;
- the adaLN modulations `x * (1 + scale) + shift` and the gated residuals as one `addcmul` each, (1 + scale)
  computed once per step's time (`StepTime`);
- the block's causal convs (kernel 3 over the cached 2 frames + the chunk) as one matmul over the unfolded
  windows, channels-last, their caches too (no transposes; oneDNN's conv1d costs ~0.1 ms a call at these widths).

Caches are `FlowPool`'s (token2wav_ring): the conv caches [2B, 2, 2*hidden] (both convs' last 2 input frames,
channels-last) and the attention frames [slots * F, H, 2*hd], read and written by flat frame ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .token2wav_ops import Conv, Linear, Norm, read_frames, write_frames


@dataclass
class _BlockTime:
    """A block's adaLN modulations at one step's time: each `modulate(norm(h), shift, scale)` as the LayerNorm's
    own affine (weight 1 + scale, bias shift: one op), and the three gates [1, 1, hidden]."""

    msa: Norm
    conv: Norm
    mlp: Norm
    gates: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # msa, conv, mlp


@dataclass
class StepTime:
    """What an Euler step alone decides, the same for every row: its blocks' modulations, the final layer's
    modulated norm, and the final linear scaled by the step's dt (the Euler update x + dt * v folded in)."""

    blocks: list[_BlockTime]
    final_norm: Norm
    final: Linear


def _modulated(norm: Norm, shift: torch.Tensor, scale: torch.Tensor) -> Norm:
    """`modulate(norm(x), shift, scale)` = norm(x) * (1 + scale) + shift: the plain LayerNorm with that affine."""
    return Norm(norm.shape, (1 + scale).flatten(), shift.flatten(), norm.eps)


@dataclass
class _Block:
    """One DiTBlock's weights, as `LeanDiT` uses them."""

    qkv: Linear  # [3 * H * hd, hidden]: to_q | to_k | to_v
    q_norm: Norm
    k_norm: Norm
    proj: Linear
    conv1: Conv
    conv_norm: Norm  # the conv block's LayerNorm (affine) between its convs
    conv2: Conv
    fc1: Linear
    fc2: Linear
    heads: int
    head_dim: int

    @classmethod
    def of(cls, block: Any) -> _Block:
        a, conv = block.attn, block.conv.block  # conv: Transpose, conv1, Transpose, LayerNorm, Mish, ...conv2...
        return cls(Linear.stacked(a.to_q, a.to_k, a.to_v), Norm.of(a.q_norm), Norm.of(a.k_norm), Linear.of(a.proj),
                   Conv.of(conv[1]), Norm.of(conv[3]), Conv.of(conv[6]), Linear.of(block.mlp.fc1),
                   Linear.of(block.mlp.fc2), a.num_heads, a.head_dim)


class LeanDiT:
    """The official estimator's step (`DiTBlock.forward_chunk` x depth, `FinalLayer`, guidance) over slot caches."""

    def __init__(self, est: Any, rate: float) -> None:
        self.est, self.rate = est, rate
        mels = est.out_channels  # x's channels: the first of in_proj's packed input's
        w = est.in_proj.weight.detach()  # [hidden, 4 * 80]: pack([x, mu, spk, cond])
        self.x_proj = Linear(w[:, :mels].contiguous(), None)
        self.in_bias = est.in_proj.bias.detach()
        self.rest_proj = Linear(w[:, mels:].contiguous(), self.in_bias)
        self.hidden = w.shape[0]
        self.blocks = [_Block.of(b) for b in est.blocks]
        self.norm = Norm.of(est.blocks[0].norm1)  # the blocks' and the final layer's (no affine, eps 1e-6)
        self.final = Linear.of(est.final_layer.linear)
        self._times: dict[tuple[float, float, torch.dtype, str], StepTime] = {}

    def time(self, t: float, dt: float, dtype: torch.dtype, device: torch.device) -> StepTime:
        """A step's modulations, computed once (the schedule's times are fixed): the row-independent part of the
        DiT, out of every chunk's work."""
        key = (t, dt, dtype, str(device))
        if key not in self._times:
            est, norm = self.est, self.norm
            temb = est.t_embedder(torch.full((1,), t, dtype=dtype, device=device)).unsqueeze(1)  # [1, 1, hidden]
            blocks = []
            for b in est.blocks:
                s_msa, c_msa, g_msa, s_mlp, c_mlp, g_mlp, s_conv, c_conv, g_conv = b.adaLN_modulation(temb).chunk(9, -1)
                blocks.append(_BlockTime(_modulated(norm, s_msa, c_msa), _modulated(norm, s_conv, c_conv),
                                         _modulated(norm, s_mlp, c_mlp), (g_msa, g_conv, g_mlp)))
            shift, scale = est.final_layer.adaLN_modulation(temb).chunk(2, -1)
            final = self.final
            assert final.bias is not None
            self._times[key] = StepTime(blocks, _modulated(norm, shift, scale),
                                        Linear(final.weight * dt, final.bias * dt))
        return self._times[key]

    def condition(self, mu: torch.Tensor, spk: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The projected input's part that every step shares: mu, cond [B, 80, n], spk [B, 80] -> [2, B, n,
        hidden]: the conditional rows' in_proj of (mu, spk, cond) with its bias, the unconditional rows' (zeros)
        the bias alone."""
        b, _, n = mu.shape
        packed = torch.cat([mu, spk[:, :, None].expand(b, spk.shape[1], n), cond], dim=1).transpose(1, 2)
        cond_rows = self.rest_proj(packed)
        return torch.stack([cond_rows, self.in_bias.expand_as(cond_rows)])

    def step(self, x: torch.Tensor, condition: torch.Tensor, time: StepTime, cnn: torch.Tensor,
             frames: list[torch.Tensor], keys: torch.Tensor, new: torch.Tensor,
             bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One Euler step: x [B, 80, n], `condition` [2, B, n, hidden], the step's conv caches [depth, 2B, 2,
        2*hidden] and attention frames (per block [slots * F, H, 2*hd]; the rows read `keys` [2B, K] masked
        by `bias` [2B, 1, 1, K], write `new` [2B, n]) -> x + dt * the guided velocity, and the new conv caches."""
        b, _, n = x.shape
        h = (condition + self.x_proj(x.transpose(1, 2))).view(2 * b, n, self.hidden)
        new_cnn = []
        for blk, mods, cache, cnn_i in zip(self.blocks, time.blocks, frames, cnn, strict=True):
            g_msa, g_conv, g_mlp = mods.gates
            h = torch.addcmul(h, g_msa, self._attention(blk, mods.msa(h), cache, keys, new, bias))
            conv, cnn_i = self._conv(blk, mods.conv(h), cnn_i)
            h = torch.addcmul(h, g_conv, conv)
            h = torch.addcmul(h, g_mlp, blk.fc2(F.gelu(blk.fc1(mods.mlp(h)), approximate="tanh")))
            new_cnn.append(cnn_i)
        m = time.final_norm(h)
        # guidance ((1 + rate) v_cond - rate v_uncond, `guided`) before the final linear, which is linear in it
        guided = torch.add(m[:b] * (1.0 + self.rate), m[b:], alpha=-self.rate)  # [B, n, hidden]
        return x + time.final(guided).transpose(1, 2), torch.stack(new_cnn)

    @staticmethod
    def _attention(blk: _Block, x: torch.Tensor, frames: torch.Tensor, keys: torch.Tensor, new: torch.Tensor,
                   bias: torch.Tensor) -> torch.Tensor:
        """`Attention.forward_chunk` (q/k layer-normed per head, no positions) over each row's keys: x [2B, n,
        hidden]; this chunk's keys|values written to `new`, then the row's `keys` gathered (one read each)."""
        r, n, _ = x.shape
        q, k, v = blk.qkv(x).view(r, n, 3, blk.heads, blk.head_dim).unbind(2)  # [2B, n, H, hd] each
        write_frames(frames, new, torch.cat([blk.k_norm(k), v], dim=-1))  # [2B, n, H, 2hd]: keys | values
        k, v = read_frames(frames, keys, x.dtype)  # [2B, H, K, hd]
        out = F.scaled_dot_product_attention(blk.q_norm(q).transpose(1, 2), k, v, attn_mask=bias)
        return blk.proj(out.transpose(1, 2).reshape(r, n, -1))

    @staticmethod
    def _conv(blk: _Block, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`CausalConvBlock.forward_chunk`: conv, LayerNorm, Mish, conv; x [2B, n, hidden], cache [2B, k - 1,
        2*hidden] (conv1's last input frames | conv2's) -> [2B, n, hidden] and the new cache."""
        x1 = torch.cat([cache[..., :blk.conv1.channels], x], dim=1)  # [2B, k - 1 + n, hidden]
        x2 = torch.cat([cache[..., blk.conv1.channels:], F.mish(blk.conv_norm(blk.conv1(x1)))], dim=1)
        lead = x.shape[1]
        return blk.conv2(x2), torch.cat([x1[:, lead:], x2[:, lead:]], dim=2)  # the new cache: their last k - 1

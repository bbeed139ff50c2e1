"""The Step-Audio2 flow (flow.yaml + flow.pt: `CausalMaskedDiffWithXvec`) on slot caches, batched across sessions.

The official modules do the work (embeddings, the conformer's layers' projections and feed-forwards, the DiT's
blocks' adaLN, conv and MLP, the upsampler, the final layer); only attention is ours, because it reads the caches
where they live: a layer writes its new keys/values to the rows' slots, then reads each row's keys with one
gather by flat frame id (`FlowRows`): the voice's frames the row keeps (in the voice's slot, shared by every
session with that voice), its own, this chunk's. No cache is stacked or concatenated per row; the keys gathered
are exactly those the row attends to, padded to the batch's longest and masked.

The conformer's attention is relative to position (`RelPositionMultiHeadedAttention`, Transformer-XL's terms:
content (q + u)·k and position (q + v)·p(i - j), the latter an additive bias here); a key's place in time is its
place in the row's list. The DiT's attention has no positions. Shapes follow export/modules/token2wav.py's graphs
(the ONNX host path), which this path is held to (tests/test_token2wav_ring.py), and through them to the official
streaming (tests/test_token2wav_parity.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from ..model_config import Token2WavDims
from .token2wav_dit import LeanDiT
from .token2wav_ops import Conv, Linear, Norm, key_bias, read_frames, write_frames
from .token2wav_ring import FlowPool, FlowRows


def dit_input(est: Any, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spk: torch.Tensor,
              cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiT's input for classifier-free guidance's two rows per row: [x; x] with [mu, spk, cond; 0, 0, 0]
    (x, mu, cond [B, 80, n], t [B], spk [B, 80]) -> h [2B, n, hidden] and the time embedding [2B, 1, hidden]."""
    return packed_input(est, x, mu, spk, cond), est.t_embedder(torch.cat([t, t])).unsqueeze(1)


def packed_input(est: Any, x: torch.Tensor, mu: torch.Tensor, spk: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    """`dit_input`'s h: the DiT's pack([x, mu, spks, cond]) of both guidance rows, projected."""
    b, _, n = x.shape
    h = torch.cat([torch.cat([x, x]), torch.cat([mu, torch.zeros_like(mu)]),
                   torch.cat([spk, torch.zeros_like(spk)])[:, :, None].expand(2 * b, spk.shape[1], n),
                   torch.cat([cond, torch.zeros_like(cond)])], dim=1)
    return est.in_proj(h.transpose(1, 2))


def guided(v: torch.Tensor, rate: float) -> torch.Tensor:
    """The two rows' velocities [2B, 80, n] combined by guidance (CausalConditionalCFM, inference_cfg_rate)."""
    b = v.shape[0] // 2
    return (1.0 + rate) * v[:b] - rate * v[b:]


@dataclass
class _Positions:
    """What every conformer layer of one rate reads the same way: each (query, key)'s index into the position
    term's table (r = q_time - k_time, from `most` down to -(n - 1)) and the padding bias."""

    most: int
    at: torch.Tensor  # [B, n, K]
    bias: torch.Tensor  # [B, 1, 1, K]

    @classmethod
    def of(cls, valid: torch.Tensor, n: int, dtype: torch.dtype) -> _Positions:
        """A row's keys are its list in time order: key j at time j, the row's n new frames last."""
        count = valid.sum(1)  # [B]
        q_time = count[:, None] - n + torch.arange(n, device=valid.device)[None, :]  # [B, n]
        k_time = torch.arange(valid.shape[1], device=valid.device)
        most = valid.shape[1] - 1  # the longest row's last key (the lists are padded to the longest): no sync
        return cls(most, (most - (q_time[:, :, None] - k_time[None, None, :])).clamp(0, most + n - 1),
                   key_bias(valid, dtype))


@dataclass
class _Embed:
    """`LinearNoSubsampling` with its `EspnetRelPositionalEncoding`: Linear, LayerNorm, x * sqrt(C) (the position
    encodings it would also give are the layers' `pe` table, read there)."""

    linear: Linear
    norm: Norm
    xscale: float

    @classmethod
    def of(cls, embed: Any) -> _Embed:
        return cls(Linear.of(embed.out[0]), Norm.of(embed.out[1]), float(embed.pos_enc.xscale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.xscale


@dataclass
class _RelLayer:
    """One conformer layer's weights (`ConformerEncoderLayer`, pre-norm, its attention
    `RelPositionMultiHeadedAttention`; no macaron feed-forward, no conv module)."""

    norm_mha: Norm
    qkv: Linear  # linear_q | linear_k | linear_v: [3 * H * dk, C]
    pos: Linear  # linear_pos (no bias)
    pos_bias_u: torch.Tensor  # [H, 1, dk]: content term's
    pos_bias_v: torch.Tensor  # [H, 1, dk]: position term's
    out: Linear
    norm_ff: Norm
    w_1: Linear
    activation: Any
    w_2: Linear
    ff_scale: float
    heads: int
    dk: int

    @classmethod
    def of(cls, layer: Any) -> _RelLayer:
        if layer.feed_forward_macaron is not None or layer.conv_module is not None or not layer.normalize_before:
            raise ValueError("token2wav's conformer layers are pre-norm, with no macaron feed-forward, no conv module")
        a, ff = layer.self_attn, layer.feed_forward
        return cls(Norm.of(layer.norm_mha), Linear.stacked(a.linear_q, a.linear_k, a.linear_v), Linear.of(a.linear_pos),
                   a.pos_bias_u.detach()[:, None], a.pos_bias_v.detach()[:, None], Linear.of(a.linear_out),
                   Norm.of(layer.norm_ff), Linear.of(ff.w_1), ff.activation, Linear.of(ff.w_2), float(layer.ff_scale),
                   a.h, a.d_k)

    def __call__(self, x: torch.Tensor, frames: torch.Tensor, keys: torch.Tensor, new: torch.Tensor,
                 positions: _Positions, pe: torch.Tensor) -> torch.Tensor:
        """`ConformerEncoderLayer._forward_impl`: x [B, n, C] + attention over each row's keys (this chunk's
        written to `new` first) + feed-forward; frames [slots * F, H, 2dk]."""
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm_mha(x)).view(b, n, 3, self.heads, self.dk).unbind(2)  # [B, n, H, dk]
        write_frames(frames, new, torch.cat([k, v], dim=-1))
        k, v = read_frames(frames, keys, q.dtype)  # [B, H, K, dk]
        q = q.transpose(1, 2)  # [B, H, n, dk]
        center, most = pe.shape[1] // 2, positions.most
        table = self.pos(pe[:, center - most:center + n]).view(-1, self.heads, self.dk).transpose(0, 1)  # [H, R, dk]
        by_distance = (q + self.pos_bias_v) @ table.transpose(-2, -1)  # [B, H, n, R]
        position = by_distance.gather(3, positions.at[:, None].expand(-1, self.heads, -1, -1))  # [B, H, n, K]
        scale = 1 / math.sqrt(self.dk)
        out = F.scaled_dot_product_attention(q + self.pos_bias_u, k, v, scale=scale,
                                             attn_mask=torch.add(positions.bias, position, alpha=scale))
        x = x + self.out(out.transpose(1, 2).reshape(b, n, self.heads * self.dk))  # softmax((ac + bd) / sqrt(dk))
        return torch.add(x, self.w_2(self.activation(self.w_1(self.norm_ff(x)))), alpha=self.ff_scale)


class RingFlow:
    """The official flow's modules, run on a `FlowPool`."""

    def __init__(self, flow: Any, d: Token2WavDims) -> None:
        self.flow, self.d = flow, d
        enc = flow.encoder
        self.embed, self.up_embed = _Embed.of(enc.embed), _Embed.of(enc.up_embed)
        self.layers = [_RelLayer.of(layer) for layer in enc.encoders]  # token rate
        self.up_layers = [_RelLayer.of(layer) for layer in enc.up_encoders]  # mel rate
        self.after_norm, self.proj = Norm.of(enc.after_norm), Linear.of(flow.encoder_proj)
        look, up = enc.pre_lookahead_layer, enc.up_layer
        self.look1, self.look2, self.up_conv = Conv.of(look.conv1), Conv.of(look.conv2), Conv.of(up.conv)
        self.up_rate = int(up.scale_factor)
        if (look.pre_lookahead_len, self.look1.k, self.look2.k, self.up_rate, self.up_conv.k) != (3, 4, 3, 2, 5):
            raise ValueError("token2wav's conformer looks 3 tokens ahead and upsamples x2 (its caches: 2 + 4 frames)")
        self.dit = LeanDiT(flow.decoder.estimator, float(flow.decoder.inference_cfg_rate))

    # ---- the conformer: tokens -> mu ----
    def conformer(self, tokens: torch.Tensor, n_real: torch.Tensor, rows: FlowRows,
                  pool: FlowPool) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] (T - 3 decoded, 3 lookahead; a turn's last chunk: `n_real` < T and the frames past it
        zeroed, as the reference pads it) -> mu [B, 2*(T-3), 80], the rows' new conv caches [B, 6, C]. The new
        key/value frames are written to the rows' slots (`rows.tok_new`, `rows.mel_new`)."""
        flow, enc = self.flow, self.flow.encoder
        t = tokens.shape[1]
        xs = self.embed(F.embedding(tokens, flow.input_embedding.weight))
        xs = xs * (torch.arange(t, device=xs.device)[None, :] < n_real[:, None]).unsqueeze(-1).to(xs.dtype)
        cnn = pool["cnn"].index_select(0, rows.own).to(xs.dtype)  # [B, 6, C]
        # PreLookaheadLayer.forward_chunk: a conv over the 3 lookahead tokens, then a causal one over 2 cached frames
        look = F.leaky_relu(self.look1(xs))  # [B, T - 3, C]
        xs = self.look2(torch.cat([cnn[:, :2], look], dim=1)) + xs[:, :look.shape[1]]
        new_cnn1 = look[:, -2:]
        pe = enc.embed.pos_enc.pe.to(device=xs.device, dtype=xs.dtype)
        positions = _Positions.of(rows.tok_valid, xs.shape[1], xs.dtype)
        for i, layer in enumerate(self.layers):
            xs = layer(xs, pool.flat("tok", i), rows.tok_keys, rows.tok_new, positions, pe)
        # Upsample1D.forward_chunk: nearest x2, then a causal conv over 4 cached frames
        up = torch.cat([cnn[:, 2:], xs.repeat_interleave(self.up_rate, dim=1)], dim=1)
        xs, new_cnn2 = self.up_conv(up), up[:, -(self.up_conv.k - 1):]
        xs = self.up_embed(xs)
        positions = _Positions.of(rows.mel_valid, xs.shape[1], xs.dtype)
        for i, layer in enumerate(self.up_layers):
            xs = layer(xs, pool.flat("mel", i), rows.mel_keys, rows.mel_new, positions, pe)
        return self.proj(self.after_norm(xs)), torch.cat([new_cnn1, new_cnn2], dim=1)

    # ---- the CFM: n_timesteps Euler steps of the DiT ----
    def cfm(self, mu: torch.Tensor, x: torch.Tensor, spk: torch.Tensor, cond: torch.Tensor, t_span: np.ndarray,
            rows: FlowRows, pool: FlowPool) -> tuple[torch.Tensor, torch.Tensor]:
        """mu, x (the noise), cond [B, 80, n]; spk [B, 80] -> mel [B, 80, n] and the new DiT conv caches
        [steps, depth, 2B, 2, 2*hidden] (rows' conditional halves first, then the unconditional). Each step's new
        key/value frames are written to the rows' slots (`rows.est_new`)."""
        cfg = torch.cat([2 * rows.own, 2 * rows.own + 1])  # the rows' conditional, then unconditional, slot rows
        cnn = pool["est_cnn"][:, :, cfg].to(x.dtype)  # [steps, depth, 2B, 2, 2*hidden]
        # the unconditional rows read the same frames one slot row on: (2s + 1) * F
        keys = torch.cat([rows.est_keys, rows.est_keys + pool.frames])
        new = torch.cat([rows.est_new, rows.est_new + pool.frames])
        bias = key_bias(torch.cat([rows.est_valid, rows.est_valid]), x.dtype)
        condition = self.dit.condition(mu, spk, cond)  # the steps' shared part of the DiT's input
        depth = len(self.dit.blocks)
        new_cnn = []
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            k = step - 1
            time = self.dit.time(float(t), float(dt), x.dtype, x.device)
            x, step_cnn = self.dit.step(x, condition, time, cnn[k], [pool.flat("est", k, i) for i in range(depth)],
                                        keys, new, bias)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
            new_cnn.append(step_cnn)
        return x, torch.stack(new_cnn)

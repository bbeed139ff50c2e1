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
from ..vocoder.official_stepaudio2 import stepaudio2_module
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


@dataclass
class _Time:
    """What an Euler step's time alone decides, the same for every row: the DiT's time embedding's adaLN
    modulations, per block (9 [1, 1, hidden] each) and the final layer's (shift, scale)."""

    blocks: list[tuple[torch.Tensor, ...]]
    final: tuple[torch.Tensor, ...]


def guided(v: torch.Tensor, rate: float) -> torch.Tensor:
    """The two rows' velocities [2B, 80, n] combined by guidance (CausalConditionalCFM, inference_cfg_rate)."""
    b = v.shape[0] // 2
    return (1.0 + rate) * v[:b] - rate * v[b:]


def _bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, K] real keys -> [B, 1, 1, K]: 0 for a key, -inf for padding (added to the scores)."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, float("-inf"))[:, None, None]


def _gather(frames: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' keys and values: frames [slots * F, H, 2d] at keys [B, K] -> k, v [B, H, K, d] (one gather)."""
    kv = frames.index_select(0, keys.reshape(-1)).view(*keys.shape, *frames.shape[1:]).transpose(1, 2).to(dtype)
    k, v = kv.chunk(2, dim=-1)
    return k, v


def _write(frames: torch.Tensor, new: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A chunk's keys and values k, v [B, H, n, d] into their slots' frames at `new` [B, n] (flat ids), in place."""
    kv = torch.cat([k, v], dim=-1).transpose(1, 2)  # [B, n, H, 2d]: the cache's layout (keys | values)
    frames.index_copy_(0, new.reshape(-1), kv.reshape(-1, *kv.shape[2:]).to(frames.dtype))


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
        most = int(count.max()) - 1
        return cls(most, (most - (q_time[:, :, None] - k_time[None, None, :])).clamp(0, most + n - 1),
                   _bias(valid, dtype))


class RingFlow:
    """The official flow's modules, run on a `FlowPool`."""

    def __init__(self, flow: Any, d: Token2WavDims) -> None:
        self.flow, self.d = flow, d
        enc = flow.encoder
        for layer in (*enc.encoders, *enc.up_encoders):
            if layer.feed_forward_macaron is not None or layer.conv_module is not None:
                raise ValueError("token2wav's conformer layers have no macaron feed-forward and no conv module")
        self.modulate = stepaudio2_module("cosyvoice2.flow.decoder_dit").modulate
        self.rate = float(flow.decoder.inference_cfg_rate)
        self._times: dict[tuple[float, torch.dtype, str], _Time] = {}

    def _time(self, t: float, dtype: torch.dtype, device: torch.device) -> _Time:
        """A step's modulations, computed once (the schedule's times are fixed): the row-independent part of the
        DiT, out of every chunk's work."""
        key = (t, dtype, str(device))
        if key not in self._times:
            est = self.flow.decoder.estimator
            temb = est.t_embedder(torch.full((1,), t, dtype=dtype, device=device)).unsqueeze(1)  # [1, 1, hidden]
            self._times[key] = _Time([tuple(b.adaLN_modulation(temb).chunk(9, -1)) for b in est.blocks],
                                     tuple(est.final_layer.adaLN_modulation(temb).chunk(2, -1)))
        return self._times[key]

    # ---- the conformer: tokens -> mu ----
    def conformer(self, tokens: torch.Tensor, n_real: torch.Tensor, rows: FlowRows,
                  pool: FlowPool) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] (T - 3 decoded, 3 lookahead; a turn's last chunk: `n_real` < T and the frames past it
        zeroed, as the reference pads it) -> mu [B, 2*(T-3), 80], the rows' new conv caches [B, C, 6]. The new
        key/value frames are written to the rows' slots (`rows.tok_new`, `rows.mel_new`)."""
        flow, enc = self.flow, self.flow.encoder
        t = tokens.shape[1]
        xs, _, _ = enc.embed(flow.input_embedding(tokens), None)
        xs = xs * (torch.arange(t, device=xs.device)[None, :] < n_real[:, None]).unsqueeze(-1).to(xs.dtype)
        cnn = pool["cnn"].index_select(0, rows.own).to(xs.dtype)  # [B, C, 6]
        xs, new_cnn1 = enc.pre_lookahead_layer.forward_chunk(xs, cache=cnn[:, :, :2])
        pe = enc.embed.pos_enc.pe.to(device=xs.device, dtype=xs.dtype)
        positions = _Positions.of(rows.tok_valid, xs.shape[1], xs.dtype)
        for i, layer in enumerate(enc.encoders):
            xs = self._conformer_layer(layer, xs, pool.flat("tok", i), rows.tok_keys, rows.tok_new, positions, pe)
        xs, _, new_cnn2 = enc.up_layer.forward_chunk(xs.transpose(1, 2), None, cache=cnn[:, :, 2:])
        xs, _, _ = enc.up_embed(xs.transpose(1, 2), None)
        positions = _Positions.of(rows.mel_valid, xs.shape[1], xs.dtype)
        for i, layer in enumerate(enc.up_encoders):
            xs = self._conformer_layer(layer, xs, pool.flat("mel", i), rows.mel_keys, rows.mel_new, positions, pe)
        mu = flow.encoder_proj(enc.after_norm(xs))
        return mu, torch.cat([new_cnn1, new_cnn2], dim=2)

    def _conformer_layer(self, layer: Any, x: torch.Tensor, frames: torch.Tensor, keys: torch.Tensor,
                         new: torch.Tensor, positions: _Positions, pe: torch.Tensor) -> torch.Tensor:
        """ConformerEncoderLayer._forward_impl (pre-norm attention, then feed-forward), attention ours."""
        residual = x
        if layer.normalize_before:
            x = layer.norm_mha(x)
        x = residual + layer.dropout(self._relative(layer.self_attn, x, frames, keys, new, positions, pe))
        if not layer.normalize_before:
            x = layer.norm_mha(x)
        residual = x
        if layer.normalize_before:
            x = layer.norm_ff(x)
        x = residual + layer.ff_scale * layer.dropout(layer.feed_forward(x))
        return x if layer.normalize_before else layer.norm_ff(x)

    @staticmethod
    def _relative(attn: Any, x: torch.Tensor, frames: torch.Tensor, keys: torch.Tensor, new: torch.Tensor,
                  positions: _Positions, pe: torch.Tensor) -> torch.Tensor:
        """RelPositionMultiHeadedAttention over each row's keys; x [B, n, C]; frames [slots * F, H, 2dk]."""
        b, n, _ = x.shape
        q, k, v = attn.forward_qkv(x, x, x)  # [B, H, n, dk]
        _write(frames, new, k, v)
        k, v = _gather(frames, keys, q.dtype)  # [B, H, K, dk]
        dk = attn.d_k
        center = pe.shape[1] // 2
        most = positions.most
        table = attn.linear_pos(pe[:, center - most:center + n]).view(-1, attn.h, dk).transpose(0, 1)  # [H, R, dk]
        by_distance = (q + attn.pos_bias_v[None, :, None, :]) @ table.transpose(-2, -1)  # [B, H, n, R]
        position = by_distance.gather(3, positions.at[:, None].expand(-1, attn.h, -1, -1))  # [B, H, n, K]
        out = F.scaled_dot_product_attention(q + attn.pos_bias_u[None, :, None, :], k, v,
                                             attn_mask=position / math.sqrt(dk) + positions.bias,
                                             scale=1 / math.sqrt(dk))  # softmax((ac + bd) / sqrt(dk))
        return attn.linear_out(out.transpose(1, 2).reshape(b, n, attn.h * dk))

    # ---- the CFM: n_timesteps Euler steps of the DiT ----
    def cfm(self, mu: torch.Tensor, x: torch.Tensor, spk: torch.Tensor, cond: torch.Tensor, t_span: np.ndarray,
            rows: FlowRows, pool: FlowPool) -> tuple[torch.Tensor, torch.Tensor]:
        """mu, x (the noise), cond [B, 80, n]; spk [B, 80] -> mel [B, 80, n] and the new DiT conv caches
        [steps, depth, 2B, 2*hidden, 2] (rows' conditional halves first, then the unconditional). Each step's new
        key/value frames are written to the rows' slots (`rows.est_new`)."""
        cfg = torch.cat([2 * rows.own, 2 * rows.own + 1])  # the rows' conditional, then unconditional, slot rows
        cnn = pool["est_cnn"][:, :, cfg].to(x.dtype)  # [steps, depth, 2B, 2*hidden, 2]
        # the unconditional rows read the same frames one slot row on: (2s + 1) * F
        keys = torch.cat([rows.est_keys, rows.est_keys + pool.frames])
        new = torch.cat([rows.est_new, rows.est_new + pool.frames])
        bias = _bias(torch.cat([rows.est_valid, rows.est_valid]), x.dtype)
        new_cnn = []
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            k = step - 1
            velocity, step_cnn = self._estimator(x, mu, self._time(float(t), x.dtype, x.device), spk, cond, cnn[k],
                                                 pool, k, keys, new, bias)
            x = x + float(dt) * velocity
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
            new_cnn.append(step_cnn)
        return x, torch.stack(new_cnn)

    def _estimator(self, x: torch.Tensor, mu: torch.Tensor, time: _Time, spk: torch.Tensor, cond: torch.Tensor,
                   cnn: torch.Tensor, pool: FlowPool, step: int, keys: torch.Tensor, new: torch.Tensor,
                   bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One Euler step's velocity: the DiT on [x; x] with [mu, spk, cond; 0, 0, 0], combined by guidance
        (EstimatorStep), its blocks' attention over the rows' keys of this step's caches."""
        est = self.flow.decoder.estimator
        h = packed_input(est, x, mu, spk, cond)
        new_cnn = []
        for i, block in enumerate(est.blocks):
            s_msa, c_msa, g_msa, s_mlp, c_mlp, g_mlp, s_conv, c_conv, g_conv = time.blocks[i]
            att = self._plain(block.attn, self.modulate(block.norm1(h), s_msa, c_msa), pool.flat("est", step, i),
                              keys, new, bias)
            h = h + g_msa * att
            h_conv, cnn_i = block.conv.forward_chunk(self.modulate(block.norm3(h), s_conv, c_conv), cnn[i])
            h = h + g_conv * h_conv
            h = h + g_mlp * block.mlp(self.modulate(block.norm2(h), s_mlp, c_mlp))
            new_cnn.append(cnn_i)
        final = est.final_layer  # FinalLayer.forward, its modulation the step's
        v = final.linear(self.modulate(final.norm_final(h), *time.final)).transpose(1, 2)
        return guided(v, self.rate), torch.stack(new_cnn)

    @staticmethod
    def _plain(attn: Any, x: torch.Tensor, frames: torch.Tensor, keys: torch.Tensor, new: torch.Tensor,
               bias: torch.Tensor) -> torch.Tensor:
        """The DiT block's attention (`Attention.forward_chunk`: q/k layer-normed per head, no positions) over each
        row's keys; x [2B, n, hidden]; frames [2 * slots * F, H, 2hd]."""
        b2, n, _ = x.shape
        q = attn.q_norm(attn.to_heads(attn.to_q(x)))  # [2B, H, n, hd]
        _write(frames, new, attn.k_norm(attn.to_heads(attn.to_k(x))), attn.to_heads(attn.to_v(x)))
        k, v = _gather(frames, keys, q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return attn.proj(out.transpose(1, 2).reshape(b2, n, -1))

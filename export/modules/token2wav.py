"""Step-Audio2 token2wav (MiniCPM-o 4.5's `assets/token2wav/`): the official modules, and the three graphs we export.

flow.yaml + flow.pt: `CausalMaskedDiffWithXvec` = input_embedding [6561, 512] -> `UpsampleConformerEncoderV2`
(token-rate blocks, x2 upsample, mel-rate blocks) -> encoder_proj [512 -> 80] = mu, and `CausalConditionalCFM`
whose DiT estimator turns noise into mel in n_timesteps Euler steps (classifier-free guidance 0.7);
spk_embed_affine_layer [192 -> 80] projects the CAM++ voice. hift.pt (keys `generator.*`): the original HiFT
(F0 predictor -> harmonic source, mel + source -> ISTFT magnitude/phase, 24 kHz, 480 samples per mel frame).

Streaming keeps, per session, each attention layer's keys/values and each causal conv's last frames. The
graphs below take those caches as explicit inputs and give the new ones back, so the stage (numpy + ONNX
Runtime) owns them per session and can batch sessions whose caches differ in length (padded and masked).
They call the official submodules; only the orchestration `forward_chunk` does inline is redone here, with
the masks and explicit noise it lacks, and HiFT's STFT/ISTFT as convolutions (ONNX has no ISTFT).
"""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from minicpmo_triton.model_config import Token2WavDims
from minicpmo_triton.stages.token2wav_flow import dit_input, guided
from minicpmo_triton.vocoder.hift import VocoderChunk, build_hift

from .stepaudio2 import load_flow_yaml

FLOW_YAML = """\
# A flow.yaml in the layout of MiniCPM-o 4.5's assets/token2wav/flow.yaml (same classes and keys)
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: {channels}
    output_size: {n_mels}
    spk_embed_dim: {spk_embed_dim}
    output_type: 'mel'
    vocab_size: {vocab}
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: {channels}
        output_size: {channels}
        input_layer: 'linear'
        pre_lookahead_len: {lookahead}
        num_blocks: {num_blocks}
        num_up_blocks: {num_up_blocks}
        up_stride: 2
        up_scale_factor: 2
        attention_heads: {heads}
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        key_bias: true
        linear_units: {linear_units}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: 0.7
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: {dit_in}
            out_channels: {n_mels}
            mlp_ratio: {dit_mlp_ratio}
            depth: {dit_depth}
            num_heads: {dit_heads}
            head_dim: {dit_head_dim}
            hidden_size: {dit_hidden}
"""

FLOW_FILES = ("flow.yaml", "flow.pt", "hift.pt")
HIFT_PREFIX = "generator."
VOICE_GAIN = 20.0  # tiny only (Token2WavModel.random): the speaker projection
MEL_GAIN = 20.0  # tiny only: HiFT's first conv, so what the flow says is audible
NOISE_SEED = 0  # CausalConditionalCFM draws its noise table at construction (not in flow.pt)


# A config.yaml in minicpmo-utils 1.0.7's layout: CosyVoice3's causal HiFT under its upstream tags (resolved by the
# loaders) at a width, modelled on CosyVoice3's published config (the real file is not here to compare); its
# `hifigan` (the training wrapper) is overridden away by the package's loader, so that tag never resolves
CAUSAL_HIFT_YAML = """\
sample_rate: 24000
hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
    in_channels: 80
    base_channels: {channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {channels}
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: 8000
    center: False
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
"""


def causal_hift_yaml(channels: int) -> str:
    """A 1.0.7-layout config.yaml (tests and benches build the layout from it with the official classes)."""
    return CAUSAL_HIFT_YAML.format(channels=channels)


def flow_yaml(d: Token2WavDims) -> str:
    return FLOW_YAML.format(dit_in=4 * d.n_mels, **{k: getattr(d, k) for k in (
        "channels", "n_mels", "spk_embed_dim", "vocab", "lookahead", "num_blocks", "num_up_blocks", "heads",
        "linear_units", "dit_mlp_ratio", "dit_depth", "dit_heads", "dit_head_dim", "dit_hidden")})


def _out_channels(state: dict[str, torch.Tensor], prefix: str) -> int:
    """A weight-normed conv's output channels (its `v`, or its plain weight) under `prefix`."""
    return next(v.shape[0] for k, v in state.items()
                if k.startswith(prefix) and v.dim() == 3 and not k.endswith(("original0", "weight_g")))


def dims_of(model: Token2WavModel, base: Token2WavDims) -> Token2WavDims:
    """The dims a checkpoint's token2wav has (its flow.yaml and hift.pt define them; the preset's are defaults)."""
    flow, hift = model.flow, model.hift.state_dict()
    enc, est = flow.encoder, flow.decoder.estimator
    width = est.blocks[0].norm1.normalized_shape[0]
    return dataclasses.replace(
        base, vocab=flow.input_embedding.weight.shape[0], channels=flow.input_embedding.weight.shape[1],
        n_mels=flow.output_size, spk_embed_dim=flow.spk_embed_affine_layer.in_features,
        lookahead=flow.pre_lookahead_len, heads=enc.encoders[0].self_attn.h,
        linear_units=enc.encoders[0].feed_forward.w_1.out_features, num_blocks=len(enc.encoders),
        num_up_blocks=len(enc.up_encoders), dit_depth=len(est.blocks), dit_hidden=width,
        dit_heads=est.blocks[0].attn.num_heads, dit_head_dim=est.blocks[0].attn.head_dim,
        dit_mlp_ratio=est.blocks[0].mlp.fc1.out_features / width,
        hift_channels=_out_channels(hift, "conv_pre."),
        f0_channels=_out_channels(hift, "f0_predictor.condnet.0."))


class Token2WavModel(nn.Module):
    """flow (CausalMaskedDiffWithXvec) + hift (HiFTGenerator), as the checkpoint's files define them."""

    def __init__(self, flow: nn.Module, hift: nn.Module) -> None:
        super().__init__()
        self.flow = flow
        self.hift = hift

    @classmethod
    def random(cls, d: Token2WavDims, seed: int) -> Token2WavModel:
        """`tiny`: the official classes at small widths, random weights a trained model's scale."""
        torch.manual_seed(seed)
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "flow.yaml").write_text(flow_yaml(d), encoding="utf-8")
            flow = load_flow_yaml(Path(tmp) / "flow.yaml")
        est = flow.decoder.estimator
        # DiT zero-initialises its adaLN and output layers (an untrained DiT outputs 0): give them weights.
        with torch.no_grad():
            for m in [*(b.adaLN_modulation[-1] for b in est.blocks), est.final_layer.adaLN_modulation[-1],
                      est.final_layer.linear]:
                nn.init.normal_(m.weight, std=0.5 / math.sqrt(m.in_features))
            # A random flow hears its voice prompt only faintly: a trained one's speaker projection is what makes a
            # voice a voice, so tiny's is louder, and two references give audibly different audio.
            flow.spk_embed_affine_layer.weight.mul_(VOICE_GAIN)
        hift = build_hift(d)
        with torch.no_grad():  # and a random HiFT hears its mel faintly (its harmonic source drowns it): louder too
            hift.conv_pre.parametrizations.weight.original0.mul_(MEL_GAIN)
        model = cls(flow, hift)
        model.reset_noise()
        return model.eval()

    @classmethod
    def load(cls, folder: Path, d: Token2WavDims, hift_file: str = "hift.pt") -> Token2WavModel:
        """A checkpoint's assets/token2wav: flow.yaml, flow.pt and `hift_file` (original HiFT, keys `generator.*`:
        hift.pt in 1.0.5's layout, hift_original.pt in 1.0.7's)."""
        flow = load_flow_yaml(folder / "flow.yaml")
        flow.load_state_dict(torch.load(folder / "flow.pt", map_location="cpu", weights_only=True), strict=True)
        state = {k.removeprefix(HIFT_PREFIX): v
                 for k, v in torch.load(folder / hift_file, map_location="cpu", weights_only=True).items()}
        # hift.pt has no config: its widths are its tensors' (the real one is HiFTGenerator's defaults)
        hift = build_hift(dataclasses.replace(d, hift_channels=_out_channels(state, "conv_pre."),
                                              f0_channels=_out_channels(state, "f0_predictor.condnet.0.")))
        hift.load_state_dict(state, strict=True)
        model = cls(flow, hift)
        model.reset_noise()
        return model.eval()

    def reset_noise(self) -> None:
        """The CFM's noise table from a fixed seed, so an export is reproducible (the official draws it unseeded)."""
        buf = self.flow.decoder.rand_noise
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(NOISE_SEED)))

    def save(self, folder: Path, d: Token2WavDims) -> None:
        """Write flow.yaml, flow.pt and hift.pt in the checkpoint's layout."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in self.files(d).items():
            (folder / name).write_bytes(data)

    def files(self, d: Token2WavDims) -> dict[str, bytes]:
        """flow.yaml, flow.pt and hift.pt (HiFT's keys `generator.*`) as the checkpoint lays them out: what the
        device path loads its torch modules from (model_repository/token2wav/1/device_modules)."""

        def saved(state: dict[str, torch.Tensor]) -> bytes:
            buf = io.BytesIO()
            torch.save(state, buf)
            return buf.getvalue()

        return {"flow.yaml": flow_yaml(d).encode(), "flow.pt": saved(self.flow.state_dict()),
                "hift.pt": saved({HIFT_PREFIX + k: v for k, v in self.hift.state_dict().items()})}

    def tables(self) -> dict[str, np.ndarray]:
        """What the stage computes itself: the CFM noise table, the voice projection, the guidance rate."""
        spk = self.flow.spk_embed_affine_layer
        return {
            "rand_noise": self.flow.decoder.rand_noise[0].numpy().astype(np.float32),  # [80, 30000]
            "spk_weight": spk.weight.detach().numpy().astype(np.float32),  # [80, 192]
            "spk_bias": spk.bias.detach().numpy().astype(np.float32),
            "harmonics": np.asarray(self.hift.nb_harmonics + 1),  # HiFT's source: fundamental + overtones
        }


def tables_bytes(model: Token2WavModel) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **model.tables())
    return buf.getvalue()


def _left_valid(total: int, lengths: torch.Tensor) -> torch.Tensor:
    """[B, total] True on each row's last `lengths` positions (caches are left-padded)."""
    return torch.arange(total)[None, :] >= (total - lengths)[:, None]


class ConformerChunk(nn.Module):
    """One streamed chunk through the conformer: tokens (+ lookahead) -> mu, the 80-bin mel condition.

    tokens [B, T] int64: T - 3 tokens are decoded, the last 3 are lookahead. On a turn's last chunk the
    reference pads the embedded sequence with 3 zero frames instead: rows pass `n_real` < T, and frames
    from n_real on are zeroed. Caches (left-padded, `cache_len` valid token frames per row):
    cnn_cache [B, C, 6] (pre-lookahead conv 2 + upsample conv 4), token_cache [L1, B, H, T1, 2*dk],
    mel_cache [L2, B, H, 2*T1, 2*dk]. Returns mu [B, 2*(T-3), 80] and the caches with this chunk appended.
    """

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, tokens: torch.Tensor, n_real: torch.Tensor, cnn_cache: torch.Tensor,
                token_cache: torch.Tensor, mel_cache: torch.Tensor, cache_len: torch.Tensor):
        enc = self.flow.encoder
        b, t = tokens.shape
        xs, _, _ = enc.embed(self.flow.input_embedding(tokens), None)
        xs = xs * (torch.arange(t)[None, :] < n_real[:, None]).unsqueeze(-1).to(xs.dtype)
        xs, new_cnn1 = enc.pre_lookahead_layer.forward_chunk(xs, cache=cnn_cache[:, :, :2])
        t1 = token_cache.shape[3]
        n = xs.shape[1]
        pos_emb = enc.embed.position_encoding(offset=None, size=t1 + n)
        mask = torch.cat([_left_valid(t1, cache_len), torch.ones(b, n, dtype=torch.bool)], dim=1)
        mask = mask[:, None, :].expand(b, n, t1 + n)
        new_tok = []
        for i, layer in enumerate(enc.encoders):
            xs, _, cache, _ = layer(xs, mask, pos_emb, att_cache=token_cache[i])
            new_tok.append(cache)
        xs, _, new_cnn2 = enc.up_layer.forward_chunk(xs.transpose(1, 2), None, cache=cnn_cache[:, :, 2:])
        xs, _, _ = enc.up_embed(xs.transpose(1, 2), None)
        t2, n2 = mel_cache.shape[3], xs.shape[1]
        pos_emb = enc.embed.position_encoding(offset=None, size=t2 + n2)
        mask = torch.cat([_left_valid(t2, cache_len * enc.up_layer.stride), torch.ones(b, n2, dtype=torch.bool)], 1)
        mask = mask[:, None, :].expand(b, n2, t2 + n2)
        new_mel = []
        for i, layer in enumerate(enc.up_encoders):
            xs, _, cache, _ = layer(xs, mask, pos_emb, att_cache=mel_cache[i])
            new_mel.append(cache)
        mu = self.flow.encoder_proj(enc.after_norm(xs))
        return mu, torch.cat([new_cnn1, new_cnn2], dim=2), torch.stack(new_tok), torch.stack(new_mel)


class EstimatorStep(nn.Module):
    """One Euler step's velocity: the DiT on [x; x] with [mu, spk, cond; 0, 0, 0], combined by CFG.

    x, mu, cond [B, 80, T]; t [B]; spk [B, 80] (projected voice). Caches of this timestep for 2B rows
    (the B conditional rows, then the B unconditional ones): cnn_cache [depth, 2B, 2*hidden, 2],
    att_cache [depth, 2B, H, Tc, 2*head_dim], right-padded, `cache_len` [B] valid frames. The DiT puts a
    chunk's keys before the cached ones, so the new cache holds this chunk first.
    """

    def __init__(self, flow: nn.Module) -> None:
        super().__init__()
        self.cfm = flow.decoder
        self.est = flow.decoder.estimator

    def forward(self, x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spk: torch.Tensor, cond: torch.Tensor,
                cnn_cache: torch.Tensor, att_cache: torch.Tensor, cache_len: torch.Tensor):
        est = self.est
        b, _, n = x.shape
        h, temb = dit_input(est, x, mu, t, spk, cond)
        tc = att_cache.shape[3]
        valid = torch.arange(tc)[None, :] < torch.cat([cache_len, cache_len])[:, None]
        mask = torch.cat([torch.ones(2 * b, n, dtype=torch.bool), valid], dim=1)[:, None, :].expand(2 * b, n, n + tc)
        new_cnn, new_att = [], []
        for i, block in enumerate(est.blocks):
            h, cnn, att = block.forward_chunk(h, temb, cnn_cache[i], att_cache[i], mask)
            new_cnn.append(cnn)
            new_att.append(att)
        v = guided(est.final_layer(h, temb).transpose(1, 2), self.cfm.inference_cfg_rate)
        return v, torch.stack(new_cnn), torch.stack(new_att)


def graphs(model: Token2WavModel) -> dict[str, nn.Module]:
    """The exported graphs, in eval mode (the conformer has dropout)."""
    return {"encoder": ConformerChunk(model.flow).eval(), "estimator": EstimatorStep(model.flow).eval(),
            "vocoder": VocoderChunk(model.hift).eval()}

"""HiFT, MiniCPM-o 4.5's original vocoder (hift.pt, keys `generator.*`: the official `HiFTGenerator`), as a streamed
chunk: mel -> speech with the harmonic source's randomness given and the previous chunk's source tail swapped in.

Both token2wav paths run it: the ONNX export's vocoder graph (export/modules/token2wav.py) and the device path
(stages/token2wav_device.py), batched across sessions there with their vocoder caches in slots.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..model_config import Token2WavDims
from .official_stepaudio2 import hift_class


def build_hift(d: Token2WavDims) -> nn.Module:
    hift_cls, f0_cls = hift_class()
    if d.hift_channels == 512 and d.f0_channels == 512:
        return hift_cls()  # the checkpoint's: every default
    return hift_cls(in_channels=d.n_mels, base_channels=d.hift_channels,
                    f0_predictor=f0_cls(in_channels=d.n_mels, cond_channels=d.f0_channels))



def fold_weight_norm(module: torch.nn.Module) -> torch.nn.Module:
    """HiFT's weight-normed convs with their weights computed once (the same values each call computed again).
    Only on a module of its own: a deep copy shares its parametrized classes with the original, which this edits."""
    from torch.nn.utils import parametrize

    for m in module.modules():
        if parametrize.is_parametrized(m, "weight"):
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
    return module


class VocoderChunk(nn.Module):
    """HiFT on mel [B, 80, Tm] -> speech [B, 480*Tm] and its source [B, 1, 480*Tm].

    The harmonic source's random parts are inputs (`rand_ini` [B, harmonics+1], column 0 zero;
    `sine_noise` [B, 480*Tm, harmonics+1]), so streaming is reproducible; the first `cache_len` samples of
    the source are replaced by `cache_source` [B, 1, Ls] (the previous chunk's tail), as HiFT does.
    """

    def __init__(self, hift: nn.Module) -> None:
        super().__init__()
        self.hift = hift
        n_fft = hift.istft_params["n_fft"]
        self.n_fft, self.hop = n_fft, hift.istft_params["hop_len"]
        window = hift.stft_window.double()
        k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)[:, None]
        n = torch.arange(n_fft, dtype=torch.float64)[None, :]
        angle = 2 * math.pi * k * n / n_fft
        # STFT as a strided conv: [real bins; imag bins] <- windowed frames
        self.register_buffer("stft_kernel", torch.cat([torch.cos(angle), -torch.sin(angle)])[:, None, :]
                             .mul(window).float(), persistent=False)
        # inverse real DFT of each frame, windowed: [real; imag] bins -> n_fft samples
        scale = torch.full_like(k, 2.0 / n_fft)
        scale[0] = scale[-1] = 1.0 / n_fft
        inv = torch.cat([scale * torch.cos(angle), -scale * torch.sin(angle)])
        inv[n_fft // 2 + 1] = 0  # the DC and Nyquist bins' imaginary parts are ignored (irfft)
        inv[-1] = 0
        self.register_buffer("istft_kernel", (inv * window)[:, None, :].float(), persistent=False)
        self.register_buffer("window_sq", (window ** 2)[None, None, :].float(), persistent=False)

    def _source(self, f0: torch.Tensor, rand_ini: torch.Tensor, sine_noise: torch.Tensor) -> torch.Tensor:
        """SourceModuleHnNSF2 / SineGen2 with the noise given: f0 [B, N, 1] -> excitation [B, N, 1]."""
        m = self.hift.m_source
        sg = m.l_sin_gen
        fn = f0 * torch.arange(1, sg.harmonic_num + 2, dtype=f0.dtype)[None, None, :]
        rad = torch.remainder(fn / sg.sampling_rate, 1.0)
        rad = torch.cat([rad[:, :1] + rand_ini[:, None, :], rad[:, 1:]], dim=1)
        rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / sg.upsample_scale, mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad, dim=1) * 2 * np.pi
        phase = F.interpolate(phase.transpose(1, 2) * sg.upsample_scale, scale_factor=sg.upsample_scale,
                              mode="linear").transpose(1, 2)
        uv = (f0 > sg.voiced_threshold).to(f0.dtype)
        noise_amp = uv * sg.noise_std + (1 - uv) * sg.sine_amp / 3
        sine = torch.sin(phase) * sg.sine_amp * uv + noise_amp * sine_noise
        return m.l_tanh(m.l_linear(sine))

    def forward(self, mel: torch.Tensor, cache_source: torch.Tensor, cache_len: torch.Tensor,
                rand_ini: torch.Tensor, sine_noise: torch.Tensor):
        hift = self.hift
        f0 = hift.f0_predictor(mel)
        s = self._source(hift.f0_upsamp(f0[:, None]).transpose(1, 2), rand_ini, sine_noise).transpose(1, 2)
        total = s.shape[2]
        cached = F.pad(cache_source, (0, total - cache_source.shape[2]))
        s = torch.where(torch.arange(total)[None, None, :] < cache_len[:, None, None], cached, s)
        return self._decode(mel, s), s

    def _decode(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """HiFTGenerator.decode with its torch.stft / torch.istft as convolutions."""
        hift, half = self.hift, self.n_fft // 2
        s_stft = F.conv1d(F.pad(s, (half, half), mode="reflect"), self.stft_kernel, stride=self.hop)
        x = hift.conv_pre(x)
        for i in range(hift.num_upsamples):
            x = hift.ups[i](F.leaky_relu(x, hift.lrelu_slope))
            if i == hift.num_upsamples - 1:
                x = hift.reflection_pad(x)
            x = x + hift.source_resblocks[i](hift.source_downs[i](s_stft))
            xs = sum(hift.resblocks[i * hift.num_kernels + j](x) for j in range(hift.num_kernels))
            x = xs / hift.num_kernels
        x = hift.conv_post(F.leaky_relu(x))
        magnitude = torch.clip(torch.exp(x[:, : half + 1]), max=1e2)
        phase = torch.sin(x[:, half + 1:])
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        frames = spec.shape[2]
        wav = F.conv_transpose1d(spec, self.istft_kernel, stride=self.hop)  # overlap-add of windowed frames
        env = F.conv_transpose1d(torch.ones(1, 1, frames), self.window_sq, stride=self.hop)
        wav = (wav / env)[:, 0, half: half + self.hop * (frames - 1)]
        return torch.clamp(wav, -hift.audio_limit, hift.audio_limit)

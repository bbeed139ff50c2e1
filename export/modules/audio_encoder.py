"""The audio encoder stage: 16 kHz float32 -> log-mel -> Whisper encoder -> projector -> AvgPool(5)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

from minicpmo_triton.model_config import AudioEncoderDims, PresetConfig

from ..tensor_names import Tensors, fuse_qkv, read_dims

PREFIXES = ("apm.", "audio_projection_layer.")


def read_config(preset: PresetConfig, config: dict) -> PresetConfig:
    """`audio_config` (a Whisper config) + top-level `audio_pool_step`."""
    audio = read_dims(preset.audio, config.get("audio_config", {}), {
        "n_mels": "num_mel_bins", "d_model": "d_model", "layers": "encoder_layers",
        "heads": "encoder_attention_heads", "ffn": "encoder_ffn_dim", "max_positions": "max_source_positions"})
    audio = read_dims(audio, config, {"pool": "audio_pool_step"})
    return dataclasses.replace(preset, audio=audio)


def state_from_checkpoint(tensors: Tensors, preset: PresetConfig) -> Tensors:
    return fuse_qkv(tensors)  # checkpoint names are the module's but for Whisper's separate q/k/v

N_FFT = 400
HOP = 160


def mel_filterbank(n_mels: int, n_fft: int = N_FFT, sr: int = 16_000) -> np.ndarray:
    """Slaney-style triangular filters, as Whisper's feature extractor uses."""

    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, dtype=np.float64)
        lin = f / (200.0 / 3)
        log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
        return np.where(f >= 1000.0, log, lin)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        lin = m * (200.0 / 3)
        log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
        return np.where(m >= 15.0, log, lin)

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mels = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2))
    lower = (freqs[None, :] - mels[:-2, None]) / (mels[1:-1, None] - mels[:-2, None])
    upper = (mels[2:, None] - freqs[None, :]) / (mels[2:, None] - mels[1:-1, None])
    fb = np.maximum(0.0, np.minimum(lower, upper))
    fb *= (2.0 / (mels[2:] - mels[:-2]))[:, None]
    return fb.astype(np.float32)


class LogMel(nn.Module):
    """STFT as a strided convolution with fixed DFT kernels, so it exports to plain ONNX ops."""

    def __init__(self, n_mels: int) -> None:
        super().__init__()
        n = torch.arange(N_FFT, dtype=torch.float64)
        k = torch.arange(N_FFT // 2 + 1, dtype=torch.float64)
        window = 0.5 - 0.5 * torch.cos(2 * math.pi * n / N_FFT)
        angle = 2 * math.pi * k[:, None] * n[None, :] / N_FFT
        self.register_buffer("dft_real", (torch.cos(angle) * window).float()[:, None, :], persistent=False)
        self.register_buffer("dft_imag", (-torch.sin(angle) * window).float()[:, None, :], persistent=False)
        self.register_buffer("filters", torch.from_numpy(mel_filterbank(n_mels)), persistent=False)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, n_mels, N / 160]
        x = nn.functional.pad(audio[:, None, :], (N_FFT // 2, N_FFT // 2))
        re = nn.functional.conv1d(x, self.dft_real, stride=HOP)
        im = nn.functional.conv1d(x, self.dft_imag, stride=HOP)
        power = (re * re + im * im)[..., :-1]
        log_spec = torch.log10(torch.clamp(self.filters @ power, min=1e-10))
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        return (torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0


class WhisperLayer(nn.Module):
    def __init__(self, d: AudioEncoderDims) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d.d_model, d.heads, batch_first=True)
        self.self_attn_layer_norm = nn.LayerNorm(d.d_model)
        self.fc1 = nn.Linear(d.d_model, d.ffn)
        self.fc2 = nn.Linear(d.ffn, d.d_model)
        self.final_layer_norm = nn.LayerNorm(d.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(nn.functional.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """`apm.*`: conv stem (stride 2 -> 50 frames/s), sinusoid-free learned positions, pre-norm layers."""

    def __init__(self, d: AudioEncoderDims) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(d.n_mels, d.d_model, 3, padding=1)
        self.conv2 = nn.Conv1d(d.d_model, d.d_model, 3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(d.max_positions, d.d_model)
        self.layers = nn.ModuleList(WhisperLayer(d) for _ in range(d.layers))
        self.layer_norm = nn.LayerNorm(d.d_model)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.conv1(mel))
        x = nn.functional.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class AudioProjection(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_in, d_out)
        self.linear2 = nn.Linear(d_out, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(nn.functional.relu(self.linear1(x)))


class AudioEncoder(nn.Module):
    """Names follow the checkpoint: `apm.*`, `audio_projection_layer.*` (the pooler has no weights)."""

    def __init__(self, d: AudioEncoderDims, llm_hidden: int) -> None:
        super().__init__()
        self.mel = LogMel(d.n_mels)
        self.apm = WhisperEncoder(d)
        self.audio_projection_layer = AudioProjection(d.d_model, llm_hidden)
        self.pool = d.pool

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, N] (N a multiple of 1600) -> [B, N/1600, H]
        x = self.audio_projection_layer(self.apm(self.mel(audio)))
        return nn.functional.avg_pool1d(x.transpose(1, 2), self.pool, self.pool).transpose(1, 2)

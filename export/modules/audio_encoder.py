"""The audio encoder: 16 kHz float32 -> log-mel -> Whisper encoder (`apm.*`) -> projector -> AvgPool(5).

Names and shapes are the checkpoint's (transformers' `WhisperEncoder` under `apm.`, MiniCPM-o's
`audio_projection_layer.linear1/linear2`), so a state dict loads without renaming. Two graphs share the weights:
`AudioEncoder` encodes a whole utterance (voice references, turn-based audio, replays) and
`AudioEncoderStream` one duplex chunk against the session's Whisper KV cache, as MiniCPM-o 4.5's
`get_audio_embedding_streaming` does (OpenBMB/MiniCPM-o-Demo MiniCPMO45/modeling_minicpmo_unified.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from minicpmo_triton.media.audio_mel import CONTEXT_FRAMES, HOP, N_FFT, mel_filterbank
from minicpmo_triton.model_config import AudioEncoderDims, PresetConfig

from ..tensor_names import Tensors, read_dims

PREFIXES = ("apm.", "audio_projection_layer.")


def read_config(preset: PresetConfig, config: dict) -> PresetConfig:
    """`audio_config` (a Whisper config) + top-level `audio_pool_step`."""
    audio = read_dims(preset.audio, config.get("audio_config", {}), {
        "n_mels": "num_mel_bins", "d_model": "d_model", "layers": "encoder_layers",
        "heads": "encoder_attention_heads", "ffn": "encoder_ffn_dim", "max_positions": "max_source_positions"})
    audio = read_dims(audio, config, {"pool": "audio_pool_step"})
    if "audio_chunk_length" in config:  # seconds; the reference's int(chunk_length * 50) encoder frames
        audio = dataclasses.replace(audio, chunk_frames=max(0, int(config["audio_chunk_length"] * 50)))
    return dataclasses.replace(preset, audio=audio)


def state_from_checkpoint(tensors: Tensors, preset: PresetConfig) -> Tensors:
    return tensors  # the module carries the checkpoint's names (Whisper's separate q/k/v included)


class LogMel(nn.Module):
    """Whisper's log-mel with the max - 8 clamp, as MiniCPM-o computes it for a whole utterance: the audio
    zero-padded to 30 s (`WhisperFeatureExtractor(padding="max_length")` in `process_audio_batch`), so frames are
    reflect-centred at the start and see zeros past the end, the clamp's peak covers the frames past the end too
    (they hear the audio's tail), and only the utterance's frames are kept. The STFT is a strided convolution
    with fixed DFT kernels, so it exports to plain ONNX ops. Input length: a whole number of hops."""

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
        x = nn.functional.pad(audio[:, None, :], (N_FFT // 2, 0), mode="reflect")
        # N_FFT zeros on the right: the frames at N / 160 and one past it still hold the tail; later ones are
        # all zeros (log 1e-10, never the peak), so they need not be computed
        x = nn.functional.pad(x, (0, N_FFT))
        re = nn.functional.conv1d(x, self.dft_real, stride=HOP)
        im = nn.functional.conv1d(x, self.dft_imag, stride=HOP)
        log_spec = torch.log10(torch.clamp(self.filters @ (re * re + im * im), min=1e-10))
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        return ((torch.maximum(log_spec, peak - 8.0) + 4.0) / 4.0)[..., : audio.shape[1] // HOP]


class WhisperAttention(nn.Module):
    """`apm.layers.N.self_attn`: separate q/k/v/out projections; k_proj has no bias (as in Whisper)."""

    def __init__(self, d: AudioEncoderDims) -> None:
        super().__init__()
        self.heads, self.head_dim = d.heads, d.d_model // d.heads
        self.q_proj = nn.Linear(d.d_model, d.d_model)
        self.k_proj = nn.Linear(d.d_model, d.d_model, bias=False)
        self.v_proj = nn.Linear(d.d_model, d.d_model)
        self.out_proj = nn.Linear(d.d_model, d.d_model)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        past_k: torch.Tensor | None = None,  # [B, heads, P, head_dim]
        past_v: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,  # [B, 1, 1, P + T] additive
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, heads, T, head_dim]
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q = split(self.q_proj(x) * self.head_dim**-0.5)  # Whisper scales q before the product
        k, v = split(self.k_proj(x)), split(self.v_proj(x))
        k_all = k if past_k is None else torch.cat([past_k, k], dim=2)
        v_all = v if past_v is None else torch.cat([past_v, v], dim=2)
        scores = q @ k_all.transpose(-1, -2)
        if mask is not None:
            scores = scores + mask
        out = (scores.softmax(dim=-1) @ v_all).transpose(1, 2).reshape(b, t, -1)
        return self.out_proj(out), k, v


class WhisperLayer(nn.Module):
    def __init__(self, d: AudioEncoderDims) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(d)
        self.self_attn_layer_norm = nn.LayerNorm(d.d_model)
        self.fc1 = nn.Linear(d.d_model, d.ffn)
        self.fc2 = nn.Linear(d.ffn, d.d_model)
        self.final_layer_norm = nn.LayerNorm(d.d_model)

    def forward(self, x, past_k=None, past_v=None, mask=None):
        attn, k, v = self.self_attn(self.self_attn_layer_norm(x), past_k, past_v, mask)
        x = x + attn
        return x + self.fc2(nn.functional.gelu(self.fc1(self.final_layer_norm(x)))), k, v


def block_causal_mask(frames: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, T, T] additive: frame i sees frames of its own `chunk`-frame block and every block before it, as the
    reference's `subsequent_chunk_mask(size, chunk_size, num_left_chunks=-1)` (MiniCPMO45/modeling_minicpmo_unified.py)
    that `get_audio_embedding(chunk_length=1.0)` applies to whole utterances."""
    block = torch.arange(frames) // chunk
    allowed = block[None, :] <= block[:, None]
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]


class WhisperEncoder(nn.Module):
    """`apm.*`: conv stem (stride 2 -> 50 frames/s), learned positions [max_positions, D], pre-norm layers."""

    def __init__(self, d: AudioEncoderDims) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(d.n_mels, d.d_model, 3, padding=1)
        self.conv2 = nn.Conv1d(d.d_model, d.d_model, 3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(d.max_positions, d.d_model)
        self.layers = nn.ModuleList(WhisperLayer(d) for _ in range(d.layers))
        self.layer_norm = nn.LayerNorm(d.d_model)

    def stem(self, mel: torch.Tensor, frame_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n_mels, F] -> [B, ceil(F / 2), D]; `frame_mask` zeroes conv1's output where a row has no frame,
        as conv2's own zero padding would at the start of a stream."""
        x = nn.functional.gelu(self.conv1(mel))
        if frame_mask is not None:
            x = x * frame_mask[:, None, :].to(x.dtype)
        return nn.functional.gelu(self.conv2(x)).transpose(1, 2)

    def forward(self, mel: torch.Tensor, chunk_frames: int = 0) -> torch.Tensor:  # [B, n_mels, F] -> [B, F / 2, D]
        x = self.stem(mel)
        x = x + self.embed_positions.weight[: x.shape[1]]
        mask = None if chunk_frames <= 0 else block_causal_mask(x.shape[1], chunk_frames, x.dtype)
        for layer in self.layers:
            x = layer(x, mask=mask)[0]
        return self.layer_norm(x)

    def stream(
        self,
        mel: torch.Tensor,  # [B, n_mels, 2 + F + 2]: a chunk with CONTEXT_FRAMES of context on each side
        mel_mask: torch.Tensor,  # [B, 2 + F + 2] bool: False on a first chunk's (absent) left context
        position_ids: torch.Tensor,  # [B, F / 2]: the session's positions so far, then on
        past_mask: torch.Tensor,  # [B, P] bool: real past keys (rows left-padded)
        past_key: torch.Tensor,  # [L, B, heads, P, head_dim]
        past_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        drop = (CONTEXT_FRAMES + 1) // 2  # context frames after the stride-2 conv, as the reference removes them
        x = self.stem(mel, mel_mask)[:, drop:-drop]
        x = x + self.embed_positions(position_ids)
        keys = torch.cat([past_mask, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)], dim=1)
        mask = torch.where(keys, 0.0, torch.finfo(x.dtype).min)[:, None, None, :]  # full attention, no causality
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, past_key[i], past_value[i], mask)
            new_k.append(k)
            new_v.append(v)
        present_key = torch.cat([past_key, torch.stack(new_k)], dim=3)
        present_value = torch.cat([past_value, torch.stack(new_v)], dim=3)
        return self.layer_norm(x), present_key, present_value


class AudioProjection(nn.Module):
    """`audio_projection_layer.*`: Linear(D -> H), ReLU, Linear(H -> H)."""

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
        self.chunk_frames = d.chunk_frames

    def project(self, states: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T / pool, H]
        x = self.audio_projection_layer(states)
        return nn.functional.avg_pool1d(x.transpose(1, 2), self.pool, self.pool).transpose(1, 2)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, N] (N a multiple of 160) -> [B, N // 1600, H]
        return self.project(self.apm(self.mel(audio), self.chunk_frames))


class AudioEncoderStream(nn.Module):
    """One duplex chunk of each session, batched: the chunk's mel (cut by `minicpmo_triton.media.audio_mel.MelStream`)
    through the Whisper encoder with the session's KV cache, then projector and pooling."""

    def __init__(self, encoder: AudioEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, mel, mel_mask, position_ids, past_mask, past_key, past_value):
        states, present_key, present_value = self.encoder.apm.stream(
            mel, mel_mask, position_ids, past_mask, past_key, past_value)
        return self.encoder.project(states), present_key, present_value

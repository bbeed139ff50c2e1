"""The audio encoder's graphs and checkpoint mapping. The network is `AudioEncoder` (minicpmo_triton/engine/
whisper_model.py: the one definition, the graphs' and the device engine's), its state dict the checkpoint's
`apm.*` and `audio_projection_layer.*` as they are. Two graphs share the weights: `UtteranceEncoder` encodes a whole
utterance from 16 kHz audio (voice references, turn-based audio, replays) and `AudioEncoderStream` one duplex chunk
against the session's Whisper KV cache, as MiniCPM-o 4.5's `get_audio_embedding_streaming` does.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from minicpmo_triton.engine.cache import DenseCache
from minicpmo_triton.engine.whisper_model import AudioEncoder
from minicpmo_triton.media.audio_mel import HOP, N_FFT, mel_filterbank
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


class UtteranceEncoder(AudioEncoder):
    """`audio_encoder/1/model.onnx`: a whole utterance, 16 kHz float32 -> log-mel -> the audio encoder. Its state
    dict is `AudioEncoder`'s (the log-mel has no weights)."""

    def __init__(self, d: AudioEncoderDims, llm_hidden: int) -> None:
        super().__init__(d, llm_hidden)
        self.mel = LogMel(d.n_mels)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, N] (N a multiple of 160) -> [B, N // 1600, H]
        return self.encode(self.mel(audio))


class AudioEncoderStream(nn.Module):
    """`audio_encoder/1/stream.onnx`: one duplex chunk of each session, batched, the chunk's mel (cut by
    `minicpmo_triton.media.audio_mel.MelStream`) through `AudioEncoder.stream` against the session's Whisper KV cache
    (rows left-padded, as `KvBatch` feeds them)."""

    def __init__(self, encoder: AudioEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(
        self,
        mel: torch.Tensor,  # [B, n_mels, 2 + F + 2]
        mel_mask: torch.Tensor,  # [B, 2 + F + 2] bool
        position_ids: torch.Tensor,  # [B, F / 2]
        past_mask: torch.Tensor,  # [B, P] bool: real past keys
        past_key: torch.Tensor,  # [L, B, heads, P, head_dim]
        past_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = DenseCache.full(past_mask, past_key, past_value, position_ids.shape[1])
        return self.encoder.stream(mel, mel_mask, position_ids, cache), *cache.present()

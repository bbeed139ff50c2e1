"""Tiny stand-ins for the checkpoint's voice-prompt graphs, with their inputs and outputs (random weights).

`campplus.onnx` (CAM++): input [B, T, 80] float32, a mean-normalised 16 kHz Kaldi fbank -> output [B, 192].
`speech_tokenizer_v2_25hz.onnx` (S3 tokenizer v2): feats [B, 128, T] float32 (Whisper-style log-mel, 100 frames/s)
+ feats_length [B] int32 -> indices [B, ceil(T / 4)] int64, 25 tokens/s (two stride-2 convolutions, as its stem).
"""

from __future__ import annotations

import torch
from torch import nn

S3_VOCAB = 6561  # the flow's input_embedding rows (3^8)


class TinyCampPlus(nn.Module):
    def __init__(self, n_mels: int = 80, channels: int = 32, dim: int = 192) -> None:
        super().__init__()
        self.conv = nn.Conv1d(n_mels, channels, 3, padding=1)
        self.embedding = nn.Linear(2 * channels, dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # `input`: the graph's input name
        x = torch.relu(self.conv(input.transpose(1, 2)))  # [B, C, T]
        return self.embedding(torch.cat([x.mean(dim=-1), x.std(dim=-1)], dim=-1))  # mean/std pooling -> [B, 192]


class TinyS3Tokenizer(nn.Module):
    def __init__(self, n_mels: int = 128, channels: int = 32, vocab: int = S3_VOCAB) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, channels, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.head = nn.Linear(channels, vocab)

    def forward(self, feats: torch.Tensor, feats_length: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.conv2(nn.functional.gelu(self.conv1(feats))))  # [B, C, ceil(T / 4)]
        # Frames past a row's length are cut by the caller (a batch of one here); the length is read so the
        # graph has the real signature.
        x = x * (feats_length[:, None, None] > 0).to(x.dtype)
        return self.head(x.transpose(1, 2)).argmax(dim=-1)  # [B, ceil(T / 4)] int64

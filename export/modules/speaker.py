"""The speaker encoder stage: reference audio (16 kHz) -> log-mel -> convolutions -> mean/std pooling ->
a unit-length 192-d voice embedding (CAM++'s interface; `tiny` has random weights)."""

from __future__ import annotations

import torch
from torch import nn

from minicpmo_triton.model_config import SpeakerDims

from .audio_encoder import LogMel


class SpeakerEncoder(nn.Module):
    def __init__(self, d: SpeakerDims) -> None:
        super().__init__()
        self.mel = LogMel(d.n_mels)
        self.conv1 = nn.Conv1d(d.n_mels, d.channels, 5, padding=2)
        self.conv2 = nn.Conv1d(d.channels, d.channels, 3, padding=1)
        self.embedding = nn.Linear(2 * d.channels, d.dim)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, 192]
        x = torch.relu(self.conv2(torch.relu(self.conv1(self.mel(audio)))))
        stats = torch.cat([x.mean(dim=-1), x.std(dim=-1)], dim=-1)
        return nn.functional.normalize(self.embedding(stats), dim=-1)

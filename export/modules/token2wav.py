"""The token2wav stage for `tiny`: speech tokens -> 24 kHz waveform, 960 samples per token.

A window of `left_context + N + lookahead` tokens gives the audio of its N middle tokens: the
convolutions are 'valid' and the upsamplers have kernel == stride, so streaming in chunks gives
exactly the offline waveform. The real model's flow matching + HiFT keep this interface.
"""

from __future__ import annotations

import torch
from torch import nn

from minicpmo_triton.model_config import Token2WavDims


class Token2Wav(nn.Module):
    """[B, W] tokens and a [B, 192] voice -> [B, (W - 7) * 960] samples."""

    def __init__(self, d: Token2WavDims, num_audio_tokens: int) -> None:
        super().__init__()
        c = d.channels
        self.embed = nn.Embedding(num_audio_tokens, c)
        # 3 symmetric k=3 convs (3 left, 3 right) + 1 causal k=2 conv (1 left) = 4 left, 3 right.
        assert d.left_context == 4 and d.lookahead == 3, "the conv stack fixes the receptive field"
        self.convs = nn.ModuleList([nn.Conv1d(c, c, 3), nn.Conv1d(c, c, 3), nn.Conv1d(c, c, 3), nn.Conv1d(c, c, 2)])
        chans = [c] + [max(c // (2 ** (i + 1)), 8) for i in range(len(d.upsample) - 1)] + [1]
        self.upsamplers = nn.ModuleList(
            nn.ConvTranspose1d(chans[i], chans[i + 1], s, stride=s) for i, s in enumerate(d.upsample)
        )
        self.speaker_proj = nn.Linear(192, c)  # registered last: the other weights stay as they were

    def forward(self, tokens: torch.Tensor, speaker: torch.Tensor) -> torch.Tensor:  # [B, W], [B, 192]
        x = (self.embed(tokens) + self.speaker_proj(speaker)[:, None, :]).transpose(1, 2)
        for conv in self.convs:
            x = nn.functional.leaky_relu(conv(x), 0.1)
        for i, up in enumerate(self.upsamplers):
            x = up(x)
            if i < len(self.upsamplers) - 1:
                x = nn.functional.leaky_relu(x, 0.1)
        return 0.5 * torch.tanh(x[:, 0])

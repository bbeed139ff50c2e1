"""The LLM stage: Qwen3 decoder + lm_head over a prefill of text ids with audio embeddings spliced in."""

from __future__ import annotations

import torch
from torch import nn

from minicpmo_triton.model_config import DecoderDims

from .decoder import DecoderModel


class DuplexLLM(nn.Module):
    """Names follow `llm.*` in the MiniCPM-o checkpoint (`model.*`, `lm_head`)."""

    def __init__(self, d: DecoderDims) -> None:
        super().__init__()
        self.model = DecoderModel(d, d.vocab)
        self.lm_head = nn.Linear(d.hidden, d.vocab, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        embeds: torch.Tensor,  # [B, T, H] audio/vision embeddings where use_embeds
        use_embeds: torch.Tensor,  # [B, T] bool
        position_ids: torch.Tensor,  # [B, T] int64
        past_mask: torch.Tensor,  # [B, P] bool
        past_key: torch.Tensor,
        past_value: torch.Tensor,
        last_index: torch.Tensor,  # [B] int64: the row's last real new token
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.where(use_embeds[..., None], embeds, self.model.embed_tokens(input_ids))
        hidden, present_key, present_value = self.model(x, position_ids, past_mask, past_key, past_value)
        last = hidden[torch.arange(hidden.shape[0]), last_index]
        return self.lm_head(last), hidden, present_key, present_value

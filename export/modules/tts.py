"""The TTS stage: a Llama over [text condition | speech codes] predicting the next speech token (25/s)."""

from __future__ import annotations

import torch
from torch import nn

from minicpmo_triton.model_config import TtsDims

from .decoder import DecoderModel


class DuplexTTS(nn.Module):
    """Names follow `tts.*` in the MiniCPM-o checkpoint."""

    def __init__(self, d: TtsDims, llm_hidden: int) -> None:
        super().__init__()
        h = d.decoder.hidden
        self.model = DecoderModel(d.decoder, vocab=1)
        self.emb_text = nn.Embedding(d.num_text_tokens, h)
        self.emb_code = nn.ModuleList([nn.Embedding(d.num_audio_tokens, h)])
        self.head_code = nn.ModuleList([nn.Linear(h, d.num_audio_tokens, bias=False)])
        self.projector_semantic = nn.Linear(llm_hidden, h)
        self.projector_spk = nn.Linear(192, h)  # the speaker embedding of a voice reference

    def forward(
        self,
        text_ids: torch.Tensor,  # [B, T]
        llm_hidden: torch.Tensor,  # [B, T, H_llm]
        code_ids: torch.Tensor,  # [B, T]
        is_code: torch.Tensor,  # [B, T] bool
        position_ids: torch.Tensor,
        past_mask: torch.Tensor,
        past_key: torch.Tensor,
        past_value: torch.Tensor,
        last_index: torch.Tensor,
        speaker: torch.Tensor,  # [B, 192]: the voice (zeros: the default voice)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        semantic = nn.functional.normalize(self.projector_semantic(llm_hidden), dim=-1, eps=1e-6)
        condition = self.emb_text(text_ids) + semantic + self.projector_spk(speaker)[:, None, :]
        x = torch.where(is_code[..., None], self.emb_code[0](code_ids), condition)
        hidden, present_key, present_value = self.model(x, position_ids, past_mask, past_key, past_value)
        last = hidden[torch.arange(hidden.shape[0]), last_index]
        return self.head_code[0](last), present_key, present_value

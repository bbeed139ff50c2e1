"""The LLM stage: Qwen3 decoder + lm_head over a prefill of text ids with audio embeddings spliced in.

Checkpoint: `llm.*` = transformers' `Qwen3ForCausalLM` state dict under `llm.`; config: config.json's
top level (a Qwen3 config).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minicpmo_triton.model_config import DecoderDims, PresetConfig

from ..tensor_names import Tensors, read_dims, strip_prefix
from .decoder import DecoderModel

PREFIXES = ("llm.",)


def read_config(preset: PresetConfig, config: dict) -> PresetConfig:
    llm = read_dims(preset.llm, config, {
        "hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
        "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate": "intermediate_size",
        "vocab": "vocab_size", "rope_theta": "rope_theta", "rms_eps": "rms_norm_eps",
        "tie_word_embeddings": "tie_word_embeddings"})
    llm = read_dims(llm, config.get("rope_parameters", {}), {"rope_theta": "rope_theta"})  # transformers >= 5
    llm = dataclasses.replace(llm, qk_norm=True)  # Qwen3
    return dataclasses.replace(preset, llm=llm)


def state_from_checkpoint(tensors: Tensors, preset: PresetConfig) -> Tensors:
    state = strip_prefix(tensors, "llm.")
    if preset.llm.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


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

"""The TTS stage: a Llama over [text condition | audio_bos | speech codes] predicting the next speech token (25/s).

Follows MiniCPM-o 4.5's `MiniCPMTTS` (OpenBMB/MiniCPM-o-Demo `MiniCPMO45/modeling_minicpmo_unified.py`):
`model` is a transformers `LlamaModel` built from `tts_config` with Llama defaults for what the config
leaves out (rope_theta 10000, rms eps 1e-6, vocab 32000: its `embed_tokens` is never used);
`projector_semantic` / `projector_spk` are `MultiModalProjector`s (linear1, ReLU, linear2) from the LLM
width; `head_code.0` is weight-normed (folded at load). The duplex path never applies `projector_spk`
(4.5 passes no speaker embedding; the voice lives in token2wav): it is loaded and left out of the graph.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from minicpmo_triton.model_config import DecoderDims, PresetConfig, TtsDims

from ..tensor_names import CheckpointError, Tensors, fold_weight_norm, strip_prefix
from .audio_encoder import AudioProjection as MultiModalProjector
from .decoder import DecoderModel

PREFIXES = ("tts.",)
LLAMA_ROPE_THETA = 10_000.0  # LlamaConfig's defaults: tts_config has no rope/eps/vocab keys
LLAMA_RMS_EPS = 1e-6
LLAMA_VOCAB = 32_000


def read_config(preset: PresetConfig, config: dict) -> PresetConfig:
    """`tts_config` (MiniCPMTTSConfig); its `llm_dim` must be the LLM's width."""
    t = config.get("tts_config", {})
    d = preset.tts
    hidden, heads = t.get("hidden_size", d.decoder.hidden), t.get("num_attention_heads", d.decoder.heads)
    llm_dim = t.get("llm_dim", preset.llm.hidden)
    if llm_dim != preset.llm.hidden:
        raise CheckpointError(f"tts_config.llm_dim {llm_dim} != the LLM's hidden_size {preset.llm.hidden}")
    decoder = DecoderDims(
        hidden=hidden, layers=t.get("num_hidden_layers", d.decoder.layers), heads=heads,
        kv_heads=t.get("num_key_value_heads", heads), head_dim=hidden // heads,
        intermediate=t.get("intermediate_size", d.decoder.intermediate), vocab=t.get("vocab_size", LLAMA_VOCAB),
        rope_theta=float(t.get("rope_theta", LLAMA_ROPE_THETA)), rms_eps=float(t.get("rms_norm_eps", LLAMA_RMS_EPS)),
        qk_norm=False,
    )
    tts = TtsDims(
        decoder=decoder,
        num_text_tokens=t.get("num_text_tokens", d.num_text_tokens),
        num_audio_tokens=t.get("num_audio_tokens", d.num_audio_tokens),
        audio_bos_token_id=t.get("audio_bos_token_id", d.audio_bos_token_id),
        text_eos_token_id=t.get("text_eos_token_id", d.text_eos_token_id),
        normalize_projected_hidden=bool(t.get("normalize_projected_hidden", d.normalize_projected_hidden)),
        max_positions=t.get("max_position_embeddings", d.max_positions),
    )
    if t.get("num_vq", 1) != 1 or t.get("projector_type", "mlp") != "mlp":
        raise CheckpointError("tts_config: only num_vq 1 and projector_type 'mlp' (MiniCPM-o 4.5) are supported")
    return dataclasses.replace(preset, tts=tts)


def state_from_checkpoint(tensors: Tensors, preset: PresetConfig) -> Tensors:
    return fold_weight_norm(strip_prefix(tensors, "tts."))


class DuplexTTS(nn.Module):
    """Names follow `tts.*` in the MiniCPM-o checkpoint."""

    def __init__(self, d: TtsDims, llm_hidden: int) -> None:
        super().__init__()
        h = d.decoder.hidden
        self.normalize = d.normalize_projected_hidden
        self.model = DecoderModel(d.decoder, vocab=d.decoder.vocab)  # model.embed_tokens: [32000, h], unused
        self.emb_text = nn.Embedding(d.num_text_tokens, h)  # [152064, 768]
        self.emb_code = nn.ModuleList([nn.Embedding(d.num_audio_tokens, h)])  # [6562, 768]
        self.head_code = nn.ModuleList([nn.Linear(h, d.num_audio_tokens, bias=False)])  # weight-normed in the file
        self.projector_semantic = MultiModalProjector(llm_hidden, h)  # 4096 -> 768 -> 768
        self.projector_spk = MultiModalProjector(llm_hidden, h)  # in the file; 4.5's inference never applies it

    def forward(
        self,
        text_ids: torch.Tensor,  # [B, T]
        llm_hidden: torch.Tensor,  # [B, T, H_llm]
        has_hidden: torch.Tensor,  # [B, T] bool: text positions with an LLM hidden state (not audio_bos)
        code_ids: torch.Tensor,  # [B, T]
        is_code: torch.Tensor,  # [B, T] bool
        position_ids: torch.Tensor,
        past_mask: torch.Tensor,
        past_key: torch.Tensor,
        past_value: torch.Tensor,
        last_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The condition of `_convert_results_to_tts_input`: emb_text(id) + L2norm(projector_semantic(h)).
        semantic = self.projector_semantic(llm_hidden)
        if self.normalize:
            semantic = nn.functional.normalize(semantic, p=2, dim=-1)
        condition = self.emb_text(text_ids) + torch.where(has_hidden[..., None], semantic, 0.0)
        x = torch.where(is_code[..., None], self.emb_code[0](code_ids), condition)
        hidden, present_key, present_value = self.model(x, position_ids, past_mask, past_key, past_value)
        last = hidden[torch.arange(hidden.shape[0]), last_index]
        return self.head_code[0](last), present_key, present_value

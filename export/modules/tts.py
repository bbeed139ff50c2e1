"""The TTS stage's checkpoint mapping: `tts.*` loaded into `DuplexTTS` (minicpmo_triton/engine/tts_model.py: the one
definition, the graph's and the device engine's), `head_code.0`'s weight norm folded; `tts_config` read with Llama's
defaults for what it leaves out (rope_theta 10000, rms eps 1e-6, vocab 32000: its `embed_tokens` is never used).
"""

from __future__ import annotations

import dataclasses

from minicpmo_triton.model_config import DecoderDims, PresetConfig, TtsDims

from ..tensor_names import CheckpointError, Tensors, fold_weight_norm, strip_prefix

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

"""The LLM stage's checkpoint mapping: `llm.*` = transformers' `Qwen3ForCausalLM` state dict under `llm.`, loaded
as it is into `DuplexLLM` (minicpmo_triton/engine/model.py: the one definition, the graph's and the device
engine's); config: config.json's top level (a Qwen3 config).
"""

from __future__ import annotations

import dataclasses

from minicpmo_triton.model_config import PresetConfig

from ..tensor_names import Tensors, read_dims, strip_prefix

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

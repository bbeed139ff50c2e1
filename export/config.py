"""A preset's dimensions from a config.json-shaped dict: the real checkpoint's and `tiny`'s take one path.

Each stage reads its own part with the `read_config` beside its module; the LLM's goes first, since
the other stages size their projections by its width.
"""

from __future__ import annotations

from minicpmo_triton.model_config import PresetConfig

from .modules import audio_encoder, llm, tts, vision

CONFIG_READERS = (llm.read_config, audio_encoder.read_config, vision.read_config, tts.read_config)


def preset_from_config(preset: PresetConfig, config: dict) -> PresetConfig:
    """`preset` (name, token ids, tokenizer, duplex defaults) with the dimensions `config` gives."""
    for read in CONFIG_READERS:
        preset = read(preset, config)
    return preset

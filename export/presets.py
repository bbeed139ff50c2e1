"""The model presets: `tiny` (random weights from a fixed seed) and `minicpm-o-4.5` (real dimensions).

Both are the same architecture, dimensioned by a config.json-shaped dict through `preset_from_config`,
the path a real checkpoint's config.json takes: `TINY_CONFIG` is small, `MINICPMO45_CONFIG` holds the
published config.json's keys (a checkpoint's own config.json overrides them).
"""

from __future__ import annotations

from minicpmo_triton.media.tokenizer import TINY_SPECIALS, tiny_special_ids
from minicpmo_triton.model_config import (
    AudioEncoderDims,
    DecoderDims,
    PresetConfig,
    SpecialTokens,
    Token2WavDims,
    TtsDims,
    VisionDims,
)

from .config import preset_from_config

TINY_SEED = 7  # stage i draws from TINY_SEED + i; 7 listens, speaks and replies on the tests' speech

# The vision keys of tiny's config.json: the real keys and architecture at small widths (VisionDims' defaults).
TINY_VISION_CONFIG = {
    "query_num": 64, "image_size": 448, "drop_vision_last_layer": True, "vision_batch_size": 16,
    "slice_config": {"max_slice_nums": 9, "patch_size": 14, "scale_resolution": 448},
    "vision_config": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 256,
                      "image_size": 980, "patch_size": 14, "layer_norm_eps": 1e-6, "model_type": "siglip"},
}


def _tiny_tokens() -> SpecialTokens:
    ids = tiny_special_ids()
    names = (
        "im_start", "im_end", "audio_start", "audio_end", "unit", "unit_end", "image", "image_end",
        "slice", "slice_end", "tts_bos", "listen", "speak", "turn_eos", "chunk_eos", "chunk_tts_eos",
        "tts_pad", "audio_placeholder", "image_id", "image_id_end",
    )
    return SpecialTokens(**{name: ids[tok] for name, tok in zip(names, TINY_SPECIALS, strict=True)})


def _tiny_vocab() -> int:
    vocab = 256 + len(TINY_SPECIALS)
    return vocab + -vocab % 32


# The published config.json's keys, at a size that exports in about a minute on 2 cores.
TINY_CONFIG = {
    "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "intermediate_size": 384, "vocab_size": _tiny_vocab(), "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "audio_pool_step": 5,
    "audio_config": {"num_mel_bins": 80, "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 4,
                     "encoder_ffn_dim": 256, "max_source_positions": 1500},
    **TINY_VISION_CONFIG,
    "tts_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "intermediate_size": 192, "num_text_tokens": _tiny_vocab(), "num_audio_tokens": 6562,
                   "llm_dim": 128, "num_vq": 1, "projector_type": "mlp", "normalize_projected_hidden": True,
                   # the byte tokenizer has no spare ids: the TTS's audio_bos / text_eos are two of its specials
                   "audio_bos_token_id": tiny_special_ids()["<|tts_bos|>"],
                   "text_eos_token_id": tiny_special_ids()["<|chunk_tts_eos|>"]},
}

# MiniCPM-o 4.5's config.json (openbmb/MiniCPM-o-4_5): Qwen3-8B, Whisper-medium, SigLIP-400M, a 0.3 B Llama TTS.
MINICPMO45_CONFIG = {
    "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151748, "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "audio_pool_step": 5, "query_num": 64, "image_size": 448,
    "drop_vision_last_layer": True, "slice_config": {"max_slice_nums": 9, "patch_size": 14, "scale_resolution": 448},
    "audio_config": {"num_mel_bins": 80, "d_model": 1024, "encoder_layers": 24, "encoder_attention_heads": 16,
                     "encoder_ffn_dim": 4096, "max_source_positions": 1500},
    "vision_config": {"image_size": 980, "patch_size": 14, "hidden_size": 1152, "num_hidden_layers": 27,
                      "num_attention_heads": 16, "intermediate_size": 4304},
    "tts_config": {"hidden_size": 768, "num_hidden_layers": 20, "num_attention_heads": 12, "num_key_value_heads": 12,
                   "intermediate_size": 3072, "num_text_tokens": 152064, "num_audio_tokens": 6562, "llm_dim": 4096,
                   "num_vq": 1, "projector_type": "mlp", "normalize_projected_hidden": True,
                   "audio_bos_token_id": 151687, "text_eos_token_id": 151692},
}


def _base(name: str, tokens: SpecialTokens, tokenizer: str, token2wav: Token2WavDims) -> PresetConfig:
    """What config.json does not say: names, token ids, the tokenizer, token2wav (its own assets)."""
    return PresetConfig(name=name, audio=AudioEncoderDims(), llm=DecoderDims(), tts=TtsDims(),
                        token2wav=token2wav, tokens=tokens, tokenizer=tokenizer, vision=VisionDims())


def tiny() -> PresetConfig:
    return preset_from_config(_base("tiny", _tiny_tokens(), "bytes", Token2WavDims()), TINY_CONFIG)


# MiniCPM-o 4.5's token ids (added_tokens.json); `audio_placeholder` is the <unk> id, never sampled.
MINICPMO45_TOKENS = SpecialTokens(
    im_start=151644, im_end=151645, audio_start=151697, audio_end=151699, unit=151683, unit_end=151684,
    image=151669, image_end=151670, slice=151679, slice_end=151680, image_id=151681, image_id_end=151682,
    tts_bos=151703, listen=151705, speak=151706, turn_eos=151717, chunk_eos=151718, chunk_tts_eos=151721,
    tts_pad=151722, audio_placeholder=128244,
)


def minicpmo45(config: dict | None = None) -> PresetConfig:
    """The real preset, dimensioned by a checkpoint's config.json (the published one's keys by default)."""
    # assets/token2wav/flow.yaml and the default HiFTGenerator
    t2w = Token2WavDims(channels=512, heads=8, linear_units=2048, num_blocks=6, num_up_blocks=4, dit_depth=16,
                        dit_hidden=512, dit_heads=8, dit_head_dim=64, dit_mlp_ratio=4.0, hift_channels=512,
                        f0_channels=512)
    base = _base("minicpm-o-4.5", MINICPMO45_TOKENS, "huggingface", t2w)
    return preset_from_config(base, MINICPMO45_CONFIG if config is None else config)


PRESETS = {"tiny": tiny, "minicpm-o-4.5": minicpmo45}


def get_preset(name: str) -> PresetConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise SystemExit(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None

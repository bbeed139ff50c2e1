"""The model presets: `tiny` (random weights from a fixed seed) and `minicpm-o-4.5` (real dimensions)."""

from __future__ import annotations

from minicpmo_triton.model_config import (
    AudioEncoderDims,
    DecoderDims,
    PresetConfig,
    SpecialTokens,
    Token2WavDims,
    TtsDims,
    VisionDims,
)
from minicpmo_triton.tokenizer import TINY_SPECIALS, tiny_special_ids

TINY_SEED = 20261202

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
        "tts_pad", "audio_placeholder",
    )
    return SpecialTokens(**{name: ids[tok] for name, tok in zip(names, TINY_SPECIALS, strict=True)})


def tiny() -> PresetConfig:
    vocab = 256 + len(TINY_SPECIALS)
    vocab += -vocab % 32
    return PresetConfig(
        name="tiny",
        audio=AudioEncoderDims(),
        llm=DecoderDims(vocab=vocab),
        tts=TtsDims(num_text_tokens=vocab),
        token2wav=Token2WavDims(),
        tokens=_tiny_tokens(),
    )


# MiniCPM-o 4.5's token ids (added_tokens.json); `audio_placeholder` is the <unk> id, never sampled.
MINICPMO45_TOKENS = SpecialTokens(
    im_start=151644, im_end=151645, audio_start=151697, audio_end=151699, unit=151683, unit_end=151684,
    image=151669, image_end=151670, slice=151679, slice_end=151680, tts_bos=151703, listen=151705,
    speak=151706, turn_eos=151717, chunk_eos=151718, chunk_tts_eos=151721, tts_pad=151722,
    audio_placeholder=128244,
)


def minicpmo45() -> PresetConfig:
    """Qwen3-8B LLM, Whisper-medium audio encoder, ~0.3 B Llama TTS (dims a checkpoint may override)."""
    return PresetConfig(
        name="minicpm-o-4.5",
        audio=AudioEncoderDims(n_mels=80, d_model=1024, layers=24, heads=16, ffn=4096),
        llm=DecoderDims(
            hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936
        ),
        tts=TtsDims(
            decoder=DecoderDims(
                hidden=768, layers=20, heads=12, kv_heads=12, head_dim=64, intermediate=3072, vocab=0,
                qk_norm=False,
            ),
            num_text_tokens=152064,
            num_audio_tokens=6562,
        ),
        # assets/token2wav/flow.yaml and the default HiFTGenerator
        token2wav=Token2WavDims(channels=512, heads=8, linear_units=2048, num_blocks=6, num_up_blocks=4,
                                dit_depth=16, dit_hidden=512, dit_heads=8, dit_head_dim=64, dit_mlp_ratio=4.0,
                                hift_channels=512, f0_channels=512),
        tokens=MINICPMO45_TOKENS,
        tokenizer="huggingface",
        # SigLIP-400M: 1152 wide, 27 layers with the last dropped; resampler heads = LLM width / 128
        vision=VisionDims(d_model=1152, layers=26, heads=16, ffn=4304, resampler_heads=32),
    )


PRESETS = {"tiny": tiny, "minicpm-o-4.5": minicpmo45}


def get_preset(name: str) -> PresetConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise SystemExit(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None

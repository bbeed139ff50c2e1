"""MiniCPM-o 4.5's own model classes (OpenBMB/MiniCPM-o-Demo `MiniCPMO45/`, vendored under tests/reference_code/),
built from a checkpoint folder tests/reference_checkpoint.py writes, to run in tests.

`demo_model` is the demo's `MiniCPMO` (its Qwen3 LLM, NaViT SigLIP + resampler, streaming Whisper, `MiniCPMTTS`)
with the checkpoint's tensors loaded under their own names (strict: none missing, none left over) and its
`MiniCPMOProcessor` (the streaming mel processor, the image slicer); `demo_duplex` wraps it in its
`DuplexCapability`. The code runs as published; what transformers 5 took away that it still calls is given back
here, each named where it is made:

- `PretrainedConfig` no longer carries the generation defaults (`top_p` 1.0, `top_k` 50, `repetition_penalty` 1.0)
  that `MiniCPMTTS.__init__` copies (modeling_minicpmo_unified.py:6205-6207; the duplex path never reads them);
- `WhisperAttention` takes `cache` and answers (output, weights); `MiniCPMWhisperEncoderLayer.forward` passes
  `past_key_value` and unpacks three values (:5779): `Transformers4Attention`;
- `DynamicCache` lost `key_cache` / `value_cache` (StreamDecoder reads, writes and assigns them, utils.py:1306-1315,
  1027-1140, 1677-1742), `get_usable_length` (the Whisper encoder's, :5941) and 4's `crop` (the length to keep);
  `EncoderDecoderCache` lost its per-layer `[i]` (`get_audio_embedding_streaming` reads `[0][0]`, :1488): the
  legacy classes below, put where the demo's modules name them;
- transformers 4's Qwen3Config had `rope_theta`; 5's keeps it in `rope_parameters`, and StreamDecoder's
  `_get_rope_theta` (utils.py:1370) would fall back to 10000 when it re-rotates the kept keys;
- `transformers.modeling_attn_mask_utils` (the SigLIP file's import, tests/reference_demo.py): its
  `_prepare_4d_attention_mask` as transformers 4 wrote it, for a padded batch of slices.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .reference_demo import demo_module

TRANSFORMERS4_GENERATION_DEFAULTS = {"top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def demo_sized(config: dict[str, Any]) -> dict[str, Any]:
    """A small checkpoint config at sizes the demo's `MiniCPMO.__init__` builds itself at: a resampler head per 128
    LLM channels (`init_resampler`, :249) and the audio projection's input `encoder_ffn_dim // 4` (:116), which the
    real model's 4096 / 1024 satisfy."""
    out = copy.deepcopy(config)
    out.update(hidden_size=128, head_dim=32, intermediate_size=128)
    out["tts_config"]["llm_dim"] = 128
    out["audio_config"]["encoder_ffn_dim"] = 4 * out["audio_config"]["d_model"]
    return out


class _Layers:
    """`cache.key_cache` as transformers 4 had it: a list of per-layer tensors, writable."""

    def __init__(self, cache: Any, name: str) -> None:
        self._cache, self._name = cache, name

    def __len__(self) -> int:
        return len(self._cache.layers)

    def __getitem__(self, i: int) -> torch.Tensor:
        return getattr(self._cache.layers[i], self._name)

    def __setitem__(self, i: int, value: torch.Tensor) -> None:
        setattr(self._cache.layers[i], self._name, value)

    def assign(self, tensors: list[torch.Tensor]) -> None:
        """`cache.key_cache = [...]` on a cache built empty: its layers made, holding these tensors."""
        from transformers.cache_utils import DynamicLayer

        while len(self._cache.layers) < len(tensors):
            self._cache.layers.append(DynamicLayer())
        for layer, t in zip(self._cache.layers, tensors, strict=False):
            setattr(layer, self._name, t)
            layer.device, layer.is_initialized = t.device, True


@functools.cache
def legacy_cache_class() -> type:
    from transformers.cache_utils import DynamicCache

    class LegacyCache(DynamicCache):
        @property
        def key_cache(self) -> _Layers:
            return _Layers(self, "keys")

        @key_cache.setter
        def key_cache(self, tensors: list[torch.Tensor]) -> None:
            _Layers(self, "keys").assign(tensors)

        @property
        def value_cache(self) -> _Layers:
            return _Layers(self, "values")

        @value_cache.setter
        def value_cache(self, tensors: list[torch.Tensor]) -> None:
            _Layers(self, "values").assign(tensors)

        def crop(self, max_length: int) -> None:
            """transformers 4's `crop`: keep the first `max_length` tokens (5's takes how many to remove)."""
            length = self.get_seq_length()
            keep = length + max_length if max_length < 0 else max_length
            if keep < length:
                super().crop(keep - length)

        def get_usable_length(self, new_seq_length: int, layer_idx: int = 0) -> int:
            return self.get_seq_length(layer_idx)

    return LegacyCache


def legacy_cache() -> Any:
    return legacy_cache_class()()


@functools.cache
def legacy_encoder_decoder_cache_class() -> type:
    from transformers.cache_utils import EncoderDecoderCache

    class LegacyEncoderDecoderCache(EncoderDecoderCache):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            """transformers 4's legacy view of layer i: (self-attention keys, values)."""
            layer = self.self_attention_cache.layers[i]
            return layer.keys, layer.values

    return LegacyEncoderDecoderCache


class Transformers4Attention(nn.Module):
    """transformers 5's `WhisperAttention` answering as transformers 4's did, (output, weights, cache): the
    reference's `MiniCPMWhisperEncoderLayer.forward` (modeling_minicpmo_unified.py:5779) passes `past_key_value`
    (None for a whole utterance, the stream's EncoderDecoderCache in duplex) and unpacks three values."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, hidden_states, attention_mask=None, layer_head_mask=None, output_attentions=False,
                past_key_value=None):
        assert layer_head_mask is None
        out, weights = self.attention(hidden_states=hidden_states, cache=past_key_value, attention_mask=attention_mask)
        return out, weights, past_key_value


def transformers4_whisper(apm: nn.Module) -> nn.Module:
    for layer in apm.layers:
        if not isinstance(layer.self_attn, Transformers4Attention):
            layer.self_attn = Transformers4Attention(layer.self_attn)
    return apm


def _prepare_4d_attention_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: int | None = None) -> torch.Tensor:
    """transformers 4's `modeling_attn_mask_utils._prepare_4d_attention_mask`: [B, S] keep-mask -> [B, 1, T, S]
    additive mask (0 kept, the dtype's minimum masked)."""
    b, s = mask.shape
    expanded = mask[:, None, None, :].expand(b, 1, tgt_len or s, s).to(dtype)
    inverted = 1.0 - expanded
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)


def install_transformers4_shims() -> types.ModuleType:
    """The demo's modules, with the legacy cache classes where they name DynamicCache / EncoderDecoderCache and
    the SigLIP file's attention-mask helper; returns modeling_minicpmo_unified."""
    modeling = demo_module("modeling_minicpmo_unified")
    sys.modules[modeling.StreamDecoder.__module__].DynamicCache = legacy_cache_class()  # type: ignore[attr-defined]
    modeling.DynamicCache = legacy_cache_class()  # type: ignore[attr-defined]
    modeling.EncoderDecoderCache = legacy_encoder_decoder_cache_class()  # type: ignore[attr-defined]
    navit = demo_module("modeling_navit_siglip")
    if getattr(navit, "_prepare_4d_attention_mask", None) is None:
        navit._prepare_4d_attention_mask = _prepare_4d_attention_mask  # type: ignore[attr-defined]
    return modeling


def demo_config(config: dict[str, Any]) -> Any:
    """The demo's `MiniCPMOConfig` of a checkpoint's config.json, eager attention (the CPU's)."""
    configuration = demo_module("configuration_minicpmo")
    keys = {k: v for k, v in copy.deepcopy(config).items() if k != "architectures"}
    cfg = configuration.MiniCPMOConfig(**keys)
    cfg._attn_implementation = "eager"
    for name, value in TRANSFORMERS4_GENERATION_DEFAULTS.items():
        setattr(cfg.tts_config, name, value)
    cfg.tts_config.attn_implementation = "eager"
    return cfg


def demo_tts(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The demo's `MiniCPMTTS` (modeling_minicpmo_unified.py:6184) holding the checkpoint's `tts.*` tensors."""
    modeling = install_transformers4_shims()
    tts = modeling.MiniCPMTTS(config=demo_config(config).tts_config, audio_tokenizer=None).eval()
    tts.load_state_dict({k.removeprefix("tts."): v for k, v in tensors.items() if k.startswith("tts.")}, strict=True)
    return tts


def demo_model(config: dict[str, Any], tensors: dict[str, torch.Tensor], folder: Path) -> nn.Module:
    """The demo's `MiniCPMO` (modeling_minicpmo_unified.py:99) holding every tensor of the checkpoint, with its
    `MiniCPMOProcessor` over the folder's tokenizer (processing_minicpmo.py:1007; MiniCPMVImageProcessor at
    preprocessor_config.json's values, MiniCPMAAudioProcessor)."""
    modeling = install_transformers4_shims()
    processing = demo_module("processing_minicpmo")
    tokenization = demo_module("tokenization_minicpmo_fast")
    model = modeling.MiniCPMO(demo_config(config)).eval()
    model.load_state_dict(tensors, strict=True)
    model.llm.config.rope_theta = model.llm.config.rope_parameters["rope_theta"]
    transformers4_whisper(model.apm)
    model.processor = processing.MiniCPMOProcessor(
        image_processor=processing.MiniCPMVImageProcessor(max_slice_nums=9, scale_resolution=448, patch_size=14),
        audio_processor=processing.MiniCPMAAudioProcessor(feature_size=80),
        tokenizer=tokenization.MiniCPMOTokenizerFast.from_pretrained(str(folder)))
    return model


def demo_duplex(model: Any, **kwargs: Any) -> Any:
    """The demo's `DuplexCapability` over `model` (a `MiniCPMO`, or a stand-in with its attributes), on the CPU; its
    decoder's cache is the legacy class after every reset, as transformers 4's `DynamicCache` was."""
    modeling = install_transformers4_shims()
    cap = modeling.DuplexCapability(model, device="cpu", **kwargs)
    reset = cap.decoder.reset

    def reset_with_legacy_cache() -> None:
        reset()
        cap.decoder.cache = legacy_cache()

    cap.decoder.reset = reset_with_legacy_cache
    return cap

"""Read (and, for tests, write) a MiniCPM-o-style checkpoint folder: config.json + *.safetensors.

Tensor names are the checkpoint's (`llm.*`, `apm.*`, `audio_projection_layer.*`, `tts.*`); Whisper's
separate q/k/v projections are fused into torch's `in_proj`, and weight-normed heads are folded.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from minicpmo_triton.model_config import PresetConfig, Token2WavDims
from minicpmo_triton.stages.token2wav import DEFAULT_VOICE_WAV

if TYPE_CHECKING:
    from .modules.token2wav import Token2WavModel

TOKEN2WAV_ASSETS = Path("assets") / "token2wav"  # flow.yaml, flow.pt, hift.pt and the voice-prompt graphs
VOICE_GRAPHS = ("campplus.onnx", "speech_tokenizer_v2_25hz.onnx")
DEFAULT_VOICE = Path("assets") / "system_ref_audio.wav"  # MiniCPM-o 4.5's own reference voice
STAGE_PREFIXES = {
    "audio_encoder": ("apm.", "audio_projection_layer."),
    "vision_encoder": ("vpm.", "resampler."),
    "llm": ("llm.",),
    "tts": ("tts.",),
    "speaker_encoder": ("speaker_encoder.",),
}
_QKV = ("q_proj", "k_proj", "v_proj")


class CheckpointError(ValueError):
    pass


def preset_from_config(preset: PresetConfig, config: dict) -> PresetConfig:
    """Override the preset's dimensions with what a Hugging Face style config.json says."""
    llm = dataclasses.replace(
        preset.llm,
        hidden=config.get("hidden_size", preset.llm.hidden),
        layers=config.get("num_hidden_layers", preset.llm.layers),
        heads=config.get("num_attention_heads", preset.llm.heads),
        kv_heads=config.get("num_key_value_heads", preset.llm.kv_heads),
        head_dim=config.get("head_dim", preset.llm.head_dim),
        intermediate=config.get("intermediate_size", preset.llm.intermediate),
        vocab=config.get("vocab_size", preset.llm.vocab),
        rope_theta=config.get("rope_theta", preset.llm.rope_theta),
        rms_eps=config.get("rms_norm_eps", preset.llm.rms_eps),
    )
    a = config.get("audio_config", {})
    audio = dataclasses.replace(
        preset.audio,
        n_mels=a.get("num_mel_bins", preset.audio.n_mels),
        d_model=a.get("d_model", preset.audio.d_model),
        layers=a.get("encoder_layers", preset.audio.layers),
        heads=a.get("encoder_attention_heads", preset.audio.heads),
        ffn=a.get("encoder_ffn_dim", preset.audio.ffn),
        max_positions=a.get("max_source_positions", preset.audio.max_positions),
        pool=config.get("audio_pool_step", preset.audio.pool),
    )
    t = config.get("tts_config", {})
    td = preset.tts.decoder
    tts = dataclasses.replace(
        preset.tts,
        decoder=dataclasses.replace(
            td,
            hidden=t.get("hidden_size", td.hidden),
            layers=t.get("num_hidden_layers", td.layers),
            heads=t.get("num_attention_heads", td.heads),
            kv_heads=t.get("num_key_value_heads", t.get("num_attention_heads", td.kv_heads)),
            head_dim=t.get("hidden_size", td.hidden) // t.get("num_attention_heads", td.heads),
            intermediate=t.get("intermediate_size", td.intermediate),
        ),
        num_text_tokens=t.get("num_text_tokens", preset.tts.num_text_tokens),
        num_audio_tokens=t.get("num_audio_tokens", preset.tts.num_audio_tokens),
    )
    v = config.get("vision_config", {})
    vision = dataclasses.replace(
        preset.vision,
        image_size=v.get("image_size", preset.vision.image_size),
        patch=v.get("patch_size", preset.vision.patch),
        d_model=v.get("hidden_size", preset.vision.d_model),
        layers=v.get("num_hidden_layers", preset.vision.layers),
        heads=v.get("num_attention_heads", preset.vision.heads),
        ffn=v.get("intermediate_size", preset.vision.ffn),
        queries=config.get("query_num", preset.vision.queries),
        resampler_heads=max(1, llm.hidden // 128),  # MiniCPM-o's resampler: LLM width / 128 heads
    )
    return dataclasses.replace(preset, llm=llm, audio=audio, tts=tts, vision=vision)


def _to_module_names(stage: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if stage in ("llm", "tts", "speaker_encoder"):
            name = name.split(".", 1)[1]
        out[name] = value
    if stage in ("audio_encoder", "vision_encoder"):  # Hugging Face keeps q/k/v apart
        for key in [k for k in out if k.endswith("self_attn.q_proj.weight")]:
            base = key[: -len("q_proj.weight")]
            ws = [out.pop(f"{base}{p}.weight") for p in _QKV]
            bs = [out.pop(f"{base}{p}.bias", None) for p in _QKV]
            out[f"{base}in_proj_weight"] = torch.cat(ws)
            out[f"{base}in_proj_bias"] = torch.cat([b if b is not None else torch.zeros(w.shape[0])
                                                    for b, w in zip(bs, ws, strict=True)])
            out[f"{base}out_proj.weight"] = out.pop(f"{base}out_proj.weight")
            if f"{base}out_proj.bias" in out:
                out[f"{base}out_proj.bias"] = out.pop(f"{base}out_proj.bias")
    for key in [k for k in out if k.endswith(".weight_v")]:  # torch weight_norm, old style
        base = key[: -len(".weight_v")]
        v, g = out.pop(key), out.pop(f"{base}.weight_g")
        out[f"{base}.weight"] = g * v / v.norm(dim=tuple(range(1, v.dim())), keepdim=True)
    return out


def _to_checkpoint_names(stage: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = {"llm": "llm.", "tts": "tts.", "speaker_encoder": "speaker_encoder."}.get(stage, "")
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if ".self_attn.in_proj_" in name:  # the resampler's own attention keeps torch's fused names
            base, kind = name.rsplit("in_proj_", 1)
            for proj, part in zip(_QKV, value.chunk(3), strict=True):
                if not (proj == "k_proj" and kind == "bias"):  # Whisper's k_proj has no bias
                    out[f"{prefix}{base}{proj}.{kind}"] = part.contiguous()
        else:
            out[prefix + name] = value.contiguous()
    return out


def load_checkpoint(folder: Path, modules: dict[str, nn.Module], require: tuple[str, ...]) -> list[str]:
    """Load every stage whose tensors are present; those in `require` must be. Returns the loaded stages."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    loaded = []
    for stage, prefixes in STAGE_PREFIXES.items():
        part = {k: v for k, v in tensors.items() if k.startswith(prefixes)}
        if not part:
            if stage in require:
                raise CheckpointError(f"{folder} has no tensors for stage {stage} (prefixes {prefixes})")
            continue
        state = _to_module_names(stage, part)
        result = modules[stage].load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise CheckpointError(
                f"stage {stage}: missing {result.missing_keys[:5]} unexpected {result.unexpected_keys[:5]}"
            )
        loaded.append(stage)
    return loaded


def save_checkpoint(folder: Path, modules: dict[str, nn.Module], config: dict) -> None:
    """Write modules in the checkpoint layout (how tests make a checkpoint without downloading one)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for stage, module in modules.items():
        if stage in STAGE_PREFIXES:  # token2wav is not in the safetensors: its files are under assets/
            tensors.update(_to_checkpoint_names(stage, module.state_dict()))
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def copy_tokenizer(folder: Path, target: Path) -> None:
    src = Path(folder) / "tokenizer.json"
    if not src.exists():
        raise CheckpointError(f"{src} is missing: the real preset uses the checkpoint's own tokenizer")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, target / "tokenizer.json")


def load_token2wav(folder: Path, d: Token2WavDims) -> Token2WavModel | None:
    """The checkpoint's assets/token2wav (flow.yaml, flow.pt, hift.pt) as the official modules; None if absent."""
    from .modules.token2wav import Token2WavModel

    assets = Path(folder) / TOKEN2WAV_ASSETS
    if not (assets / "flow.yaml").exists():
        return None
    return Token2WavModel.load(assets, d)


def copy_voice_assets(folder: Path, target: Path) -> list[str]:
    """The checkpoint's CAM++ and S3 tokenizer graphs and its reference voice into token2wav's folder.
    Returns the graphs copied (the export writes stand-ins for the others)."""
    folder, copied = Path(folder), []
    target.mkdir(parents=True, exist_ok=True)
    for name in VOICE_GRAPHS:
        if (folder / TOKEN2WAV_ASSETS / name).exists():
            shutil.copy2(folder / TOKEN2WAV_ASSETS / name, target / name)
            copied.append(name)
    if (folder / DEFAULT_VOICE).exists():
        shutil.copy2(folder / DEFAULT_VOICE, target / DEFAULT_VOICE_WAV)
    return copied

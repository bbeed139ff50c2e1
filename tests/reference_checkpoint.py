"""A MiniCPM-o 4.5 checkpoint folder in the published layout, built from reference implementations.

Each stage has one builder in `STAGE_BUILDERS`: it makes the stage's reference module(s) at the small
config's dimensions with random weights (fixed seed) and returns them with their tensors under the
checkpoint's names. `write_checkpoint` writes them the way the published folder is laid out: config.json
with the real keys, sharded `model-0000i-of-0000n.safetensors` named by `model.safetensors.index.json`,
and the whole tokenizer set with the real special-token ids.

- `llm.*`: transformers' `Qwen3ForCausalLM` state dict.
- `tts.*`: MiniCPMTTS as OpenBMB/MiniCPM-o-Demo `MiniCPMO45/modeling_minicpmo_unified.py` builds it:
  transformers' `LlamaModel(LlamaConfig(...))`, `emb_text`, `emb_code`, `head_code` under
  `torch.nn.utils.parametrizations.weight_norm`, `projector_semantic` / `projector_spk` MultiModalProjectors.
- `apm.*`, `audio_projection_layer.*`: transformers' `WhisperEncoder` and the projector (Linear, ReLU, Linear).
- `vpm.*`, `resampler.*`: transformers' `SiglipVisionModel` (the layers that run) and MiniCPM-o's
  `Resampler` as tests/test_vision_reference.py reproduces it from the public source.

transformers is a test-time dependency only: nothing under export/ or minicpmo_triton/ imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from export.presets import MINICPMO45_TOKENS

SEED = 1234
# The published config.json's keys (MINICPMO45_CONFIG) at a size a CPU test affords; vocab and token ids real.
SMALL_CONFIG = {
    "architectures": ["MiniCPMO"], "model_type": "minicpmo",
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 64, "vocab_size": 151748, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "hidden_act": "silu",
    "audio_pool_step": 5, "query_num": 64, "image_size": 448, "drop_vision_last_layer": True,
    "audio_config": {"num_mel_bins": 80, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2,
                     "encoder_ffn_dim": 64, "max_source_positions": 1500},
    # vision_config.image_size is the position table (980 in the real one: 70x70); slices are 448 (top level).
    # Its width differs from the LLM's, as the real one's (1152, 4096): the reference resampler has a
    # `kv_proj` only then.
    "vision_config": {"image_size": 448, "patch_size": 14, "hidden_size": 48, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "intermediate_size": 64},
    "tts_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "intermediate_size": 64, "max_position_embeddings": 4096, "num_text_tokens": 152064,
                   "num_audio_tokens": 6562, "llm_dim": 32, "num_vq": 1, "projector_type": "mlp",
                   "normalize_projected_hidden": True, "audio_bos_token_id": 151687, "text_eos_token_id": 151692,
                   "backbone_model": "llama"},
}
Tensors = dict[str, torch.Tensor]


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    """Weights of a trained model's scale, and norms away from 1, so a swapped or skipped one shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("original0"):  # weight norm's g: a positive scale per row
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def _prefixed(prefix: str, module: nn.Module) -> Tensors:
    return {f"{prefix}{k}": v.detach().clone().contiguous() for k, v in module.state_dict().items()}


# --- llm.* -------------------------------------------------------------------------------------------------

def build_llm(config: dict, gen: torch.Generator) -> tuple[nn.Module, Tensors]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], rope_theta=config["rope_theta"], rms_norm_eps=config["rms_norm_eps"],
        tie_word_embeddings=config["tie_word_embeddings"], max_position_embeddings=config["max_position_embeddings"],
    )
    model = Qwen3ForCausalLM(cfg).eval()
    _randomize(model, gen)
    return model, _prefixed("llm.", model)


# --- tts.* -------------------------------------------------------------------------------------------------

class MultiModalProjector(nn.Module):
    """`MultiModalProjector` of modeling_minicpmo_unified.py: linear1, ReLU, linear2."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.relu = nn.ReLU()
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.relu(self.linear1(x)))


class ReferenceTTS(nn.Module):
    """`MiniCPMTTS.__init__` for backbone_model 'llama', projector_type 'mlp', num_vq 1."""

    def __init__(self, t: dict) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        h = t["hidden_size"]
        self.config = t
        self.model = LlamaModel(LlamaConfig(
            hidden_size=h, intermediate_size=t["intermediate_size"], num_attention_heads=t["num_attention_heads"],
            num_hidden_layers=t["num_hidden_layers"], num_key_value_heads=t["num_key_value_heads"],
            max_position_embeddings=t["max_position_embeddings"]))
        self.emb_text = nn.Embedding(t["num_text_tokens"], h)
        self.projector_spk = MultiModalProjector(t["llm_dim"], h)
        self.projector_semantic = MultiModalProjector(t["llm_dim"], h)
        self.emb_code = nn.ModuleList([nn.Embedding(t["num_audio_tokens"], h)])
        self.head_code = nn.ModuleList([torch.nn.utils.parametrizations.weight_norm(
            nn.Linear(h, t["num_audio_tokens"], bias=False), name="weight")])

    def condition(self, text_ids: torch.Tensor, llm_hidden: torch.Tensor) -> torch.Tensor:
        """`DuplexCapability._convert_results_to_tts_input`: [emb_text(id) + L2norm(proj(h)) ..., emb_text(bos)]."""
        semantic = self.projector_semantic(llm_hidden)
        if self.config["normalize_projected_hidden"]:
            semantic = nn.functional.normalize(semantic, p=2, dim=-1)
        bos = self.emb_text(torch.tensor([self.config["audio_bos_token_id"]]))
        return torch.cat([self.emb_text(text_ids) + semantic, bos])[None]

    def logits(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """`generate_chunk`'s forward: the Llama over the embeddings, head_code over every position."""
        positions = torch.arange(inputs_embeds.shape[1])[None]
        hidden = self.model(inputs_embeds=inputs_embeds, position_ids=positions).last_hidden_state
        return self.head_code[0](hidden)


def build_tts(config: dict, gen: torch.Generator) -> tuple[nn.Module, Tensors]:
    model = ReferenceTTS(config["tts_config"]).eval()
    _randomize(model, gen)
    return model, _prefixed("tts.", model)


# --- apm.* / audio_projection_layer.*: transformers' WhisperEncoder + MiniCPM-o's projector --------------------

def build_audio_encoder(config: dict, gen: torch.Generator) -> tuple[nn.Module, Tensors]:
    """`apm.*` is a WhisperEncoder state dict as it is; `audio_projection_layer.linear1/2` the projector's
    (Linear, ReLU, Linear: audio width -> LLM width -> LLM width)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    a = config["audio_config"]
    whisper = WhisperConfig(num_mel_bins=a["num_mel_bins"], d_model=a["d_model"], encoder_layers=a["encoder_layers"],
                            encoder_attention_heads=a["encoder_attention_heads"], encoder_ffn_dim=a["encoder_ffn_dim"],
                            max_source_positions=a["max_source_positions"], activation_function="gelu")
    encoder = WhisperEncoder(whisper).eval()
    h = config["hidden_size"]
    projection = nn.Sequential(nn.Linear(a["d_model"], h), nn.ReLU(), nn.Linear(h, h)).eval()
    with torch.no_grad():  # a trained model's spread, norms included, so a swapped tensor shows
        for name, p in [*encoder.named_parameters(), *projection.named_parameters()]:
            p.copy_((1.0 if "norm.weight" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
    tensors = {f"apm.{k}": v.contiguous() for k, v in encoder.state_dict().items()}
    for ours, ref in (("linear1", "0"), ("linear2", "2")):
        for kind in ("weight", "bias"):
            tensors[f"audio_projection_layer.{ours}.{kind}"] = projection.state_dict()[f"{ref}.{kind}"].contiguous()
    return nn.ModuleDict({"apm": encoder, "audio_projection_layer": projection}), tensors


# --- vpm.* / resampler.*: transformers' SigLIP + MiniCPM-o's resampler (tests/test_vision_reference.py) ------

def build_vision_encoder(config: dict, gen: torch.Generator) -> tuple[nn.Module, Tensors]:
    """`vpm.*` is a SiglipVisionModel's `vision_model.*` without the head, holding the layers that run
    (`drop_vision_last_layer`); `resampler.*` the reference Resampler's (its 2D sin-cos table is a buffer)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from .test_vision_reference import reference_resampler

    v = config["vision_config"]
    used = v["num_hidden_layers"] - int(config.get("drop_vision_last_layer", True))
    siglip = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"], num_hidden_layers=used,
        num_attention_heads=v["num_attention_heads"], image_size=v["image_size"], patch_size=v["patch_size"],
        layer_norm_eps=1e-6, vision_use_head=False)).eval()
    h = config["hidden_size"]
    resampler = reference_resampler(config["query_num"], h, v["hidden_size"]).eval()
    with torch.no_grad():
        for name, p in [*siglip.named_parameters(), *resampler.named_parameters()]:
            p.copy_((1.0 if name.endswith("norm.weight") or "layer_norm" in name and name.endswith("weight")
                     else 0.0) + 0.05 * torch.randn(p.shape, generator=gen))
    tensors = {"vpm." + k.removeprefix("vision_model."): t.contiguous() for k, t in siglip.state_dict().items()}
    tensors |= {"resampler." + k: t.contiguous() for k, t in resampler.state_dict().items()}
    return nn.ModuleDict({"vpm": siglip, "resampler": resampler}), tensors


Builder = Callable[[dict, torch.Generator], tuple[nn.Module, Tensors]]
STAGE_BUILDERS: dict[str, Builder] = {
    "llm": build_llm,
    "tts": build_tts,
    "audio_encoder": build_audio_encoder,
    "vision_encoder": build_vision_encoder,
}


# --- the folder ------------------------------------------------------------------------------------------

# The real tokenizer's strings for the preset's special-token ids (added_tokens.json).
SPECIAL_STRINGS = {
    "im_start": "<|im_start|>", "im_end": "<|im_end|>", "audio_start": "<|audio_start|>",
    "audio_end": "<|audio_end|>", "unit": "<unit>", "unit_end": "</unit>", "image": "<image>",
    "image_end": "</image>", "slice": "<slice>", "slice_end": "</slice>", "image_id": "<image_id>",
    "image_id_end": "</image_id>", "tts_bos": "<|tts_bos|>",
    "listen": "<|listen|>", "speak": "<|speak|>", "turn_eos": "<|turn_eos|>", "chunk_eos": "<|chunk_eos|>",
    "chunk_tts_eos": "<|chunk_tts_eos|>", "tts_pad": "<|tts_pad|>", "audio_placeholder": "<unk>",
}
EXTRA_SPECIALS = {"<|endoftext|>": 151643, "<|audio|>": 151698, "<focus>": 151687}


def _byte_level_vocab() -> dict[str, int]:
    """GPT-2's byte-to-unicode table: the 256 single-byte tokens a Qwen vocab starts with."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return {ch: i for i, ch in enumerate(alphabet)}


def _unnamed_ids(specials: set[int]) -> list[int]:
    """The ids with no token (past the 256 bytes, outside the specials): the published config names the ids
    the model must never say in `bad_token_ids`; here, the ones that would decode to nothing."""
    return [i for i in range(256, SMALL_CONFIG["vocab_size"]) if i not in specials]


def write_tokenizer_set(folder: Path) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json, added_tokens.json, vocab.json, merges.txt, special_tokens_map.json:
    a byte-level BPE (no merges) whose special tokens sit at MiniCPM-o 4.5's ids. Returns the specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = {SPECIAL_STRINGS[name]: getattr(MINICPMO45_TOKENS, name) for name in SPECIAL_STRINGS}
    specials |= EXTRA_SPECIALS
    vocab = _byte_level_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab | specials, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "added_tokens.json").write_text(json.dumps(specials, indent=2))
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "additional_special_tokens": [{"content": s, **entry} for s in specials],
        "eos_token": {"content": "<|im_end|>", **entry}, "pad_token": {"content": "<|endoftext|>", **entry},
        "unk_token": {"content": "<unk>", **entry}}, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(i): {"content": s, "special": True, **entry} for s, i in specials.items()},
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": "<unk>",
        "model_max_length": 40960, "bad_token_ids": _unnamed_ids(set(specials.values()))}, indent=2))
    return specials


@dataclass
class ReferenceCheckpoint:
    folder: Path
    config: dict
    modules: dict[str, nn.Module]  # per stage, the reference module its tensors came from
    tensors: Tensors


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_checkpoint(folder: Path, config: dict = SMALL_CONFIG, shards: int = 3,
                     seed: int = SEED, edit_llm: Callable[[nn.Module], None] | None = None) -> ReferenceCheckpoint:
    """`edit_llm`: changes the LLM's weights before they are written (a test that needs some token said)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    modules: dict[str, nn.Module] = {}
    tensors: Tensors = {}
    for stage, build in STAGE_BUILDERS.items():
        modules[stage], part = build(config, gen)
        tensors |= part
    if edit_llm is not None:
        edit_llm(modules["llm"])
        tensors |= _prefixed("llm.", modules["llm"])
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        chunk = names[i * per:(i + 1) * per]
        save_file({k: tensors[k] for k in chunk}, str(folder / shard_name(i, shards)), metadata={"format": "pt"})
        weight_map |= {k: shard_name(i, shards) for k in chunk}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_set(folder)
    modules["token2wav"] = write_token2wav_assets(folder, seed)
    return ReferenceCheckpoint(folder, config, modules, tensors)


def write_token2wav_assets(folder: Path, seed: int) -> nn.Module:
    """assets/token2wav as published (flow.yaml of the official classes, flow.pt, hift.pt with `generator.` keys,
    campplus.onnx, speech_tokenizer_v2_25hz.onnx) at small widths, and assets/system_ref_audio.wav. The flow and
    HiFT are minicpmo-utils' own classes (export/modules/stepaudio2.py imports them); the two ONNX graphs are
    stand-ins with the real inputs and outputs (the real ones are not on PyPI)."""
    import soundfile

    from export.checkpoint import DEFAULT_VOICE, TOKEN2WAV_ASSETS
    from export.modules.token2wav import Token2WavModel
    from export.modules.voice import TinyCampPlus, TinyS3Tokenizer
    from export.onnx_export import export_onnx
    from export.stages import voice_prompt_graphs
    from minicpmo_triton.model_config import Token2WavDims

    d, assets = Token2WavDims(), folder / TOKEN2WAV_ASSETS
    model = Token2WavModel.random(d, seed)
    model.save(assets, d)
    torch.manual_seed(seed)
    voice = nn.ModuleDict({"campplus": TinyCampPlus(dim=192), "s3": TinyS3Tokenizer()}).eval()
    for graph in voice_prompt_graphs(voice):
        export_onnx(graph, assets / graph.file)
    t = np.arange(24_000) / 24_000
    soundfile.write(str(folder / DEFAULT_VOICE), (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24_000)
    return model


F0_HZ = 150.0  # the random F0 predictor's output moved into the voiced range, so the source is harmonic


def to_1_0_7_layout(assets: Path) -> None:
    """1.0.5's files (flow.yaml, flow.pt, hift.pt: the original HiFT) made 1.0.7's: the original HiFT moved to
    hift_original.pt, a causal HiFT of the official classes (random weights) in config.yaml + hift.pt."""
    from export.modules.token2wav import causal_hift_yaml
    from minicpmo_triton.vocoder.causal_vocoder import TAGS
    from minicpmo_triton.vocoder.official_stepaudio2 import load_tagged_yaml, stepaudio2_module

    (assets / "hift.pt").rename(assets / "hift_original.pt")
    (assets / "config.yaml").write_text(causal_hift_yaml(16))
    torch.manual_seed(5)
    generator = stepaudio2_module("causal_vocoder.generator")
    hift = load_tagged_yaml(causal_hift_yaml(16), TAGS, {"hifigan": None})["hift"]
    assert isinstance(hift, generator.CausalHiFTGenerator)
    with torch.no_grad():
        hift.f0_predictor.classifier.bias.fill_(F0_HZ)
        hift.conv_pre.parametrizations.weight.original0.mul_(20.0)  # so the flow's mel is heard over the source
    torch.save(hift.state_dict(), assets / "hift.pt")

"""Each stage as an exportable graph: its module, named example inputs and dynamic axes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.export import Dim

from minicpmo_triton.model_config import PresetConfig

from .modules.audio_encoder import AudioEncoder
from .modules.llm import DuplexLLM
from .modules.speaker import SpeakerEncoder
from .modules.token2wav import Token2Wav
from .modules.tts import DuplexTTS
from .modules.vision import VisionEncoder

STAGE_NAMES = ("audio_encoder", "vision_encoder", "speaker_encoder", "llm", "tts", "token2wav")


@dataclass
class StageGraph:
    name: str
    module: nn.Module
    make_inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]
    output_names: list[str]
    dynamic_shapes: dict[str, dict[int, Dim]]
    tolerance: float = 1e-3


INIT_STD = 0.02  # Hugging Face's initializer_range
AUDIO_GAIN = 10.0  # random audio embeddings as loud as token embeddings, so what is heard matters
SPEAKER_GAIN = 20.0  # and a voice reference audible in what the random vocoder makes


def init_random_weights(stage: str, module: nn.Module, preset: PresetConfig) -> None:
    """A trained model's scale: N(0, 0.02) weights, zero biases, audio embeddings not drowned out."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=INIT_STD)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    with torch.no_grad():
        if stage == "audio_encoder":
            module.audio_projection_layer.linear2.weight.mul_(AUDIO_GAIN)
        # Random weights have no sense of an end: the logits of the ends a model stops by itself (the speech
        # EOS, a chat reply's <|im_end|>) sit at 0, mid-rank, never among the top-k, so a random TTS speaks
        # its text out and a random chat reply runs to max_new_tokens, whatever the seed.
        if stage == "tts":
            module.head_code[0].weight[-1].zero_()
        if stage == "llm":
            module.lm_head.weight[preset.tokens.im_end].zero_()
        if stage == "token2wav":
            for m in module.modules():  # variance-keeping, so the waveform follows its tokens
                if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
                    fan_in = m.in_channels * (m.kernel_size[0] if isinstance(m, nn.Conv1d) else 1)
                    nn.init.normal_(m.weight, std=(2.0 / fan_in) ** 0.5)
                    nn.init.zeros_(m.bias)
            module.speaker_proj.weight.mul_(SPEAKER_GAIN)  # a zero speaker (the default voice) still adds nothing


def build_modules(preset: PresetConfig, seed: int) -> dict[str, nn.Module]:
    """Each stage from a seed of its own (`seed` + its index in STAGE_NAMES), so changing one stage's
    module leaves the other stages' random weights as they were."""
    h = preset.llm.hidden
    makers: dict[str, Callable[[], nn.Module]] = {
        "audio_encoder": lambda: AudioEncoder(preset.audio, h),
        "vision_encoder": lambda: VisionEncoder(preset.vision, h),
        "speaker_encoder": lambda: SpeakerEncoder(preset.speaker),
        "llm": lambda: DuplexLLM(preset.llm),
        "tts": lambda: DuplexTTS(preset.tts, h),
        "token2wav": lambda: Token2Wav(preset.token2wav, preset.tts.num_audio_tokens),
    }
    modules: dict[str, nn.Module] = {}
    for i, stage in enumerate(STAGE_NAMES):
        torch.manual_seed(seed + i)
        modules[stage] = makers[stage]()
        init_random_weights(stage, modules[stage], preset)
    return modules


def _decoder_inputs(g: torch.Generator, layers: int, kv_heads: int, head_dim: int, b: int, t: int, p: int):
    past = lambda: torch.randn(layers, b, kv_heads, p, head_dim, generator=g)  # noqa: E731
    past_mask = torch.ones(b, p, dtype=torch.bool)
    past_mask[0, :2] = False  # row 0 is left-padded, as in a mixed batch
    return {
        "position_ids": torch.arange(p, p + t).repeat(b, 1),
        "past_mask": past_mask,
        "past_key": past(),
        "past_value": past(),
        "last_index": torch.tensor([t - 1] + [t - 2] * (b - 1)),
    }


def stage_graphs(preset: PresetConfig, modules: dict[str, nn.Module]) -> list[StageGraph]:
    batch, seq, past = Dim("batch", min=1, max=1024), Dim("seq", min=1, max=8192), Dim("past", min=0, max=8192)
    llm, tts = preset.llm, preset.tts.decoder
    b, t, p = 2, 5, 3

    def audio_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"audio": 0.1 * torch.randn(b, 16_000, generator=g)}

    def llm_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        use = torch.zeros(b, t, dtype=torch.bool)
        use[:, 1:3] = True
        return {
            "input_ids": torch.randint(0, llm.vocab, (b, t), generator=g),
            "embeds": torch.randn(b, t, llm.hidden, generator=g),
            "use_embeds": use,
            **_decoder_inputs(g, llm.layers, llm.kv_heads, llm.head_dim, b, t, p),
        }

    def tts_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        is_code = torch.zeros(b, t, dtype=torch.bool)
        is_code[:, 3:] = True
        has_hidden = torch.zeros(b, t, dtype=torch.bool)
        has_hidden[:, :2] = True  # text, text, audio_bos, code, code
        return {
            "text_ids": torch.randint(0, preset.tts.num_text_tokens, (b, t), generator=g),
            "llm_hidden": torch.randn(b, t, llm.hidden, generator=g),
            "has_hidden": has_hidden,
            "code_ids": torch.randint(0, preset.tts.num_audio_tokens, (b, t), generator=g),
            "is_code": is_code,
            **_decoder_inputs(g, tts.layers, tts.kv_heads, tts.head_dim, b, t, p),
        }

    def vision_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        size = preset.vision.image_size
        return {"pixels": torch.rand(b, 3, size, size, generator=g) * 2 - 1}

    def t2w_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"tokens": torch.randint(0, preset.tts.num_audio_tokens, (b, 32), generator=g),
                "speaker": torch.randn(b, preset.speaker.dim, generator=g)}

    def speaker_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"audio": 0.1 * torch.randn(b, 24_000, generator=g)}

    bt = {0: batch, 1: seq}
    kv = {1: batch, 3: past}
    decoder_axes = {"position_ids": bt, "past_mask": {0: batch, 1: past}, "past_key": kv, "past_value": kv,
                    "last_index": {0: batch}}
    speaker = {"speaker": {0: batch}}
    return [
        StageGraph("audio_encoder", modules["audio_encoder"], audio_inputs, ["embeds"],
                   {"audio": {0: batch, 1: Dim("samples", min=1600, max=16_000 * 30)}}),
        StageGraph("vision_encoder", modules["vision_encoder"], vision_inputs, ["embeds"],
                   {"pixels": {0: batch}}),
        StageGraph("llm", modules["llm"], llm_inputs, ["logits", "hidden", "present_key", "present_value"],
                   {"input_ids": bt, "embeds": bt, "use_embeds": bt, **decoder_axes}),
        StageGraph("tts", modules["tts"], tts_inputs, ["logits", "present_key", "present_value"],
                   {"text_ids": bt, "llm_hidden": bt, "has_hidden": bt, "code_ids": bt, "is_code": bt,
                    **decoder_axes}),
        StageGraph("token2wav", modules["token2wav"], t2w_inputs, ["waveform"],
                   {"tokens": {0: batch, 1: Dim("window", min=8, max=4096)}, **speaker}),
        StageGraph("speaker_encoder", modules["speaker_encoder"], speaker_inputs, ["embedding"],
                   {"audio": {0: batch, 1: Dim("ref_samples", min=1600, max=16_000 * 30)}}),
    ]

"""Each stage as an exportable graph: its module, named example inputs and dynamic axes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from minicpmo_triton.engine.model import DuplexLLM
from minicpmo_triton.engine.tts_model import DuplexTTS
from minicpmo_triton.media.audio_mel import CONTEXT_FRAMES
from minicpmo_triton.media.images import Slice
from minicpmo_triton.model_config import PresetConfig, VisionDims
from minicpmo_triton.stages.token2wav_device import TORCH_FOLDER
from minicpmo_triton.stages.vision_encoder import batch_inputs as vision_batch_inputs

from .modules.audio_encoder import AudioEncoderStream, UtteranceEncoder
from .modules.token2wav import Token2WavModel, tables_bytes
from .modules.token2wav import graphs as token2wav_graphs
from .modules.vision import VisionEncoder
from .modules.voice import TinyCampPlus, TinyS3Tokenizer

STAGE_NAMES = ("audio_encoder", "vision_encoder", "llm", "tts", "token2wav")
# Each stage's random weights come from `seed` + its offset here: its place in the stage list when tiny's
# weights were fixed (2 was the retired speaker_encoder's), so removing a stage changes no other stage's weights.
SEED_OFFSETS = {"audio_encoder": 0, "vision_encoder": 1, "llm": 3, "tts": 4, "token2wav": 5, "token2wav_voice": 6}


@dataclass
class StageGraph:
    name: str
    module: nn.Module
    make_inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]
    output_names: list[str]
    dynamic_shapes: dict[str, dict[int, Any]]  # torch.export Dims, or axis names for the TorchScript exporter
    tolerance: float = 1e-3
    model: str = ""  # the Triton model whose version folder holds the graph (default: `name`)
    file: str = "model.onnx"
    dynamo: bool = True  # False: the TorchScript exporter (token2wav's graphs: data-dependent cache lengths)

    @property
    def folder(self) -> str:
        return self.model or self.name


INIT_STD = 0.02  # Hugging Face's initializer_range
AUDIO_GAIN = 10.0  # random audio embeddings as loud as token embeddings, so what is heard matters


def init_random_weights(stage: str, module: nn.Module, preset: PresetConfig) -> None:
    """A trained model's scale: N(0, 0.02) weights, zero biases, audio embeddings not drowned out."""
    if stage == "token2wav":  # the official classes' own initialisation (Token2WavModel.random)
        return
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


def build_module(preset: PresetConfig, stage: str, seed: int, token2wav: Token2WavModel | None = None) -> nn.Module:
    """One stage's module with random weights from `seed` + its SEED_OFFSETS (the same module `build_modules`
    builds for it), on the default device (a `torch.device` context puts it on a GPU)."""
    h = preset.llm.hidden
    makers: dict[str, Callable[[], nn.Module]] = {
        "audio_encoder": lambda: UtteranceEncoder(preset.audio, h),
        "vision_encoder": lambda: VisionEncoder(preset.vision, h),
        "llm": lambda: DuplexLLM(preset.llm),
        "tts": lambda: DuplexTTS(preset.tts, h),
        "token2wav": lambda: token2wav or Token2WavModel.random(preset.token2wav, seed + SEED_OFFSETS["token2wav"]),
    }
    torch.manual_seed(seed + SEED_OFFSETS[stage])
    module = makers[stage]()
    init_random_weights(stage, module, preset)
    return module


def build_modules(preset: PresetConfig, seed: int, token2wav: Token2WavModel | None = None) -> dict[str, nn.Module]:
    """Each stage from a seed of its own (`seed` + its SEED_OFFSETS), so changing one stage's module
    leaves the other stages' random weights as they were. `token2wav`: a checkpoint's, used as it is (a random
    one is not built beside it: the official CFM allocates ~2 GB of streaming buffers per instance)."""
    modules: dict[str, nn.Module] = {stage: build_module(preset, stage, seed, token2wav) for stage in STAGE_NAMES}
    torch.manual_seed(seed + SEED_OFFSETS["token2wav_voice"])  # the voice-prompt graphs (a checkpoint ships its own)
    modules["token2wav_voice"] = nn.ModuleDict({"campplus": TinyCampPlus(dim=preset.token2wav.spk_embed_dim),
                                                "s3": TinyS3Tokenizer()}).eval()
    return modules


def _decoder_inputs(g: torch.Generator, layers: int, kv_heads: int, head_dim: int, b: int, t: int, p: int):
    past = lambda: torch.randn(layers, b, kv_heads, p, head_dim, generator=g)  # noqa: E731 (a one-line helper)
    past_mask = torch.ones(b, p, dtype=torch.bool)
    past_mask[0, :2] = False  # row 0 is left-padded, as in a mixed batch
    return {
        "position_ids": torch.arange(p, p + t).repeat(b, 1),
        "past_mask": past_mask,
        "past_key": past(),
        "past_value": past(),
        "last_index": torch.tensor([t - 1] + [t - 2] * (b - 1)),
    }


def vision_example(d: VisionDims, grids: list[tuple[int, int]], g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random slices of the given patch grids (rows, cols), batched as the vision stage batches them."""
    slices = [Slice((torch.rand(3, d.patch, r * c * d.patch, generator=g) * 2 - 1).numpy(), r, c) for r, c in grids]
    return {name: torch.from_numpy(value) for name, value in vision_batch_inputs(slices, d).items()}


def vision_graph(d: VisionDims, module: nn.Module) -> StageGraph:
    batch, patches = Dim("batch", min=1, max=1024), Dim("patches", min=1, max=d.max_patches)
    return StageGraph(
        "vision_encoder", module, lambda g: vision_example(d, [(5, 7), (4, 6), (1, 3)], g), ["embeds"],
        {"pixels": {0: batch, 3: patches * d.patch}, "position_ids": {0: batch, 1: patches}, "tgt_sizes": {0: batch}},
    )


def stage_graphs(preset: PresetConfig, modules: dict[str, nn.Module]) -> list[StageGraph]:
    batch, seq, past = Dim("batch", min=1, max=1024), Dim("seq", min=1, max=8192), Dim("past", min=0, max=8192)
    llm, tts = preset.llm, preset.tts.decoder
    b, t, p = 2, 5, 3

    def audio_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"audio": 0.1 * torch.randn(b, 16_000, generator=g)}

    def audio_stream_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        a = preset.audio
        frames = 2 * CONTEXT_FRAMES + 100  # one second
        mel_mask = torch.ones(b, frames, dtype=torch.bool)
        mel_mask[0, :CONTEXT_FRAMES] = False  # row 0 starts its stream
        heads, head_dim = a.heads, a.d_model // a.heads
        return {
            "mel": torch.randn(b, a.n_mels, frames, generator=g) * mel_mask[:, None, :],
            "mel_mask": mel_mask,
            **{k: v for k, v in _decoder_inputs(g, a.layers, heads, head_dim, b, 50, p).items() if k != "last_index"},
        }

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

    bt = {0: batch, 1: seq}
    audio_tokens = Dim("audio_tokens", min=1, max=300)  # a stream chunk: whole LLM tokens of 10 mel frames
    mel_frames = 2 * CONTEXT_FRAMES + 10 * audio_tokens
    audio_past = Dim("audio_past", min=0, max=preset.audio.max_positions)
    kv = {1: batch, 3: past}
    decoder_axes = {"position_ids": bt, "past_mask": {0: batch, 1: past}, "past_key": kv, "past_value": kv,
                    "last_index": {0: batch}}
    return [
        StageGraph("audio_encoder", modules["audio_encoder"], audio_inputs, ["embeds"],
                   {"audio": {0: batch, 1: Dim("samples", min=1600, max=16_000 * 30)}}),
        # The duplex step's chunk against the session's Whisper KV cache (used inside the `llm` model).
        StageGraph("audio_encoder_stream", AudioEncoderStream(modules["audio_encoder"]), audio_stream_inputs,
                   ["embeds", "present_key", "present_value"],
                   {"mel": {0: batch, 2: mel_frames}, "mel_mask": {0: batch, 1: mel_frames},
                    "position_ids": {0: batch, 1: 5 * audio_tokens}, "past_mask": {0: batch, 1: audio_past},
                    "past_key": {1: batch, 3: audio_past}, "past_value": {1: batch, 3: audio_past}},
                   model="audio_encoder", file="stream.onnx"),
        vision_graph(preset.vision, modules["vision_encoder"]),
        StageGraph("llm", modules["llm"], llm_inputs, ["logits", "hidden", "present_key", "present_value"],
                   {"input_ids": bt, "embeds": bt, "use_embeds": bt, **decoder_axes}),
        StageGraph("tts", modules["tts"], tts_inputs, ["logits", "present_key", "present_value"],
                   {"text_ids": bt, "llm_hidden": bt, "has_hidden": bt, "code_ids": bt, "is_code": bt,
                    **decoder_axes}),
        *token2wav_stage_graphs(preset, modules["token2wav"]),
        *voice_prompt_graphs(modules["token2wav_voice"]),
    ]


def voice_prompt_graphs(voice: nn.Module) -> list[StageGraph]:
    """token2wav/1/{campplus,speech_tokenizer_v2_25hz}.onnx: `tiny`'s stand-ins, the real graphs' inputs and outputs."""
    b = 2

    def campplus_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"input": torch.randn(b, 120, 80, generator=g)}

    def s3_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {"feats": torch.randn(b, 128, 203, generator=g),
                "feats_length": torch.tensor([203, 150], dtype=torch.int32)}

    return [
        StageGraph("token2wav_campplus", voice.campplus, campplus_inputs, ["output"],
                   {"input": {0: "b", 1: "t"}, "output": {0: "b"}}, tolerance=1e-4, model="token2wav",
                   file="campplus.onnx", dynamo=False),
        StageGraph("token2wav_speech_tokenizer_v2_25hz", voice.s3, s3_inputs, ["indices"],
                   {"feats": {0: "b", 2: "t"}, "feats_length": {0: "b"}, "indices": {0: "b", 1: "tokens"}},
                   tolerance=0, model="token2wav", file="speech_tokenizer_v2_25hz.onnx", dynamo=False),
    ]


DEFAULT_VOICE_TOKENS = 40  # tiny's default voice prompt: 1.6 s of random S3 tokens and a log-mel like a voice's


def token2wav_stage_graphs(preset: PresetConfig, model: Token2WavModel) -> list[StageGraph]:
    """token2wav's three graphs (token2wav/1/{encoder,estimator,vocoder}.onnx), caches as explicit tensors."""
    d = preset.token2wav
    b, dk = 2, 2 * d.channels // d.heads
    mods = token2wav_graphs(model)

    def encoder_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        t1 = 10
        return {"tokens": torch.randint(0, d.vocab, (b, d.chunk_tokens + d.lookahead), generator=g),
                "n_real": torch.tensor([d.chunk_tokens + d.lookahead, 7]),
                "cnn_cache": torch.randn(b, d.channels, 6, generator=g),
                "token_cache": torch.randn(d.num_blocks, b, d.heads, t1, dk, generator=g),
                "mel_cache": torch.randn(d.num_up_blocks, b, d.heads, 2 * t1, dk, generator=g),
                "cache_len": torch.tensor([t1, t1 - 3])}

    def estimator_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        n, tc = 2 * d.chunk_tokens, 30
        return {"x": torch.randn(b, d.n_mels, n, generator=g), "mu": torch.randn(b, d.n_mels, n, generator=g),
                "t": torch.tensor([0.3, 0.3]), "spk": torch.randn(b, d.n_mels, generator=g),
                "cond": torch.zeros(b, d.n_mels, n),
                "cnn_cache": torch.randn(d.dit_depth, 2 * b, 2 * d.dit_hidden, 2, generator=g),
                "att_cache": torch.randn(d.dit_depth, 2 * b, d.dit_heads, tc, 2 * d.dit_head_dim, generator=g),
                "cache_len": torch.tensor([tc, tc - 5])}

    def vocoder_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
        frames, harmonics = 2 * d.chunk_tokens + d.mel_cache_frames, model.hift.nb_harmonics + 1
        rand_ini = torch.rand(b, harmonics, generator=g)
        rand_ini[:, 0] = 0
        return {"mel": torch.randn(b, d.n_mels, frames, generator=g) - 5,
                "cache_source": 0.1 * torch.randn(b, 1, d.source_cache_samples, generator=g),
                "cache_len": torch.tensor([d.source_cache_samples, 0]), "rand_ini": rand_ini,
                "sine_noise": torch.randn(b, frames * 480, harmonics, generator=g)}

    def axes(**named: dict[int, str]) -> dict[str, dict[int, Any]]:
        return named

    return [
        StageGraph("token2wav_encoder", mods["encoder"], encoder_inputs,
                   ["mu", "new_cnn_cache", "new_token_cache", "new_mel_cache"],
                   axes(tokens={0: "b", 1: "t"}, n_real={0: "b"}, cnn_cache={0: "b"}, token_cache={1: "b", 3: "t1"},
                        mel_cache={1: "b", 3: "t2"}, cache_len={0: "b"}, mu={0: "b", 1: "frames"},
                        new_cnn_cache={0: "b"}, new_token_cache={1: "b", 3: "t1_new"},
                        new_mel_cache={1: "b", 3: "t2_new"}),
                   tolerance=1e-4, model="token2wav", file="encoder.onnx", dynamo=False),
        StageGraph("token2wav_estimator", mods["estimator"], estimator_inputs,
                   ["velocity", "new_cnn_cache", "new_att_cache"],
                   axes(x={0: "b", 2: "n"}, mu={0: "b", 2: "n"}, t={0: "b"}, spk={0: "b"}, cond={0: "b", 2: "n"},
                        cnn_cache={1: "b2"}, att_cache={1: "b2", 3: "tc"}, cache_len={0: "b"},
                        velocity={0: "b", 2: "n"}, new_cnn_cache={1: "b2"}, new_att_cache={1: "b2", 3: "tc_new"}),
                   tolerance=1e-4, model="token2wav", file="estimator.onnx", dynamo=False),
        StageGraph("token2wav_vocoder", mods["vocoder"], vocoder_inputs, ["speech", "source"],
                   axes(mel={0: "b", 2: "frames"}, cache_source={0: "b"}, cache_len={0: "b"}, rand_ini={0: "b"},
                        sine_noise={0: "b", 1: "samples"}, speech={0: "b", 1: "out_samples"},
                        source={0: "b", 2: "samples"}),
                   tolerance=1e-4, model="token2wav", file="vocoder.onnx", dynamo=False),
    ]


def stage_files(preset: PresetConfig, modules: dict[str, nn.Module], seed: int) -> dict[str, bytes]:
    """Artefacts beside the graphs, by path under the model repository."""
    import io

    import numpy as np

    model = modules["token2wav"]
    assert isinstance(model, Token2WavModel)
    rng = np.random.default_rng(seed)
    voice = io.BytesIO()
    np.savez(voice, tokens=rng.integers(0, preset.token2wav.vocab, DEFAULT_VOICE_TOKENS),
             mel=rng.normal(-6.0, 1.5, (2 * DEFAULT_VOICE_TOKENS, preset.token2wav.n_mels)).astype(np.float32),
             embedding=rng.standard_normal(preset.token2wav.spk_embed_dim).astype(np.float32))
    torch_files = {f"token2wav/1/{TORCH_FOLDER}/{name}": data for name, data in model.files(preset.token2wav).items()}
    return {"token2wav/1/tables.npz": tables_bytes(model), "token2wav/1/default_voice.npz": voice.getvalue(),
            **torch_files,
            f"audio_encoder/1/{PAGED_WEIGHTS}": paged_weights_bytes(preset, modules["audio_encoder"]),
            f"llm/1/{PAGED_WEIGHTS}": paged_weights_bytes(preset, modules["llm"]),
            f"tts/1/{PAGED_WEIGHTS}": paged_weights_bytes(preset, modules["tts"])}


PAGED_WEIGHTS = "weights.safetensors"  # the device engines' weights (minicpmo_triton/engine), beside model.onnx


def paged_weights_bytes(preset: PresetConfig, module: nn.Module) -> bytes:
    """An LLM's, TTS's or audio encoder's state dict under its checkpoint names, for the paged engines: fp32 for
    `tiny` (its parity with the ONNX graph is tested to 1e-4), bf16 for a real checkpoint (what the GPU runs)."""
    from safetensors.torch import save

    dtype = torch.float32 if preset.name == "tiny" else torch.bfloat16
    return save({k: v.detach().to(dtype).contiguous().clone() for k, v in module.state_dict().items()})

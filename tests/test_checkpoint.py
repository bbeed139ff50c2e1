"""The minicpm-o-4.5 preset built from a local checkpoint folder (one the test writes: no download)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from export.checkpoint import (
    DEFAULT_VOICE,
    TOKEN2WAV_ASSETS,
    CheckpointError,
    load_checkpoint,
    load_token2wav,
    preset_from_config,
    save_checkpoint,
)
from export.onnx_export import export_onnx
from export.presets import MINICPMO45_TOKENS, minicpmo45
from export.stages import build_modules, voice_prompt_graphs
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.tokenizer import load_tokenizer

from .conftest import REPO

SMALL_CONFIG = {  # the real checkpoint's config keys, at a size a CPU test can afford
    "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "intermediate_size": 64, "vocab_size": 151_936,
    "audio_config": {"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64},
    "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64},
    "tts_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                   "num_text_tokens": 152_064, "num_audio_tokens": 6562},
}


def write_tokenizer(folder: Path) -> None:
    specials = {tok: i for tok, i in {
        "<|im_start|>": MINICPMO45_TOKENS.im_start, "<|im_end|>": MINICPMO45_TOKENS.im_end,
        "<|listen|>": MINICPMO45_TOKENS.listen, "<|speak|>": MINICPMO45_TOKENS.speak}.items()}
    vocab = {chr(c): c - 32 for c in range(32, 127)} | {"[UNK]": 200} | specials
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("ckpt")
    preset = preset_from_config(minicpmo45(), SMALL_CONFIG)
    modules = build_modules(preset, seed=123)
    save_checkpoint(folder, modules, SMALL_CONFIG)
    write_tokenizer(folder)
    write_token2wav_assets(folder, modules, preset)
    return folder, modules


def write_token2wav_assets(folder: Path, modules: dict, preset) -> None:
    """assets/token2wav in the real layout (flow.yaml, flow.pt, hift.pt, campplus.onnx,
    speech_tokenizer_v2_25hz.onnx) and the reference voice assets/system_ref_audio.wav."""
    import soundfile

    assets = folder / TOKEN2WAV_ASSETS
    modules["token2wav"].save(assets, preset.token2wav)
    for graph in voice_prompt_graphs(modules["token2wav_voice"]):
        export_onnx(graph, assets / graph.file)
    t = np.arange(24_000) / 24_000
    soundfile.write(str(folder / DEFAULT_VOICE), (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24_000)


def test_checkpoint_names_follow_minicpmo(checkpoint) -> None:
    from safetensors import safe_open

    folder, _ = checkpoint
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for expected in ("llm.model.embed_tokens.weight", "llm.model.layers.0.self_attn.q_norm.weight",
                     "llm.lm_head.weight", "apm.layers.0.self_attn.k_proj.weight",
                     "apm.layers.0.self_attn.q_proj.bias", "audio_projection_layer.linear1.weight",
                     "tts.emb_code.0.weight", "tts.head_code.0.weight", "tts.model.layers.0.mlp.gate_proj.weight",
                     "vpm.embeddings.patch_embedding.weight", "vpm.encoder.layers.0.self_attn.q_proj.weight",
                     "vpm.encoder.layers.0.mlp.fc1.weight", "resampler.attn.in_proj_weight", "resampler.query"):
        assert expected in names
    assert "apm.layers.0.self_attn.k_proj.bias" not in names  # Whisper's k_proj has no bias


def test_loading_restores_every_tensor(checkpoint) -> None:
    folder, original = checkpoint
    preset = preset_from_config(minicpmo45(), SMALL_CONFIG)
    fresh = build_modules(preset, seed=999)
    loaded = load_checkpoint(folder, fresh, require=("audio_encoder", "llm", "tts"))
    assert set(loaded) == {"audio_encoder", "vision_encoder", "llm", "tts", "speaker_encoder"}
    fresh["token2wav"] = load_token2wav(folder, preset.token2wav)  # from assets/token2wav, not the safetensors
    for stage in (*loaded, "token2wav"):
        for (name, a), (_, b) in zip(original[stage].state_dict().items(), fresh[stage].state_dict().items(),
                                     strict=True):
            assert torch.equal(a, b), f"{stage}.{name}"


def test_a_checkpoint_missing_a_stage_is_refused(checkpoint, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = checkpoint
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith("tts.")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    preset = preset_from_config(minicpmo45(), SMALL_CONFIG)
    with pytest.raises(CheckpointError, match="no tensors for stage tts"):
        load_checkpoint(tmp_path, build_modules(preset, 1), require=("audio_encoder", "llm", "tts"))


def test_export_cli_builds_the_real_preset_from_the_checkpoint(checkpoint, tmp_path: Path) -> None:
    folder, _ = checkpoint
    repo = tmp_path / "repo"
    done = subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5", "--checkpoint", str(folder),
                           "--model-repository", str(repo)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded audio_encoder, vision_encoder, llm, tts, speaker_encoder, token2wav" in done.stdout
    preset = load_stage_config(repo / "llm" / "1")
    assert preset.name == "minicpm-o-4.5" and preset.llm.hidden == 32 and preset.tokens == MINICPMO45_TOKENS
    for stage in ("audio_encoder", "vision_encoder", "speaker_encoder", "llm", "tts"):
        assert (repo / stage / "1" / "model.onnx").exists()
    for graph in ("encoder", "estimator", "vocoder"):  # token2wav's three graphs
        assert (repo / "token2wav" / "1" / f"{graph}.onnx").exists()
    for name in ("campplus.onnx", "speech_tokenizer_v2_25hz.onnx"):  # the checkpoint's own, copied
        assert (repo / "token2wav" / "1" / name).read_bytes() == (folder / TOKEN2WAV_ASSETS / name).read_bytes()
    assert (repo / "token2wav" / "1" / "default_voice.wav").exists()  # its reference voice: the default
    assert preset.vision.d_model == 32 and preset.vision.resampler_heads == 1
    tok = load_tokenizer(preset, repo / "duplex" / "1")
    assert tok.encode("hi") == [ord("h") - 32, ord("i") - 32]
    assert not tok.is_text(MINICPMO45_TOKENS.listen)


def test_export_cli_errors_are_clear(tmp_path: Path) -> None:
    no_ckpt = subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5",
                              "--model-repository", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert no_ckpt.returncode == 2 and "--checkpoint" in no_ckpt.stderr
    trt = subprocess.run([sys.executable, "-m", "export", "--preset", "tiny", "--runtime", "tensorrt",
                          "--model-repository", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert trt.returncode == 2 and "GPU" in trt.stderr
    assert not any(tmp_path.iterdir()), "nothing is written when the request is refused"


def test_small_real_preset_runs_a_duplex_step(checkpoint, tmp_path: Path) -> None:
    """The exported real-preset stages serve a step in process (HF tokenizer, 151k vocab)."""
    import asyncio

    from minicpmo_triton.inprocess import InProcessStages
    from minicpmo_triton.pipeline import StepEvent, StepInput

    folder, _ = checkpoint
    repo = tmp_path / "repo"
    subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5", "--checkpoint", str(folder),
                    "--model-repository", str(repo)], cwd=REPO, check=True, capture_output=True)
    stages = InProcessStages(repo)
    events: list[StepEvent] = []

    async def emit(ev: StepEvent) -> None:
        events.append(ev)

    async def run() -> None:
        pipeline = stages.pipeline()
        rng = np.random.default_rng(0)
        for i in range(4):
            await pipeline.step(9, i == 0, i == 3, StepInput(audio=rng.standard_normal(16_000).astype(np.float32)),
                                emit)

    asyncio.run(run())
    assert [e.kind for e in events[:3]] == ["listen"] * 3
    assert events[0].chunk_usage["input_text_tokens"] > 0  # the system prompt, through the HF tokenizer
    assert stages.llm_stage.live_sequences == 0
    assert json.loads(json.dumps(events[0].metrics))["kv_cache_length"] > 10

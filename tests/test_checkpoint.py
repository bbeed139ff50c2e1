"""The minicpm-o-4.5 preset from a checkpoint folder in the published layout, built from the reference
modules (tests/reference_checkpoint.py): what it loads, what it refuses and how it says so."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from export import checkpoint
from export.checkpoint import (
    DEFAULT_VOICE,
    TOKEN2WAV_ASSETS,
    TOKENIZER_FILES,
    VOICE_GRAPHS,
    CheckpointError,
    load_checkpoint,
    load_token2wav,
    read_config,
)
from export.config import preset_from_config
from export.modules.token2wav import Token2WavModel
from export.presets import MINICPMO45_TOKENS, TINY_CONFIG, minicpmo45, tiny
from export.stages import build_modules
from minicpmo_triton.media.tokenizer import load_tokenizer
from minicpmo_triton.model_config import PresetConfig, load_stage_config
from minicpmo_triton.stages.token2wav import DEFAULT_VOICE_WAV

from .conftest import REPO
from .reference_checkpoint import ReferenceCheckpoint, write_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> ReferenceCheckpoint:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"))


def copy_of(ref: ReferenceCheckpoint, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(ref.folder, folder)
    return folder


def rewrite_shard(folder: Path, edit) -> None:
    """Apply `edit(tensors)` to every shard, keeping the index true to what the shards hold."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / INDEX).read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = edit(load_file(str(folder / shard)))
        save_file(tensors, str(folder / shard))
        weight_map |= {k: shard for k in tensors}
    (folder / INDEX).write_text(json.dumps({**index, "weight_map": weight_map}))


def export(folder: Path, repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5", "--checkpoint", str(folder),
                           "--model-repository", str(repo)], cwd=REPO, capture_output=True, text=True)


def load(folder: Path) -> dict[str, torch.nn.Module]:
    preset = preset_from_config(minicpmo45(), read_config(folder))
    modules = modules_for(preset)
    load_checkpoint(folder, modules, preset)
    return modules


def modules_for(preset: PresetConfig) -> dict[str, torch.nn.Module]:
    """The stages the safetensors load into; token2wav's weights are not among them (assets/token2wav), so its
    177 M random ones at the published width stay unbuilt (10 s each time)."""
    with torch.device("meta"):
        token2wav = Token2WavModel.random(preset.token2wav, 0)
    return build_modules(preset, seed=999, token2wav=token2wav)


def test_tiny_is_the_real_architecture_from_a_config_dict() -> None:
    """`tiny` takes the real checkpoint's path: its config.json-shaped dict through preset_from_config."""
    assert tiny() == preset_from_config(tiny(), TINY_CONFIG)
    assert set(TINY_CONFIG) >= {"audio_config", "vision_config", "tts_config"}
    assert set(TINY_CONFIG["tts_config"]) >= {"llm_dim", "normalize_projected_hidden", "audio_bos_token_id",
                                              "text_eos_token_id"}
    with torch.device("meta"):  # the real dimensions without their 36 GB
        real, small = build_modules(minicpmo45(), 0), build_modules(tiny(), 0)
    def kinds(module: torch.nn.Module) -> set[str]:
        return {re.sub(r"\.\d+\.", ".N.", name) for name in module.state_dict()}

    for stage in ("llm", "tts"):  # the same tensor names as the real preset (counts and shapes differ)
        assert kinds(real[stage]) == kinds(small[stage])
    d = tiny().tts.decoder
    assert (d.rope_theta, d.rms_eps, d.vocab) == (10_000.0, 1e-6, 32_000)  # Llama defaults: tts_config has none


def test_the_real_preset_reads_config_json(reference) -> None:
    preset = preset_from_config(minicpmo45(), read_config(reference.folder))
    assert preset.llm.vocab == 151_748 and preset.llm.hidden == 32 and not preset.llm.tie_word_embeddings
    assert preset.tts.audio_bos_token_id == 151_687 and preset.tts.text_eos_token_id == 151_692
    assert preset.tts.normalize_projected_hidden and preset.tts.decoder.rope_theta == 10_000.0
    assert minicpmo45().llm.vocab == 151_748 and minicpmo45().tokens == MINICPMO45_TOKENS
    bad = {**reference.config, "tts_config": {**reference.config["tts_config"], "llm_dim": 64}}
    with pytest.raises(CheckpointError, match="llm_dim 64"):
        preset_from_config(minicpmo45(), bad)


def test_loading_takes_every_tensor_from_the_reference(reference) -> None:
    modules = load(reference.folder)
    qwen = reference.modules["llm"].state_dict()
    for name, value in modules["llm"].state_dict().items():
        assert torch.equal(value, qwen[name]), name
    tts = reference.modules["tts"]
    mine = modules["tts"].state_dict()
    torch.testing.assert_close(mine["head_code.0.weight"], tts.head_code[0].weight.detach())  # weight norm folded
    for name in ("model.embed_tokens.weight", "projector_spk.linear1.weight", "projector_semantic.linear2.bias",
                 "emb_text.weight", "model.layers.1.self_attn.o_proj.weight"):
        assert torch.equal(mine[name], tts.state_dict()[name]), name
    assert mine["model.embed_tokens.weight"].shape == (32_000, 32)  # present in the file, never used


class RecordingShards:
    """safe_open as the loader uses it, recording every tensor whose data is read (get_tensor), with a weak
    reference to it, so a test sees what was read when, and whether it is still held."""

    reads: list[tuple[str, weakref.ref[torch.Tensor]]] = []

    def __init__(self, path: str, framework: str) -> None:
        from safetensors import safe_open

        self.file = safe_open(path, framework)

    def __enter__(self) -> RecordingShards:
        self.file.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.file.keys()

    def get_slice(self, name: str):
        return self.file.get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self.file.get_tensor(name)
        self.reads.append((name, weakref.ref(tensor)))
        return tensor


def test_loading_reads_one_stage_at_a_time(reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening reads the shards' headers only; the report needs no data; each stage's tensors are read when it
    is loaded, and released before the next stage's are read."""
    monkeypatch.setattr(checkpoint, "safe_open", RecordingShards)
    monkeypatch.setattr(RecordingShards, "reads", [])
    reads = RecordingShards.reads
    shards = checkpoint.CheckpointTensors(reference.folder)
    assert not reads
    assert {n: i.shape for n, i in shards.info.items()} == {n: tuple(t.shape) for n, t in reference.tensors.items()}
    assert {i.dtype for i in shards.info.values()} == {"F32"}

    damaged = copy_of(reference, tmp_path)
    rewrite_shard(damaged, lambda t: {k: (v[:-1] if k == "tts.emb_text.weight" else v) for k, v in t.items()})
    with pytest.raises(CheckpointError, match="mis-shaped  emb_text.weight"):
        load(damaged)
    assert not reads  # a checkpoint that does not fit is refused before any data is read

    def stage_of(name: str) -> str:
        return next(s for s, spec in checkpoint.STAGE_CHECKPOINTS.items() if name.startswith(spec.prefixes))

    preset = preset_from_config(minicpmo45(), read_config(reference.folder))
    modules = modules_for(preset)
    order: list[str] = []
    for stage, module in modules.items():
        def load_state_dict(state, strict=True, stage=stage, original=module.load_state_dict):
            order.append(stage)
            assert {stage_of(n) for n, _ in reads} == set(order)  # this stage's and the loaded ones', no other
            assert {stage_of(n) for n, ref in reads if ref() is not None} == {stage}  # the loaded ones released
            return original(state, strict=strict)

        module.load_state_dict = load_state_dict
    assert checkpoint.load_checkpoint(reference.folder, modules, preset) == order
    assert order == ["audio_encoder", "vision_encoder", "llm", "tts"]
    assert sorted(n for n, _ in reads) == sorted(reference.tensors)  # each tensor read once
    assert all(ref() is None for _, ref in reads)


def test_old_style_weight_norm_still_folds(reference, tmp_path: Path) -> None:
    folder = copy_of(reference, tmp_path)
    head = "tts.head_code.0.parametrizations.weight."

    def old_style(t: dict) -> dict:
        if head + "original0" in t:
            t["tts.head_code.0.weight_g"], t["tts.head_code.0.weight_v"] = t.pop(head + "original0"), t.pop(
                head + "original1")
        return t

    rewrite_shard(folder, old_style)
    torch.testing.assert_close(load(folder)["tts"].head_code[0].weight.detach(),
                               reference.modules["tts"].head_code[0].weight.detach())


def test_a_mismatched_checkpoint_fails_with_a_report(reference, tmp_path: Path) -> None:
    """Missing, unexpected and mis-shaped tensors: one report per stage, names and shapes, no traceback."""
    folder = copy_of(reference, tmp_path)

    def damage(t: dict) -> dict:
        for name in [k for k in t if k.startswith("llm.model.layers.1.")]:
            del t[name]
        if "tts.emb_code.0.weight" in t:
            t["tts.emb_code.0.weight"] = torch.zeros(100, 32)
        if "tts.emb_text.weight" in t:
            t["tts.extra.weight"] = torch.zeros(3)
        return t

    rewrite_shard(folder, damage)
    done = export(folder, tmp_path / "repo")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    err = done.stderr
    assert "stage llm: 11 missing, 0 unexpected, 0 mis-shaped" in err  # Qwen3 layer: 11 tensors
    assert "missing     model.layers.1.input_layernorm.weight  expected [32]" in err
    assert "... and 6 more" in err  # the first 5 of each kind are listed
    assert "stage tts: 0 missing, 1 unexpected, 1 mis-shaped" in err
    assert "mis-shaped  emb_code.0.weight  expected [6562, 32] found [100, 32]" in err
    assert "unexpected  extra.weight  found [3]" in err
    assert not (tmp_path / "repo" / "llm" / "1" / "model.onnx").exists()


def test_shards_and_index_must_agree(reference, tmp_path: Path) -> None:
    folder = copy_of(reference, tmp_path)
    shutil.copy(folder / "model-00001-of-00003.safetensors", folder / "model-00004-of-00003.safetensors")
    with pytest.raises(CheckpointError, match=r"not in the index: \['model-00004-of-00003.safetensors'\]"):
        load(folder)
    (folder / "model-00004-of-00003.safetensors").unlink()
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing on disk: \['model-00002-of-00003.safetensors'\]"):
        load(folder)
    (folder / INDEX).unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        load(folder)


def test_a_stage_without_tensors_or_an_unknown_prefix_is_refused(reference, tmp_path: Path) -> None:
    folder = copy_of(reference, tmp_path)
    rewrite_shard(folder, lambda t: {("lm." + k[4:] if k.startswith("tts.") else k): v for k, v in t.items()})
    with pytest.raises(CheckpointError) as info:
        load(folder)
    assert "stage tts: 1 missing" in str(info.value) and "missing     tts.*" in str(info.value)
    assert "stage (no stage):" in str(info.value) and "unexpected  lm.emb_code.0.weight" in str(info.value)


def test_the_tokenizer_set_is_required(reference, tmp_path: Path) -> None:
    folder = copy_of(reference, tmp_path)
    (folder / "merges.txt").unlink()
    done = export(folder, tmp_path / "repo")
    assert done.returncode == 1 and "merges.txt" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.checkpoints  # .ci/run step: an export at the published dimensions
def test_export_cli_builds_the_real_preset_from_the_checkpoint(reference, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    stale = repo / "speaker_encoder" / "1" / "model.onnx"  # an older export's artefact, its config.pbtxt gone
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"onnx")
    done = export(reference.folder, repo)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (repo / "speaker_encoder").exists() and "retired speaker_encoder" in done.stdout
    assert "loaded audio_encoder, vision_encoder, llm, tts, token2wav from" in done.stdout
    assert "random weights" not in done.stdout  # every stage from the checkpoint
    assert "KV per session" in done.stdout and "memory at minicpm-o-4.5 dimensions" in done.stdout
    preset = load_stage_config(repo / "llm" / "1")
    assert preset.name == "minicpm-o-4.5" and preset.llm.hidden == 32 and preset.tokens == MINICPMO45_TOKENS
    assert preset.llm.vocab == 151_748
    for stage in ("audio_encoder", "vision_encoder", "llm", "tts"):
        assert (repo / stage / "1" / "model.onnx").exists()
    assert (repo / "audio_encoder" / "1" / "stream.onnx").exists()
    for graph in ("encoder", "estimator", "vocoder"):  # token2wav's three graphs
        assert (repo / "token2wav" / "1" / f"{graph}.onnx").exists()
    assets = reference.folder / TOKEN2WAV_ASSETS  # the checkpoint's own voice-prompt graphs and voice, as they are
    for name in VOICE_GRAPHS:
        assert (repo / "token2wav" / "1" / name).read_bytes() == (assets / name).read_bytes()
    voice = (repo / "token2wav" / "1" / DEFAULT_VOICE_WAV).read_bytes()
    assert voice == (reference.folder / DEFAULT_VOICE).read_bytes()
    for name in TOKENIZER_FILES:
        assert (repo / "duplex" / "1" / "tokenizer" / name).read_bytes() == (reference.folder / name).read_bytes()
    tok = load_tokenizer(preset, repo / "duplex" / "1")
    assert tok.encode("hi") == [71, 72]
    assert MINICPMO45_TOKENS.listen not in tok.encode("hi<|listen|>")  # caller text is text, never a control token
    assert not tok.is_text(MINICPMO45_TOKENS.listen)


def test_export_cli_errors_are_clear(tmp_path: Path) -> None:
    no_ckpt = subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5",
                              "--model-repository", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert no_ckpt.returncode == 2 and "--checkpoint" in no_ckpt.stderr
    trt = subprocess.run([sys.executable, "-m", "export", "--preset", "tiny", "--runtime", "tensorrt",
                          "--model-repository", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert trt.returncode == 2 and "GPU" in trt.stderr
    assert not any(tmp_path.iterdir()), "nothing is written when the request is refused"


@pytest.mark.checkpoints  # .ci/run step: an export at the published dimensions
def test_small_real_preset_runs_a_duplex_step(reference, tmp_path: Path) -> None:
    """The exported real-preset stages serve a step in process (HF tokenizer, 151748 vocab)."""
    import asyncio

    from minicpmo_triton.serving.inprocess import InProcessStages
    from minicpmo_triton.serving.pipeline import StepEvent, StepInput

    repo = tmp_path / "repo"
    assert export(reference.folder, repo).returncode == 0
    stages = InProcessStages(repo)
    events: list[StepEvent] = []

    async def emit(ev: StepEvent) -> None:
        events.append(ev)

    async def run() -> None:
        pipeline = stages.pipeline()
        rng = np.random.default_rng(0)
        for i in range(4):
            audio = 0.1 * rng.standard_normal(16_000).astype(np.float32)  # float PCM's scale (within +-2)
            await pipeline.step(9, i == 0, i == 3, StepInput(audio=audio), emit)

    asyncio.run(run())
    assert [e.kind for e in events[:3]] == ["listen"] * 3
    assert events[0].chunk_usage["input_text_tokens"] > 0  # the system prompt, through the HF tokenizer
    assert stages.llm_stage.live_sequences == 0
    assert json.loads(json.dumps(events[0].metrics.to_dict()))["kv_cache_length"] > 10


def test_transformers_is_a_test_time_dependency_only() -> None:
    for package in ("export", "minicpmo_triton", "gateway"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            assert "import transformers" not in text and "from transformers" not in text, path


def test_token2wav_loads_from_the_assets_as_written(reference) -> None:
    """assets/token2wav (the official classes' flow.yaml, flow.pt, hift.pt) loads back tensor for tensor, and its
    dims are read from the files, not the preset (the real preset's defaults are the published widths)."""
    from export.modules.token2wav import dims_of

    preset = minicpmo45()
    loaded = load_token2wav(reference.folder, preset.token2wav)
    assert loaded is not None
    original = reference.modules["token2wav"]
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    dims = dims_of(loaded, preset.token2wav)
    assert dims.channels == original.flow.input_embedding.weight.shape[1] != preset.token2wav.channels


@pytest.mark.parametrize(("files", "layout", "code"), [
    ([], None, None),
    (["campplus.onnx"], None, None),  # voice graphs alone: random token2wav weights
    (["flow.yaml", "flow.pt", "hift.pt", "campplus.onnx"], "1.0.5", None),
    (["flow.yaml", "flow.pt", "hift.pt", "config.yaml", "hift_original.pt"], "1.0.7", None),
    (["flow.yaml", "flow.pt", "config.yaml", "hift.pt"], None, "unsupported_token2wav"),  # no hift_original.pt
    (["flow.yaml", "flow.pt", "hift.pt", "hift_original.pt"], None, "unsupported_token2wav"),  # no config.yaml
    (["config.yaml", "hift_original.pt"], None, "unsupported_token2wav"),  # no flow
    (["flow.yaml", "hift.pt"], None, "invalid_checkpoint"),
])
def test_token2wav_layout_is_detected(tmp_path: Path, files: list[str], layout, code) -> None:
    """minicpmo-utils 1.0.5's and 1.0.7's layouts are told apart (1.0.7's streamed by its causal HiFT:
    tests/test_token2wav_1_0_7.py); a folder with part of 1.0.7's files is refused with a code and the files
    named, never streamed as the original HiFT (wrong audio)."""
    assets = tmp_path / checkpoint.TOKEN2WAV_ASSETS
    assets.mkdir(parents=True)
    for name in files:
        (assets / name).write_bytes(b"")
    if code is None:
        assert checkpoint.token2wav_layout(tmp_path) == layout
        return
    with pytest.raises(CheckpointError) as info:
        checkpoint.token2wav_layout(tmp_path)
    assert info.value.code == code
    named = [f for f in ("config.yaml", "hift_original.pt", "flow.pt") if f in str(info.value)]
    assert named, str(info.value)

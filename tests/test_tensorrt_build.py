"""The TensorRT build's choices that need no GPU: bf16, never fp16 (Qwen3 overflows fp16); profiles covering what
is served (a prefill over 256 tokens, audio over 4 s) beside the batched step; the runner's choice of profile.
The build itself runs against a stand-in `tensorrt` module that records what it is told; that a plan built so
runs, and that `TensorRTEngine.run_device` binds CUDA tensors in place, is unverified here (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from export.presets import get_preset
from minicpmo_triton.engine.exported import pick_profile
from minicpmo_triton.engine.tensorrt_build import LONG_AUDIO_S, PREFILL_TOKENS, build_engine, builder_flags, profiles

FLAGS = SimpleNamespace(BF16="BF16", FP16="FP16")


def test_the_engines_are_built_in_bf16_never_fp16() -> None:
    trt = SimpleNamespace(BuilderFlag=FLAGS)
    assert builder_flags(trt, "bf16") == ["BF16"]
    assert builder_flags(trt, "fp32") == []
    with pytest.raises(ValueError, match="fp16"):
        builder_flags(trt, "fp16")


def _ranges(profile: dict[str, Any]) -> dict[str, Any]:
    return {name: (lo, hi) for name, (lo, _, hi) in profile.items()}


@pytest.mark.parametrize("preset", ["tiny", "minicpm-o-4.5"])
def test_the_profiles_hold_what_is_served(preset: str) -> None:
    p = get_preset(preset)
    every = {stage: profiles(stage, p, 64) for stage in ("tts", "audio_encoder", "audio_encoder_stream")}
    for stage, built in every.items():
        for profile in built:
            for name, (lo, opt, hi) in profile.items():
                assert all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True)), (stage, name)
    tts = [_ranges(x) for x in every["tts"]]
    d, ctx = p.tts.decoder, p.duplex.context_tokens

    def tts_call(rows: int, new: int, past: int) -> dict[str, tuple[int, ...]]:
        kv = (d.layers, rows, d.kv_heads, past, d.head_dim)
        return {"text_ids": (rows, new), "has_hidden": (rows, new), "code_ids": (rows, new), "is_code": (rows, new),
                "position_ids": (rows, new), "llm_hidden": (rows, new, p.llm.hidden), "past_mask": (rows, past),
                "past_key": kv, "past_value": kv, "last_index": (rows,)}

    assert pick_profile(tts, tts_call(64, 11, ctx)) == 0  # a full batch's chunk conditions at the whole context
    assert pick_profile(tts, tts_call(1, 300, 0)) == 1  # a long condition: over 256 tokens
    assert pick_profile(tts, tts_call(2, PREFILL_TOKENS, ctx - PREFILL_TOKENS)) == 1
    with pytest.raises(ValueError, match="no TensorRT profile"):
        pick_profile(tts, tts_call(64, 300, 0))
    audio = [_ranges(x) for x in every["audio_encoder"]]
    assert pick_profile(audio, {"audio": (64, 16_000)}) == 0
    assert pick_profile(audio, {"audio": (1, 16_000 * 10)}) == 1  # over 4 s
    assert pick_profile(audio, {"audio": (1, 16_000 * LONG_AUDIO_S)}) == 1
    stream = [_ranges(x) for x in every["audio_encoder_stream"]]
    assert max(hi[2] for _, hi in (x["mel"] for x in stream)) >= 4 + 100 * LONG_AUDIO_S  # 30 s of 10 ms frames


class _FakeTrt:
    """What build_engine tells TensorRT, recorded."""

    BuilderFlag = FLAGS

    class MemoryPoolType:
        WORKSPACE = "workspace"

    def __init__(self) -> None:
        self.flags: list[str] = []
        self.profiles: list[dict[str, Any]] = []
        fake = self

        class Config:
            def set_memory_pool_limit(self, *_: Any) -> None: ...

            def set_flag(self, flag: str) -> None:
                fake.flags.append(flag)

            def add_optimization_profile(self, profile: Any) -> None:
                fake.profiles.append(profile.shapes)

        class Profile:
            def __init__(self) -> None:
                self.shapes: dict[str, Any] = {}

            def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
                self.shapes[name] = (lo, opt, hi)

        class Builder:
            def __init__(self, _: Any) -> None: ...

            def create_network(self, _: int) -> None: ...

            def create_builder_config(self) -> Config:
                return Config()

            def create_optimization_profile(self) -> Profile:
                return Profile()

            def build_serialized_network(self, *_: Any) -> bytes:
                return b"plan"

        class Parser:
            def __init__(self, *_: Any) -> None: ...

            def parse_from_file(self, _: str) -> bool:
                return True

        self.Logger = lambda *_: SimpleNamespace(WARNING=0)
        self.Logger.WARNING = 0  # type: ignore[attr-defined]
        self.Builder, self.OnnxParser = Builder, Parser


def test_the_build_sets_bf16_and_every_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeTrt()
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    shapes = profiles("tts", get_preset("tiny"), 64)
    build_engine(tmp_path / "model.onnx", tmp_path / "model.plan", shapes)
    assert fake.flags == ["BF16"] and "FP16" not in fake.flags
    assert fake.profiles == shapes and len(shapes) == 2
    assert (tmp_path / "model.plan").read_bytes() == b"plan"


def test_an_encoder_s_plan_is_built_once_and_kept_by_what_it_was_built_from(tmp_path: Path, monkeypatch) -> None:
    """minicpmo_triton/engine/plan_cache.py: the first load on a GPU builds the plan (TensorRT stands in here), the next
    finds it; a new graph, another TensorRT or another GPU builds another one beside it."""
    import torch

    from minicpmo_triton.engine import tensorrt_build
    from minicpmo_triton.engine.plan_cache import cached_plan

    built: list[Path] = []

    def build(onnx: Path, plan: Path, shapes: Any, precision: str = "bf16") -> None:
        built.append(plan)
        plan.write_bytes(b"plan of " + onnx.read_bytes())

    monkeypatch.setattr(tensorrt_build, "build_engine", build)
    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__version__="10.0"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    (tmp_path / "model.onnx").write_bytes(b"graph one")
    preset = get_preset("tiny")
    first = cached_plan(tmp_path, "model", "audio_encoder", preset, 64)
    assert cached_plan(tmp_path, "model", "audio_encoder", preset, 64) == first and len(built) == 1
    assert first.parent == tmp_path / "plans" and first.read_bytes() == b"plan of graph one"
    assert not list(tmp_path.glob("plans/*.partial"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA B200")
    assert cached_plan(tmp_path, "model", "audio_encoder", preset, 64) != first
    (tmp_path / "model.onnx").write_bytes(b"graph two")  # a new export
    assert cached_plan(tmp_path, "model", "audio_encoder", preset, 64) not in (first, built[1])
    assert len(built) == 3

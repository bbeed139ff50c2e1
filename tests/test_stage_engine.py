"""Where token2wav and the encoders run (`stage_engine`): `auto` puts a GPU instance on its GPU (the device path)
and a CPU instance on ONNX Runtime; a GPU given and out of reach is refused at load, with a code, never a silent
fallback to the host; the gateway's /health lists each model's device, or its refusal. The machine's probe is
faked (no GPU here): what it reports is outside the code under test."""

from __future__ import annotations

import importlib
import json
import sys
import types
from typing import Any

import pytest

from gateway.triton.devices import listing
from minicpmo_triton.engine.stage_engine import Placement, Probe, place
from minicpmo_triton.errors import Code, StepError
from minicpmo_triton.serving.stage_settings import STAGE_SETTINGS

from .conftest import MODEL_REPOSITORY, ensure_exported

GPU = Probe("GPU", 1, cuda=True, tensorrt=True)


@pytest.mark.parametrize(("choice", "probe", "plans", "want"), [
    ("auto", GPU, False, Placement("device", "cuda:1")),  # token2wav: torch on the GPU Triton gave it
    ("auto", GPU, True, Placement("device", "cuda:1")),  # an encoder: its TensorRT plan there
    ("auto", Probe("CPU", 0, cuda=True, tensorrt=True), False, Placement("onnx", "cpu")),  # a CPU instance
    ("device", Probe("CPU", 0, cuda=False, tensorrt=False), False, Placement("device", "cpu")),  # how CI runs it
    ("onnx", GPU, False, Placement("onnx", "cpu")),  # asked for
])
def test_auto_runs_a_gpu_instance_on_its_gpu_and_a_cpu_instance_on_onnx(choice: str, probe: Probe, plans: bool,
                                                                      want: Placement) -> None:
    assert place("token2wav", choice, probe, plans) == want


@pytest.mark.parametrize(("choice", "probe", "plans", "why"), [
    ("auto", Probe("GPU", 0, cuda=False, tensorrt=True), False, "torch sees no CUDA"),
    ("auto", Probe("GPU", 0, cuda=True, tensorrt=False), True, "TensorRT does not import"),
    ("device", Probe("CPU", 0, cuda=True, tensorrt=True), True, "need a GPU instance"),
])
def test_a_gpu_out_of_reach_is_refused_with_a_code(choice: str, probe: Probe, plans: bool, why: str) -> None:
    with pytest.raises(StepError, match=why) as refusal:
        place("vision_encoder", choice, probe, plans)
    assert refusal.value.code is Code.DEVICE_UNAVAILABLE
    with pytest.raises(ValueError, match="stage_engine"):
        place("token2wav", "gpu", GPU, False)


class _Chosen(Exception):
    """The device path's load, stubbed: where the model asked to run."""


def _triton_models(monkeypatch: pytest.MonkeyPatch, probe: Probe) -> Any:
    """minicpmo_triton.serving.triton_models outside Triton (its backend module is a stand-in) on a machine that reports
    `probe`."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.delitem(sys.modules, "minicpmo_triton.serving.triton_models", raising=False)
    models = importlib.import_module("minicpmo_triton.serving.triton_models")
    monkeypatch.setattr(models.Probe, "machine", classmethod(lambda cls, kind, device_id: probe))
    return models


def _args(model: str, kind: str) -> dict[str, Any]:
    params = {k: {"string_value": s.default} for k, s in STAGE_SETTINGS.items() if model in s.models}
    return {"model_config": json.dumps({"parameters": params, "max_batch_size": 64}), "model_name": model,
            "model_repository": str(MODEL_REPOSITORY / model), "model_version": "1", "model_instance_kind": kind,
            "model_instance_device_id": "0"}


def test_token2wav_on_a_gpu_instance_loads_the_device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU instance where torch sees CUDA: `auto` loads the ring-cache device path on that GPU (bf16 caches)."""
    ensure_exported()
    models = _triton_models(monkeypatch, Probe("GPU", 0, cuda=True, tensorrt=False))
    from minicpmo_triton.stages import token2wav_device

    def load(folder: Any, d: Any, device: str, slots: int, dtype: Any, threads: int) -> None:
        raise _Chosen(device, slots, dtype)

    monkeypatch.setattr(token2wav_device.DeviceStreamer, "load", staticmethod(load))
    with pytest.raises(_Chosen) as chosen:
        models.Token2WavModel().initialize(_args("token2wav", "GPU"))
    import torch

    assert chosen.value.args == ("cuda:0", 64, torch.bfloat16)


@pytest.mark.parametrize("model", ["token2wav", "vision_encoder", "audio_encoder"])
def test_a_gpu_instance_that_cannot_reach_its_gpu_refuses_to_load(monkeypatch: pytest.MonkeyPatch,
                                                                 model: str) -> None:
    """Triton gives the instance a GPU, torch sees none (a CPU build, no driver): the load fails, its reason the
    coded refusal Triton keeps for the model (what /health shows), and nothing was loaded on the CPU instead."""
    ensure_exported()
    models = _triton_models(monkeypatch, Probe("GPU", 0, cuda=False, tensorrt=False))
    cls = {"token2wav": models.Token2WavModel, "vision_encoder": models.VisionEncoderModel,
           "audio_encoder": models.AudioEncoderModel}[model]
    monkeypatch.setattr(cls, "make_stage", lambda *a: pytest.fail("a refused model loads nothing"))
    with pytest.raises(RuntimeError, match=r"^\[device_unavailable\] ") as refusal:
        cls().initialize(_args(model, "GPU"))
    assert model in str(refusal.value) and "torch sees no CUDA" in str(refusal.value)


def test_health_lists_each_model_s_device_or_why_it_did_not_load() -> None:
    page = "\n".join([
        "# HELP minicpmo_token2wav_device Where this model runs (1, labelled with the device)",
        'minicpmo_token2wav_device{device="cuda:0 (device path)"} 1',
        'minicpmo_audio_encoder_device{device="cpu (onnxruntime)"} 1',
        'minicpmo_vision_encoder_device{device="cpu (onnxruntime)"} 1',  # outlived its unloading
        'minicpmo_tts_live_sequences 3',
    ])
    index = {"models": [{"name": "token2wav", "state": "READY"}, {"name": "audio_encoder", "state": "READY"},
                        {"name": "tts", "state": "READY"}, {"name": "llm", "state": "LOADING"},
                        {"name": "vision_encoder", "version": "1", "state": "UNAVAILABLE",
                         "reason": "[device_unavailable] vision_encoder: Triton gave this instance GPU 0, ..."}]}
    assert listing(page, index) == {
        "token2wav": "cuda:0 (device path)", "audio_encoder": "cpu (onnxruntime)", "tts": "loaded", "llm": "loading",
        "vision_encoder": "not loaded: [device_unavailable] vision_encoder: Triton gave this instance GPU 0, ..."}

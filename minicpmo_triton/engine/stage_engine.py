"""Where token2wav, vision_encoder and audio_encoder run: the setting `stage_engine`, one for the three.

- `auto`: on a GPU instance (Triton gives the model a GPU: KIND_GPU, as KIND_AUTO does where it sees GPUs) the
  device path: token2wav's batched ring-cache path in torch (stages/token2wav_device.py), the encoders' TensorRT
  bf16 plans (plan_cache.py); on a CPU instance ONNX Runtime on the CPU.
- `device`: the device path on the instance's device: on a CPU instance token2wav's runs in torch on the CPU (how
  the tests and CI run it); the encoders' plans need a GPU.
- `onnx`: ONNX Runtime on the CPU, wherever the instance is.

A model that should reach its GPU and cannot (torch sees no CUDA, TensorRT is missing) refuses to load with
`device_unavailable`, which Triton keeps as the model's reason and the gateway's /health shows; it never falls
back to the host on its own. Pure: the probe of the machine is an argument (`Probe`), so a test fakes a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Code, StepError

CHOICES = ("auto", "device", "onnx")


@dataclass(frozen=True)
class Probe:
    """What the model was given and what this process can use."""

    kind: str  # Triton's instance kind: "GPU" or "CPU"
    device_id: int  # the GPU Triton gave a GPU instance
    cuda: bool  # torch sees CUDA
    tensorrt: bool  # tensorrt imports

    @classmethod
    def machine(cls, kind: str, device_id: int) -> Probe:
        return cls(kind, device_id, _cuda(), _tensorrt())


@dataclass(frozen=True)
class Placement:
    engine: str  # "device" (torch or TensorRT on `device`) or "onnx" (ONNX Runtime on the CPU)
    device: str  # "cuda:N" or "cpu"

    @property
    def label(self) -> str:
        """What /health lists for the model."""
        return f"{self.device} ({'onnxruntime' if self.engine == 'onnx' else 'device path'})"


def place(model: str, choice: str, probe: Probe, plans: bool) -> Placement:
    """The placement of `model` under `stage_engine` = `choice`; `plans`: its device path is TensorRT plans (the
    encoders), not torch (token2wav). Raises StepError(device_unavailable) where a GPU is due and out of reach."""
    if choice not in CHOICES:
        raise ValueError(f"stage_engine must be one of {', '.join(CHOICES)}, not {choice!r}")
    gpu = probe.kind == "GPU"
    if choice == "onnx" or (choice == "auto" and not gpu):
        return Placement("onnx", "cpu")
    if not gpu and not plans:
        return Placement("device", "cpu")  # `device` on a CPU instance: token2wav's torch path on the CPU
    if not gpu:
        raise StepError(Code.DEVICE_UNAVAILABLE, f"{model}: stage_engine=device runs TensorRT plans, which need a GPU "
                                                 "instance (this one is KIND_CPU); set stage_engine=onnx for the CPU")
    if not probe.cuda:
        raise StepError(Code.DEVICE_UNAVAILABLE, f"{model}: Triton gave this instance GPU {probe.device_id}, but torch "
                                                 "sees no CUDA (a CPU build of torch, or no driver): not loading on "
                                                 "the CPU instead; install CUDA torch, or set stage_engine=onnx")
    if plans and not probe.tensorrt:
        raise StepError(Code.DEVICE_UNAVAILABLE, f"{model}: runs TensorRT plans on GPU {probe.device_id}, and TensorRT "
                                                 "does not import: pip install 'minicpmo-triton[gpu]', or set "
                                                 "stage_engine=onnx")
    return Placement("device", f"cuda:{probe.device_id}")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401 (only whether it imports)
    except ImportError:
        return False
    return True

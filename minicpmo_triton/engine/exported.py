"""Run an exported stage: ONNX Runtime on CPU, or a TensorRT engine when one was built and a GPU exists."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Engine(Protocol):
    name: str
    input_names: list[str]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class OnnxEngine:
    name = "onnxruntime"

    def __init__(self, path: Path, threads: int = 1) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]
        self.input_names = [i.name for i in self._session.get_inputs()]
        # The CPU arena gives back what a run no longer uses when it ends: one long prefill (its attention
        # grows as the square of its length) no longer keeps its peak for the life of the process (an 8000-token
        # prefill of `tiny` left the stub at 3.3 GB; with this, 0.17 GB; small steps ran no slower).
        self._run_options = ort.RunOptions()
        self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._outputs, self._session.run(self._outputs, feeds, self._run_options), strict=True))


Ranges = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # input -> (min shape, max shape)


def pick_profile(profiles: list[Ranges], shapes: dict[str, tuple[int, ...]]) -> int:
    """The first optimisation profile whose ranges hold every input's shape (`tensorrt_build.py` builds the
    batched step's first, then long inputs at a few rows)."""
    for index, ranges in enumerate(profiles):
        if all(all(lo <= n <= hi for n, lo, hi in zip(shape, *ranges[name], strict=True))
               for name, shape in shapes.items()):
            return index
    raise ValueError(f"no TensorRT profile holds these shapes: {shapes}")


class TensorRTEngine:
    """A serialized TensorRT plan with its optimisation profiles. `run_device` binds torch CUDA tensors in and
    out by their addresses (`set_tensor_address`): a caller whose state lives on the GPU moves nothing through
    the host. `run` is the numpy `Engine` face over it (one upload, one download)."""

    name = "tensorrt"

    def __init__(self, path: Path) -> None:
        import tensorrt as trt
        import torch

        self._torch = torch
        self._trt = trt
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = runtime.deserialize_cuda_engine(Path(path).read_bytes())
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self._inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.input_names = self._inputs
        self._profiles: list[Ranges] = []
        for index in range(self._engine.num_optimization_profiles):
            self._profiles.append({n: _min_max(self._engine.get_tensor_profile_shape(n, index)) for n in self._inputs})
        self._profile = 0

    def run_device(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """Inputs and outputs as torch CUDA tensors, bound in place; returns on the engine's stream, synchronized."""
        torch = self._torch
        shapes = {name: tuple(feeds[name].shape) for name in self._inputs}
        profile = pick_profile(self._profiles, shapes)
        if profile != self._profile:
            self._context.set_optimization_profile_async(profile, self._stream.cuda_stream)
            self._profile = profile
        keep = []
        for name in self._inputs:
            tensor = feeds[name].contiguous()
            if tensor.device.type != "cuda":
                raise ValueError(f"{name}: run_device binds CUDA tensors, not {tensor.device} ones")
            keep.append(tensor)
            self._context.set_input_shape(name, shapes[name])
            self._context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in self._outputs:
            shape = tuple(self._context.get_tensor_shape(name))
            dtype = torch.from_numpy(np.zeros(0, self._trt.nptype(self._engine.get_tensor_dtype(name)))).dtype
            out = torch.empty(shape, dtype=dtype, device=keep[0].device if keep else "cuda")
            self._context.set_tensor_address(name, out.data_ptr())
            outputs[name] = out
        self._stream.wait_stream(torch.cuda.current_stream())  # the inputs were written on the caller's stream
        if not self._context.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        self._stream.synchronize()
        return outputs

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        device = {n: torch.from_numpy(np.ascontiguousarray(feeds[n])).cuda() for n in self._inputs}
        return {name: t.cpu().numpy() for name, t in self.run_device(device).items()}


def _min_max(shapes: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`get_tensor_profile_shape`'s (min, opt, max) -> (min, max)."""
    lo, _, hi = shapes
    return tuple(lo), tuple(hi)


def gpu_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def load_engine(folder: Path, threads: int = 1, name: str = "model") -> Engine:
    """`name`.plan (TensorRT, where a GPU is) or `name`.onnx in a stage's version folder."""
    folder = Path(folder)
    plan, onnx = folder / f"{name}.plan", folder / f"{name}.onnx"
    if plan.exists() and gpu_available():
        return TensorRTEngine(plan)
    if not onnx.exists():
        raise FileNotFoundError(f"{onnx} is missing: run `python -m export --preset tiny` first")
    return OnnxEngine(onnx, threads)

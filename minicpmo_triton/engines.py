"""Run an exported stage: ONNX Runtime on CPU, or a TensorRT engine when one was built and a GPU exists."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

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


class TensorRTEngine:
    """A serialized TensorRT plan with one optimisation profile; I/O through torch CUDA tensors."""

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

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        keep = []
        for name in self._inputs:
            tensor = torch.from_numpy(np.ascontiguousarray(feeds[name])).cuda()
            keep.append(tensor)
            self._context.set_input_shape(name, tuple(tensor.shape))
            self._context.set_tensor_address(name, tensor.data_ptr())
        outputs = {}
        for name in self._outputs:
            shape = tuple(self._context.get_tensor_shape(name))
            dtype = torch.from_numpy(np.zeros(0, self._trt.nptype(self._engine.get_tensor_dtype(name)))).dtype
            out = torch.empty(shape, dtype=dtype, device="cuda")
            self._context.set_tensor_address(name, out.data_ptr())
            outputs[name] = out
        if not self._context.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        self._stream.synchronize()
        return {name: t.cpu().numpy() for name, t in outputs.items()}


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

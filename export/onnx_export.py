"""Export one stage graph to ONNX and check ONNX Runtime against PyTorch on fresh random inputs."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .stages import StageGraph


@dataclass(frozen=True)
class ParityResult:
    stage: str
    max_abs_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


class ParityError(RuntimeError):
    pass


def export_onnx(graph: StageGraph, path: Path, seed: int = 0) -> None:
    inputs = graph.make_inputs(torch.Generator().manual_seed(seed))
    graph.module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    # The exporter is chatty (warnings, a per-graph report); keep the progress bar readable.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if graph.dynamo:
            torch.onnx.export(
                graph.module,
                args=(),
                kwargs=inputs,
                f=str(path),
                input_names=list(inputs),
                output_names=graph.output_names,
                dynamic_shapes={name: graph.dynamic_shapes.get(name, {}) for name in inputs},
                dynamo=True,
                external_data=True,  # weights beside the graph: real stages pass ONNX's 2 GB limit
                verbose=False,
            )
        else:
            torch.onnx.export(graph.module, args=tuple(inputs.values()), f=str(path), input_names=list(inputs),
                              output_names=graph.output_names, dynamic_axes=graph.dynamic_shapes, dynamo=False,
                              opset_version=17)
    graph.module.eval()  # the exporter restores the mode it found on the top module only, to all submodules


def check_parity(graph: StageGraph, path: Path, seed: int = 1) -> ParityResult:
    import onnxruntime as ort

    inputs = graph.make_inputs(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = graph.module(**inputs)
    if isinstance(expected, torch.Tensor):
        expected = (expected,)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(graph.output_names, {k: v.numpy() for k, v in inputs.items()})
    diff = max(float(np.abs(g - e.numpy()).max()) for g, e in zip(got, expected, strict=True))
    return ParityResult(graph.name, diff, graph.tolerance)

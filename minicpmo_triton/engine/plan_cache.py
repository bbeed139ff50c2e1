"""TensorRT plans of a stage's ONNX graph, built where the model first loads on a GPU (or by the export, where it
runs on one) and kept on disk by what they were built from: the graph's bytes (the .onnx and its external data),
the profiles, TensorRT's version and the GPU's name. A restart finds its plan and loads it; a new export, another
TensorRT or another GPU builds a new one beside it (`plans/<graph>-<key>.plan` in the model's version folder).

The build is tensorrt_build.py's (bf16, the stage's profiles; the export's too): imported only here, only on a GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..model_config import PresetConfig

PLANS = "plans"


def plan_key(onnx: Path, shapes: list[Any], tensorrt_version: str, gpu: str) -> str:
    digest = hashlib.sha256()
    for part in (onnx, onnx.with_name(onnx.name + ".data")):
        if part.exists():
            with part.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    digest.update(json.dumps([shapes, tensorrt_version, gpu], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def plan_path(folder: Path, graph: str, key: str) -> Path:
    return folder / PLANS / f"{graph}-{key}.plan"


def cached_plan(folder: Path, graph: str, stage: str, preset: PresetConfig, max_batch: int) -> Path:
    """`folder`/`graph`.onnx's plan for this GPU and TensorRT: the one on disk, else built now (written under a
    temporary name and renamed, so an interrupted build leaves nothing a later load would take)."""
    import tensorrt as trt
    import torch

    from .tensorrt_build import build_engine, profiles

    shapes = profiles(stage, preset, max_batch)
    onnx = folder / f"{graph}.onnx"
    path = plan_path(folder, graph, plan_key(onnx, shapes, trt.__version__, torch.cuda.get_device_name()))
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        build_engine(onnx, partial, shapes)
        partial.replace(path)
    return path

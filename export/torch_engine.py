"""A stage's PyTorch module behind the same Engine interface as ONNX Runtime: the demo-shaped baseline."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import cast

import numpy as np
import torch

from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.stages.audio_encoder import GraphStreamKv
from minicpmo_triton.stages.kv import HostKv
from minicpmo_triton.stages.token2wav_stream import Token2WavStreamer

from .presets import TINY_SEED, tiny
from .stages import build_modules, stage_graphs


class TorchEngine:
    name = "pytorch"

    def __init__(self, module: torch.nn.Module, output_names: list[str]) -> None:
        self.module = module.eval()
        self.input_names = list(inspect.signature(module.forward).parameters)  # fed by name
        self.output_names = output_names

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            out = self.module(**{k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()})
        out = (out,) if isinstance(out, torch.Tensor) else out
        return {name: t.numpy() for name, t in zip(self.output_names, out, strict=True)}


def torch_stages(repository: Path, seed: int = TINY_SEED) -> InProcessStages:
    """The tiny stages with every engine swapped for its PyTorch module (same weights as the export)."""
    stages = InProcessStages(repository)
    graphs = {g.name: g for g in stage_graphs(tiny(), build_modules(tiny(), seed))}
    stages.encoder.engine = TorchEngine(graphs["audio_encoder"].module, graphs["audio_encoder"].output_names)
    cast(GraphStreamKv, stages.stream_encoder.kv).engine = TorchEngine(graphs["audio_encoder_stream"].module,
                                                                      graphs["audio_encoder_stream"].output_names)
    cast(HostKv, stages.llm_stage.kv).engine = TorchEngine(graphs["llm"].module, graphs["llm"].output_names)
    cast(HostKv, stages.tts_stage.kv).engine = TorchEngine(graphs["tts"].module, graphs["tts"].output_names)
    streamer = stages.t2w_stage.streamer  # token2wav's three graphs (its voice-prompt graphs stay ONNX: not per step)
    assert isinstance(streamer, Token2WavStreamer), "the in-process stages run the host path"
    streamer.enc, streamer.est, streamer.voc = (TorchEngine(graphs[f"token2wav_{g}"].module,
                                                            graphs[f"token2wav_{g}"].output_names)
                                                for g in ("encoder", "estimator", "vocoder"))
    return stages

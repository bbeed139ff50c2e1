"""The official Step-Audio2 token2wav modules (PyPI `minicpmo-utils`) the export builds from.

They are imported without the package's CUDA-only `__init__` (`minicpmo_triton.official_stepaudio2`, shared
with the token2wav stage, which runs 1.0.7's causal vocoder from the same package).
`flow.yaml` (the checkpoint's, tags `cosyvoice2.*`) is read with hyperpyyaml, its tags mapped onto them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minicpmo_triton.official_stepaudio2 import PACKAGE, load_tagged_yaml, stepaudio2_module

__all__ = ["FLOW_TAGS", "flow_class", "hift_class", "load_flow_yaml", "stepaudio2_module"]

# flow.yaml's class tags -> the modules that hold them in minicpmo-utils
FLOW_TAGS = {
    "cosyvoice2.flow.flow.CausalMaskedDiffWithXvec": "stepaudio2.cosyvoice2.flow.flow",
    "cosyvoice2.flow.flow_matching.CausalConditionalCFM": "stepaudio2.cosyvoice2.flow.flow_matching",
    "cosyvoice2.flow.decoder_dit.DiT": "stepaudio2.cosyvoice2.flow.decoder_dit",
    "cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2":
        "stepaudio2.cosyvoice2.transformer.upsample_encoder_v2",
}


def flow_class(tag: str) -> Any:
    module, _, cls = tag.rpartition(".")
    return getattr(stepaudio2_module(FLOW_TAGS[tag].removeprefix(PACKAGE + ".")), cls)


def load_flow_yaml(path: Path) -> Any:
    """The `flow` object of a checkpoint's flow.yaml (CausalMaskedDiffWithXvec), weights not loaded."""
    tags = {tag: f"{module}:{tag.rpartition('.')[2]}" for tag, module in FLOW_TAGS.items()}
    return load_tagged_yaml(Path(path).read_text(), tags)["flow"]


def hift_class() -> tuple[Any, Any]:
    """(HiFTGenerator, ConvRNNF0Predictor): the original (non-causal) HiFT of hift.pt."""
    hifigan = stepaudio2_module("flashcosyvoice.modules.hifigan")
    return hifigan.HiFTGenerator, hifigan.ConvRNNF0Predictor

"""The official Step-Audio2 token2wav modules (PyPI `minicpmo-utils`), imported without their package `__init__`.

`stepaudio2/__init__.py` imports its `Token2wav` class, which imports torchaudio (no build loads with
torch 2.13 here). The modules we need (flow, flow matching, DiT, conformer, HiFT) do not: we register
the `stepaudio2` package with its `__path__` but without running its `__init__`, then import them.
`flow.yaml` (the checkpoint's, tags `cosyvoice2.*`) is read with hyperpyyaml, its tags mapped onto them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

PACKAGE = "stepaudio2"
# flow.yaml's class tags -> the modules that hold them in minicpmo-utils
FLOW_TAGS = {
    "cosyvoice2.flow.flow.CausalMaskedDiffWithXvec": "stepaudio2.cosyvoice2.flow.flow",
    "cosyvoice2.flow.flow_matching.CausalConditionalCFM": "stepaudio2.cosyvoice2.flow.flow_matching",
    "cosyvoice2.flow.decoder_dit.DiT": "stepaudio2.cosyvoice2.flow.decoder_dit",
    "cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2":
        "stepaudio2.cosyvoice2.transformer.upsample_encoder_v2",
}


def stepaudio2_module(name: str) -> types.ModuleType:
    """`stepaudio2.<name>` imported with the top package registered but its `__init__` not run."""
    if PACKAGE not in sys.modules:
        spec = importlib.util.find_spec(PACKAGE)  # finds the folder; executes nothing
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("minicpmo-utils is not installed (pip install --no-deps minicpmo-utils==1.0.7)")
        package = types.ModuleType(PACKAGE)
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules[PACKAGE] = package
    return importlib.import_module(f"{PACKAGE}.{name}")


def flow_class(tag: str) -> Any:
    module, _, cls = tag.rpartition(".")
    return getattr(stepaudio2_module(FLOW_TAGS[tag].removeprefix(PACKAGE + ".")), cls)


def load_flow_yaml(path: Path) -> Any:
    """The `flow` object of a checkpoint's flow.yaml (CausalMaskedDiffWithXvec), weights not loaded."""
    import yaml
    from hyperpyyaml import load_hyperpyyaml

    root = yaml.compose(Path(path).read_text())

    def localize(node: yaml.Node) -> None:
        for prefix in ("!new:", "!name:"):
            tag = node.tag.removeprefix(prefix)
            if node.tag.startswith(prefix) and tag in FLOW_TAGS:
                flow_class(tag)  # imported, so hyperpyyaml finds it under its module path
                node.tag = f"{prefix}{FLOW_TAGS[tag]}.{tag.rpartition('.')[2]}"
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                localize(key)
                localize(value)
        elif isinstance(node, yaml.SequenceNode):
            for value in node.value:
                localize(value)

    localize(root)
    return load_hyperpyyaml(yaml.serialize(root))["flow"]


def hift_class() -> tuple[Any, Any]:
    """(HiFTGenerator, ConvRNNF0Predictor): the original (non-causal) HiFT of hift.pt."""
    hifigan = stepaudio2_module("flashcosyvoice.modules.hifigan")
    return hifigan.HiFTGenerator, hifigan.ConvRNNF0Predictor

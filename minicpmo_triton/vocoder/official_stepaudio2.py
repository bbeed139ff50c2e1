"""The official Step-Audio2 modules (PyPI `minicpmo-utils`), imported without their package `__init__`.

`stepaudio2/__init__.py` imports its `Token2wav` class, which imports torchaudio (no build loads with
torch 2.13 here). The modules we need (flow, HiFT, the causal vocoder) do not: we register the `stepaudio2`
package with its `__path__` but without running its `__init__`, then import them. A checkpoint's yaml files
(flow.yaml, config.yaml) name their classes by upstream tags (`cosyvoice2.*`, `cosyvoice.*`); `load_tagged_yaml`
maps those tags onto the package's modules and reads the file with hyperpyyaml, as its token2wav.py
`_load_config` does. The export and the token2wav stage (1.0.7's causal vocoder, run in torch) both use this.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

PACKAGE = "stepaudio2"


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


def load_tagged_yaml(text: str, tags: dict[str, str], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A yaml file whose `!new:` / `!name:` tags in `tags` (upstream tag -> "module:object", the module under
    `stepaudio2`, or a full module path when it does not start with `stepaudio2.`) are re-pointed before
    hyperpyyaml builds it. `overrides`: top-level keys replaced (`overrides_must_match=False`, as the package's
    `_load_config` passes them)."""
    import yaml
    from hyperpyyaml import load_hyperpyyaml

    root = yaml.compose(text)

    def localize(node: yaml.Node) -> None:
        for prefix in ("!new:", "!name:"):
            tag = node.tag.removeprefix(prefix)
            if node.tag.startswith(prefix) and tag in tags:
                module, _, name = tags[tag].partition(":")
                if module.startswith(PACKAGE + "."):
                    stepaudio2_module(module.removeprefix(PACKAGE + "."))  # registered, so hyperpyyaml finds it
                node.tag = f"{prefix}{module}.{name}"
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                localize(key)
                localize(value)
        elif isinstance(node, yaml.SequenceNode):
            for value in node.value:
                localize(value)

    localize(root)
    return load_hyperpyyaml(yaml.serialize(root), overrides=overrides or {}, overrides_must_match=False)


# flow.yaml's class tags -> the modules that hold them in minicpmo-utils
FLOW_TAGS = {
    "cosyvoice2.flow.flow.CausalMaskedDiffWithXvec": "stepaudio2.cosyvoice2.flow.flow",
    "cosyvoice2.flow.flow_matching.CausalConditionalCFM": "stepaudio2.cosyvoice2.flow.flow_matching",
    "cosyvoice2.flow.decoder_dit.DiT": "stepaudio2.cosyvoice2.flow.decoder_dit",
    "cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2":
        "stepaudio2.cosyvoice2.transformer.upsample_encoder_v2",
}


def load_flow_yaml(path: Path) -> Any:
    """The `flow` object of a checkpoint's flow.yaml (CausalMaskedDiffWithXvec), weights not loaded."""
    tags = {tag: f"{module}:{tag.rpartition('.')[2]}" for tag, module in FLOW_TAGS.items()}
    return load_tagged_yaml(Path(path).read_text(encoding="utf-8"), tags)["flow"]


def hift_class() -> tuple[Any, Any]:
    """(HiFTGenerator, ConvRNNF0Predictor): the original (non-causal) HiFT of hift.pt."""
    hifigan = stepaudio2_module("flashcosyvoice.modules.hifigan")
    return hifigan.HiFTGenerator, hifigan.ConvRNNF0Predictor

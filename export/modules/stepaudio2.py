"""The official Step-Audio2 token2wav modules (PyPI `minicpmo-utils`) the export builds from.

They are imported without the package's CUDA-only `__init__` (`minicpmo_triton.vocoder.official_stepaudio2`, shared
with the token2wav stage, which runs 1.0.7's causal vocoder from the same package).
`flow.yaml` (the checkpoint's, tags `cosyvoice2.*`) is read with hyperpyyaml, its tags mapped onto them.
"""

from __future__ import annotations

from typing import Any

from minicpmo_triton.vocoder.official_stepaudio2 import (
    FLOW_TAGS,
    PACKAGE,
    hift_class,
    load_flow_yaml,
    stepaudio2_module,
)

__all__ = ["FLOW_TAGS", "flow_class", "hift_class", "load_flow_yaml", "stepaudio2_module"]


def flow_class(tag: str) -> Any:
    module, _, cls = tag.rpartition(".")
    return getattr(stepaudio2_module(FLOW_TAGS[tag].removeprefix(PACKAGE + ".")), cls)

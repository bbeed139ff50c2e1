"""MiniCPM-o 4.5's own code and tokenizer files (OpenBMB/MiniCPM-o-Demo `MiniCPMO45/`), imported as a package to
run in tests.

They are vendored, unchanged, under tests/reference_code/ (its README names the commit): CI reaches package
registries only. One shim: `modeling_navit_siglip` imports `transformers.modeling_attn_mask_utils`, which
transformers 5 removed; only the vision tower calls it.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from types import ModuleType

REFERENCE_CODE = Path(__file__).parent / "reference_code"
COMMIT = "28b60cf"  # the revision the tests cite (tests/reference_code/README.md)


def demo_source(path: str) -> bytes:
    """A vendored file of the demo repository (e.g. `MiniCPMO45/vocab.json`)."""
    return (REFERENCE_CODE / path).read_bytes()


def demo_module(name: str) -> ModuleType:
    """`MiniCPMO45.<name>`, the demo's own module."""
    if "transformers.modeling_attn_mask_utils" not in sys.modules:
        try:
            importlib.import_module("transformers.modeling_attn_mask_utils")
        except ModuleNotFoundError:
            shim = types.ModuleType("transformers.modeling_attn_mask_utils")
            shim._prepare_4d_attention_mask = None  # type: ignore[attr-defined]
            sys.modules[shim.__name__] = shim
    if str(REFERENCE_CODE) not in sys.path:
        sys.path.insert(0, str(REFERENCE_CODE))
    return importlib.import_module(f"MiniCPMO45.{name}")

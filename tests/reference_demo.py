"""MiniCPM-o 4.5's own model code (OpenBMB/MiniCPM-o-Demo `MiniCPMO45/`), imported as a package to run in tests.

The demo repository is mirrored as a bare git repository; its `MiniCPMO45/*.py` are written to a cache folder
and imported as the package `MiniCPMO45`, unchanged. One shim: `modeling_navit_siglip` imports
`transformers.modeling_attn_mask_utils`, which transformers 5 removed; only the vision tower calls it.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path
from types import ModuleType

DEMO = Path("/work/.mirror/OpenBMB+MiniCPM-o-Demo/repo")
COMMIT = "28b60cf"  # the revision the tests cite


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(DEMO), *args], check=True, capture_output=True).stdout


def demo_source(path: str) -> bytes:
    """A file of the demo repository at COMMIT (e.g. `MiniCPMO45/vocab.json`)."""
    assert DEMO.exists(), f"the reference demo repository is not mirrored at {DEMO}"
    return _git("show", f"{COMMIT}:{path}")


def demo_module(name: str, cache: Path = Path("/tmp/minicpmo-demo-src")) -> ModuleType:
    """`MiniCPMO45.<name>` from the demo's own source at COMMIT."""
    assert DEMO.exists(), f"the reference demo repository is not mirrored at {DEMO}"
    package = cache / COMMIT / "MiniCPMO45"
    if not (package / "modeling_minicpmo_unified.py").exists():
        package.mkdir(parents=True, exist_ok=True)
        for path in _git("ls-tree", "--name-only", COMMIT, "MiniCPMO45/").decode().split():
            if path.endswith(".py"):
                (package / Path(path).name).write_bytes(demo_source(path))
    if "transformers.modeling_attn_mask_utils" not in sys.modules:
        try:
            importlib.import_module("transformers.modeling_attn_mask_utils")
        except ModuleNotFoundError:
            shim = types.ModuleType("transformers.modeling_attn_mask_utils")
            shim._prepare_4d_attention_mask = None  # type: ignore[attr-defined]
            sys.modules[shim.__name__] = shim
    if str(package.parent) not in sys.path:
        sys.path.insert(0, str(package.parent))
    return importlib.import_module(f"MiniCPMO45.{name}")

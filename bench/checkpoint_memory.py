"""Peak memory of exporting the real preset from a checkpoint folder.

`python -m bench.checkpoint_memory --checkpoint DIR` prints two figures:
- the peak RSS of `python -m export --preset minicpm-o-4.5 --checkpoint DIR` (a child process, into a
  temporary model repository): everything the export holds, torch and the ONNX export included;
- the loader's own share: how far RSS rises above the built modules while `load_checkpoint` fills them
  (Linux: the peak is reset through /proc/self/clear_refs just before loading).

A folder to try it on: `python -c "from pathlib import Path; from tests.reference_checkpoint import
write_checkpoint; write_checkpoint(Path('/tmp/ref'))"` (the reference checkpoint the tests build).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from export.__main__ import REPO_ROOT


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def export_peak_mib(checkpoint: Path) -> float:
    with tempfile.TemporaryDirectory() as repo:
        subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5", "--checkpoint", str(checkpoint),
                        "--model-repository", repo], cwd=REPO_ROOT, check=True, capture_output=True)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def loader_peak_mib(checkpoint: Path) -> float:
    from export.checkpoint import load_checkpoint, read_config
    from export.config import preset_from_config
    from export.presets import get_preset
    from export.stages import build_modules

    preset = preset_from_config(get_preset("minicpm-o-4.5"), read_config(checkpoint))
    modules = build_modules(preset, 0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    load_checkpoint(checkpoint, modules, preset)
    return (_status_kib("VmHWM") - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    args = parser.parse_args()
    print(f"export peak RSS: {export_peak_mib(args.checkpoint):.1f} MiB")
    print(f"load_checkpoint above the built modules: {loader_peak_mib(args.checkpoint):.1f} MiB")


if __name__ == "__main__":
    main()

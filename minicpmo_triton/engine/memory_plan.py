"""The device's memory as one plan: the KV pools' bytes after every stage's weights and working memory, whatever
order the models load in (no torch here: the plan is arithmetic over the model repository's files and the settings).

    pools' budget = the device's memory - every stage's weights - every stage's workspace - a margin
    a pool       = its setting's share of that budget (`kv_pool_size` 0.5: half), or its setting in GB (> 1)

Every model that builds a pool (the llm model: the LLM's, the streaming Whisper's and, with `tts_in_llm`, the TTS's;
else the tts model: the TTS's) makes the same plan from the same files, so its share does not depend on what loaded
before it (the pools were once a fraction of the memory free at each model's own load). Weights are read from the
repository: a device stage's `weights.safetensors` at the device's width (its header's shapes), token2wav's
`device_modules/` files, an encoder's ONNX graph at bf16 (its TensorRT plan). Workspaces are declared here per stage
(`workspace`): the largest iteration's activations and logits, the graphs' private pools, a CUDA context per process.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from ..model_config import DecoderDims, PresetConfig

GIB = 2**30
CPU_MEMORY = 8 * GIB  # what a CPU "device" counts as (its pools are only ever tests' and benches')
MARGIN = 0.05  # of the device's memory, left to the allocator's fragmentation and what no stage declares
CUDA_CONTEXT = 512 << 20  # each stage's process holds a CUDA context, cuBLAS's workspace, the allocator's slack
POOLS = {"kv": "kv_pool_size", "audio": "audio_pool_size", "tts": "tts_pool_size"}  # pool -> its setting
PREFILL_TOKENS = 2048  # a core's prefill budget per iteration (build.core_over)
WHISPER_FRAMES = 100  # a row's mel frames per iteration (1 s)
BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "BOOL": 1}


class PlanError(ValueError):
    """The stages leave the pools no room on this device: the load fails, saying so."""


@dataclass(frozen=True)
class StageMemory:
    """A stage's share of the device, in bytes: what it loads and what it works in."""

    name: str
    weights: int
    workspace: int


@dataclass(frozen=True)
class MemoryPlan:
    total: int  # the device's memory
    stages: tuple[StageMemory, ...]  # by name
    margin: int
    pools: dict[str, int]  # pool (POOLS) -> bytes

    @property
    def budget(self) -> int:
        """What the pools share: the memory less every stage's weights and workspace and the margin."""
        return self.total - self.margin - sum(s.weights + s.workspace for s in self.stages)

    def lines(self) -> list[str]:
        """The plan as the load's log prints it, in MiB."""
        mib = lambda n: f"{n / 2**20:,.0f}"  # noqa: E731
        out = [f"memory plan: {mib(self.total)} MiB on the device, {mib(self.margin)} MiB margin, "
               f"{mib(self.budget)} MiB for the pools"]
        out += [f"  {s.name:16s} weights {mib(s.weights):>9s}  workspace {mib(s.workspace):>9s}" for s in self.stages]
        out += [f"  pool {p:11s} {mib(b):>9s}" for p, b in self.pools.items()]
        return out


def plan_pools(total: int, stages: list[StageMemory], sizes: dict[str, float], margin: float = MARGIN) -> MemoryPlan:
    """`sizes`: each pool's setting, a share of the budget (<= 1) or GB (> 1, taken first: an explicit override).
    Raises PlanError when a pool with a share would get nothing."""
    ordered = tuple(sorted(stages, key=lambda s: s.name))
    fixed = {p: int(size * GIB) for p, size in sizes.items() if size > 1}
    plan = MemoryPlan(total, ordered, int(margin * total), {})
    left = plan.budget - sum(fixed.values())
    shared = {p: size for p, size in sizes.items() if p not in fixed}
    if shared and left <= 0:
        why = (f"the stages leave the KV pools no room ({left / GIB:.2f} GiB left after the pools set in GB): set the "
               "pools in GB, or give the stages a larger device")
        raise PlanError("\n".join([why, *plan.lines()]))
    pools = {p: fixed.get(p, int(shared.get(p, 0.0) * left)) for p in sizes}
    return MemoryPlan(total, ordered, plan.margin, pools)


def safetensors_bytes(path: Path, width: int | None = None) -> int:
    """A safetensors file's tensors' bytes, at `width` bytes an element (the device's dtype) or as stored; read from
    its header alone."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(math.prod(t["shape"]) * (width or BYTES[t["dtype"]])
               for name, t in header.items() if name != "__metadata__")


def _files_bytes(paths: list[Path], scale: float = 1.0) -> int:
    return int(sum(p.stat().st_size for p in paths if p.exists()) * scale)


def decoder_workspace(dims: DecoderDims, rows: int, width: int) -> int:
    """A decoder core's largest iteration: `rows` decode rows and a full prefill budget of activations (the
    residual, attention and MLP's widest tensors), the rows' logits in fp32 twice (raw and ruled), doubled for the
    CUDA graphs' private pools."""
    tokens = rows + PREFILL_TOKENS
    activations = tokens * (4 * dims.hidden + 3 * dims.intermediate) * width
    logits = 2 * rows * dims.vocab * 4
    return 2 * (activations + logits)


def repository_stages(repository: Path, preset: PresetConfig, on_device: set[str], rows: int, width: int,
                      cuda: bool, tts_in_llm: bool = False) -> list[StageMemory]:
    """The stages of `repository` that `on_device` names (llm, whisper, tts, token2wav, audio_encoder,
    vision_encoder), with their weights at `width` bytes an element and their declared workspaces (a CUDA context
    per process on a GPU: the Whisper runs in the llm model's, the TTS in its own or, `tts_in_llm`, the llm's)."""
    context = CUDA_CONTEXT if cuda else 0
    a = preset.audio
    known: dict[str, tuple[int, int]] = {
        "llm": (safetensors_bytes(repository / "llm/1/weights.safetensors", width),
                decoder_workspace(preset.llm, rows, width) + context),
        "whisper": (safetensors_bytes(repository / "audio_encoder/1/weights.safetensors", width),
                    rows * WHISPER_FRAMES * (4 * a.d_model + a.ffn) * 4),
        "tts": (safetensors_bytes(repository / "tts/1/weights.safetensors", width),
                decoder_workspace(preset.tts.decoder, rows, width) + (0 if tts_in_llm else context)),
        "token2wav": (_files_bytes(sorted((repository / "token2wav/1/device_modules").glob("*.pt"))), context),
        "audio_encoder": (_files_bytes([repository / "audio_encoder/1/model.onnx",
                                        repository / "audio_encoder/1/model.onnx.data"], width / 4), context),
        "vision_encoder": (_files_bytes([repository / "vision_encoder/1/model.onnx",
                                         repository / "vision_encoder/1/model.onnx.data"], width / 4), context),
    }
    return [StageMemory(name, *known[name]) for name in sorted(on_device)]

"""Read a MiniCPM-o checkpoint folder as published: config.json, sharded *.safetensors named by
model.safetensors.index.json, and the tokenizer's files.

Each stage claims its tensors by prefix and renames them to its module's state-dict names with the
`state_from_checkpoint` beside its module (`export/modules/<stage>.py`); `STAGE_CHECKPOINTS` is the one
table a stage is registered in. Every problem is collected first, from the shards' headers alone, and
raised as one `CheckpointError` whose text says, per stage, which tensors are missing, unexpected or
mis-shaped. Tensors are read lazily, one stage at a time (`CheckpointTensors`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from minicpmo_triton.model_config import PresetConfig, Token2WavDims
from minicpmo_triton.stages.token2wav import DEFAULT_VOICE_WAV

from .modules import audio_encoder, llm, tts, vision
from .tensor_names import CheckpointCode, CheckpointError, Tensors

if TYPE_CHECKING:
    from .modules.token2wav import Token2WavModel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json")
TOKEN2WAV_ASSETS = Path("assets") / "token2wav"  # flow.yaml, flow.pt, hift.pt and the voice-prompt graphs
VOICE_GRAPHS = ("campplus.onnx", "speech_tokenizer_v2_25hz.onnx")
DEFAULT_VOICE = Path("assets") / "system_ref_audio.wav"  # MiniCPM-o 4.5's own reference voice
SHOWN = 5  # names listed per kind of problem; the counts are always whole


@dataclass(frozen=True)
class StageCheckpoint:
    """How one stage finds its tensors: the name prefixes it owns, the renaming to its module's names."""

    prefixes: tuple[str, ...]
    state_from_checkpoint: Callable[[Tensors, PresetConfig], Tensors]


STAGE_CHECKPOINTS: dict[str, StageCheckpoint] = {
    "audio_encoder": StageCheckpoint(audio_encoder.PREFIXES, audio_encoder.state_from_checkpoint),
    "vision_encoder": StageCheckpoint(vision.PREFIXES, vision.state_from_checkpoint),
    "llm": StageCheckpoint(llm.PREFIXES, llm.state_from_checkpoint),
    "tts": StageCheckpoint(tts.PREFIXES, tts.state_from_checkpoint),
}
REQUIRED_STAGES = ("audio_encoder", "vision_encoder", "llm", "tts")  # what the published file holds


@dataclass
class StageProblems:
    """One stage's mismatches: (name, shape) missing or unexpected, (name, expected, found) mis-shaped."""

    stage: str
    missing: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    unexpected: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    misshaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.misshaped)

    def lines(self) -> list[str]:
        out = [f"stage {self.stage}: {len(self.missing)} missing, {len(self.unexpected)} unexpected, "
               f"{len(self.misshaped)} mis-shaped (module names; see docs/checkpoint.md for the mapping)"]
        out += [f"  missing     {n}  expected {list(s)}" for n, s in self.missing[:SHOWN]]
        out += [f"  unexpected  {n}  found {list(s)}" for n, s in self.unexpected[:SHOWN]]
        out += [f"  mis-shaped  {n}  expected {list(e)} found {list(f)}" for n, e, f in self.misshaped[:SHOWN]]
        hidden = max(0, len(self.missing) - SHOWN) + max(0, len(self.unexpected) - SHOWN) + max(
            0, len(self.misshaped) - SHOWN)
        if hidden:
            out.append(f"  ... and {hidden} more")
        return out


def _sorted_shapes(d: dict[str, tuple[int, ...]]) -> list[tuple[str, tuple[int, ...]]]:
    return sorted(d.items())


def compare_state(stage: str, module: nn.Module, state: Tensors) -> StageProblems:
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items()}
    return StageProblems(
        stage,
        missing=_sorted_shapes({k: s for k, s in expected.items() if k not in found}),
        unexpected=_sorted_shapes({k: s for k, s in found.items() if k not in expected}),
        misshaped=sorted((k, expected[k], found[k]) for k in expected.keys() & found.keys()
                         if expected[k] != found[k]),
    )


def checkpoint_files(folder: Path) -> list[Path]:
    """The shards the index names (each must exist, none may be left out of it), or the one model.safetensors."""
    folder = Path(folder)
    present = sorted(p.name for p in folder.glob("*.safetensors"))
    index = folder / INDEX_FILE
    if not index.exists():
        if present == [SINGLE_FILE]:
            return [folder / SINGLE_FILE]
        raise CheckpointError(f"{folder}: no {INDEX_FILE} (found {present or 'no *.safetensors'}); a sharded "
                              f"checkpoint names its shards in the index, a single file is {SINGLE_FILE}")
    weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    named = sorted(set(weight_map.values()))
    absent = [n for n in named if n not in present]
    stray = [n for n in present if n not in named]
    if absent or stray:
        raise CheckpointError(f"{folder}: {INDEX_FILE} names {len(named)} shards; missing on disk: "
                              f"{absent or 'none'}; on disk but not in the index: {stray or 'none'}")
    return [folder / n for n in named]


# safetensors' dtype names (the headers) -> torch's, for the shape-only stand-ins the report is computed on
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its shard's header describes it: no data."""

    shard: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...


class CheckpointTensors:
    """The checkpoint's tensors by name, read lazily. Opening reads only the shards' headers (names, shapes,
    dtypes) and checks them against the index; `read` reads the named tensors' data (safetensors maps the
    shard and copies out each tensor asked for), `meta` makes data-free stand-ins of the right shapes."""

    def __init__(self, folder: Path) -> None:
        files = checkpoint_files(folder)
        index = Path(folder) / INDEX_FILE
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"] if index.exists() else None
        self.info: dict[str, TensorInfo] = {}
        for path in files:
            with safe_open(str(path), "pt") as f:
                for name in f.keys():  # safe_open is not a mapping
                    if weight_map is not None and weight_map.get(name) != path.name:
                        raise CheckpointError(f"{path.name} holds {name}, which {INDEX_FILE} puts in "
                                              f"{weight_map.get(name, 'no shard')}")
                    header = f.get_slice(name)
                    self.info[name] = TensorInfo(path, tuple(header.get_shape()), header.get_dtype())
        if weight_map is not None and (lost := sorted(weight_map.keys() - self.info.keys())):
            raise CheckpointError(f"{INDEX_FILE} names {len(lost)} tensors no shard holds, e.g. {lost[:SHOWN]}")
        if unknown := sorted({i.dtype for i in self.info.values()} - DTYPES.keys()):
            raise CheckpointError(f"{folder}: tensors of dtypes {unknown}, which the loader does not know")

    def names(self, prefixes: tuple[str, ...]) -> list[str]:
        return [n for n in self.info if n.startswith(prefixes)]

    def meta(self, names: list[str]) -> Tensors:
        """Shape-only stand-ins (the meta device): a stage's renaming runs on them to check it without data."""
        return {n: torch.empty(self.info[n].shape, dtype=DTYPES[self.info[n].dtype], device="meta") for n in names}

    def read(self, names: list[str]) -> Tensors:
        """The named tensors' data, each shard opened once."""
        tensors: Tensors = {}
        for shard in sorted({self.info[n].shard for n in names}):
            with safe_open(str(shard), "pt") as f:
                tensors |= {n: f.get_tensor(n) for n in names if self.info[n].shard == shard}
        return tensors


def load_checkpoint(folder: Path, modules: dict[str, nn.Module], preset: PresetConfig,
                    require: tuple[str, ...] = REQUIRED_STAGES) -> list[str]:
    """Load every registered stage whose tensors are present (those in `require` must be); returns them.

    Nothing is loaded unless everything fits: every stage is checked first, from the shards' headers alone
    (its renaming run on shape-only stand-ins), and a mismatch anywhere raises one report for all stages.
    Then one stage at a time: its tensors are read, renamed, copied into its module and released before the
    next stage's are read, so at most one stage's tensors are in memory beside the modules.
    """
    shards = CheckpointTensors(folder)
    claimed: set[str] = set()
    parts: dict[str, list[str]] = {}
    problems: list[StageProblems] = []
    for stage, spec in STAGE_CHECKPOINTS.items():
        names = shards.names(spec.prefixes)
        claimed |= set(names)
        if not names:
            if stage in require:
                problems.append(StageProblems(stage, missing=[(f"{'|'.join(spec.prefixes)}*", ())]))
            continue
        parts[stage] = names
        found = compare_state(stage, modules[stage], spec.state_from_checkpoint(shards.meta(names), preset))
        if found:
            problems.append(found)
    stray = {n: i.shape for n, i in shards.info.items() if n not in claimed}
    if stray:
        problems.append(StageProblems("(no stage)", unexpected=_sorted_shapes(stray)))
    if problems:
        raise CheckpointError("\n".join([f"{folder} does not fit preset {preset.name}:",
                                         *(line for p in problems for line in p.lines())]))
    for stage, names in parts.items():
        state = STAGE_CHECKPOINTS[stage].state_from_checkpoint(shards.read(names), preset)
        modules[stage].load_state_dict(state, strict=True)
        del state  # this stage's tensors go before the next stage's are read
    return list(parts)


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path} is missing: the model's dimensions come from it")
    return json.loads(path.read_text(encoding="utf-8"))


def require_tokenizer(folder: Path) -> None:
    """The checkpoint's whole tokenizer set is there: checked before any weight is read, so a folder without it
    fails in a second, not after the load."""
    missing = [n for n in TOKENIZER_FILES if not (Path(folder) / n).exists()]
    if missing:
        raise CheckpointError(f"{folder} lacks tokenizer files {missing}: the real preset uses the checkpoint's "
                              f"own tokenizer ({', '.join(TOKENIZER_FILES)})")


def copy_tokenizer(folder: Path, target: Path) -> None:
    """The checkpoint's whole tokenizer set, beside the entry model."""
    require_tokenizer(folder)
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(Path(folder) / name, target / name)


# minicpmo-utils 1.0.5's token2wav: the original HiFT in hift.pt, streamed as token2wav_stream does
TOKEN2WAV_FILES = ("flow.yaml", "flow.pt", "hift.pt")
# minicpmo-utils 1.0.7's: a causal HiFT (config.yaml + hift.pt) for streams, the original in hift_original.pt, and
# a stream cache seeded with the prompt's first 3 tokens (its token2wav.py `Token2wav.set_stream_cache`)
TOKEN2WAV_1_0_7_FILES = ("config.yaml", "hift_original.pt")


def token2wav_layout(folder: Path) -> str | None:
    """Which release's layout the checkpoint's assets/token2wav holds: "1.0.5", "1.0.7", or None when it has none.
    A folder with some of 1.0.7's files but not all is refused (`unsupported_token2wav`): streaming its hift.pt
    as the original HiFT would be wrong audio, not an error."""
    assets = Path(folder) / TOKEN2WAV_ASSETS
    present = sorted(p.name for p in assets.iterdir()) if assets.is_dir() else []
    newer = [f for f in TOKEN2WAV_1_0_7_FILES if f in present]
    if newer and len(newer) < len(TOKEN2WAV_1_0_7_FILES):
        raise CheckpointError(
            f"{assets} holds {', '.join(newer)} but not {', '.join(set(TOKEN2WAV_1_0_7_FILES) - set(newer))}: "
            f"neither minicpmo-utils 1.0.5's token2wav layout ({', '.join(TOKEN2WAV_FILES)}, the original HiFT in "
            f"hift.pt) nor 1.0.7's (those + {', '.join(TOKEN2WAV_1_0_7_FILES)}: a causal HiFT in config.yaml + "
            f"hift.pt, the original in hift_original.pt)", CheckpointCode.UNSUPPORTED_TOKEN2WAV)
    if not any(f in present for f in TOKEN2WAV_FILES):
        if newer:
            raise CheckpointError(f"{assets} holds {', '.join(newer)} without {', '.join(TOKEN2WAV_FILES)}",
                                  CheckpointCode.UNSUPPORTED_TOKEN2WAV)
        return None
    if missing := [f for f in TOKEN2WAV_FILES if f not in present]:
        raise CheckpointError(f"{assets} lacks {', '.join(missing)} of token2wav's {', '.join(TOKEN2WAV_FILES)}")
    return "1.0.7" if newer else "1.0.5"


def load_token2wav(folder: Path, d: Token2WavDims) -> Token2WavModel | None:
    """The checkpoint's assets/token2wav as the official modules (flow.yaml, flow.pt and the original HiFT: hift.pt
    in 1.0.5's layout, hift_original.pt in 1.0.7's, whose causal HiFT is checked to load); None if absent."""
    from .modules.token2wav import Token2WavModel

    layout = token2wav_layout(folder)
    if layout is None:
        return None
    assets = Path(folder) / TOKEN2WAV_ASSETS
    if layout == "1.0.7":
        from minicpmo_triton.vocoder.causal_vocoder import load_causal_hift

        try:
            load_causal_hift(assets)
        except (ValueError, TypeError, RuntimeError) as exc:  # mis-shaped weights, wrong class or mel settings
            raise CheckpointError(f"{assets}: its causal vocoder (config.yaml + hift.pt) does not load: {exc}") \
                from exc
        return Token2WavModel.load(assets, d, hift_file="hift_original.pt")
    return Token2WavModel.load(assets, d)


def copy_causal_vocoder(folder: Path | None, target: Path) -> bool:
    """1.0.7's causal vocoder (config.yaml + hift.pt) into token2wav's folder, where the stage finds it; a stale
    copy goes when the checkpoint has 1.0.5's layout or none. Returns whether it was copied."""
    from minicpmo_triton.vocoder.causal_vocoder import FILES, FOLDER

    shutil.rmtree(Path(target) / FOLDER, ignore_errors=True)
    if folder is None or token2wav_layout(folder) != "1.0.7":
        return False
    (Path(target) / FOLDER).mkdir(parents=True)
    for name in FILES:
        shutil.copy2(Path(folder) / TOKEN2WAV_ASSETS / name, Path(target) / FOLDER / name)
    return True


def copy_voice_assets(folder: Path, target: Path) -> list[str]:
    """The checkpoint's CAM++ and S3 tokenizer graphs and its reference voice into token2wav's folder.
    Returns the graphs copied (the export writes stand-ins for the others)."""
    folder, copied = Path(folder), []
    target.mkdir(parents=True, exist_ok=True)
    for name in VOICE_GRAPHS:
        if (folder / TOKEN2WAV_ASSETS / name).exists():
            shutil.copy2(folder / TOKEN2WAV_ASSETS / name, target / name)
            copied.append(name)
    if (folder / DEFAULT_VOICE).exists():
        shutil.copy2(folder / DEFAULT_VOICE, target / DEFAULT_VOICE_WAV)
    return copied

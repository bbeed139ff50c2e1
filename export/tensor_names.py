"""What each stage's `read_config` / `state_from_checkpoint` (beside its module) composes: config keys
to dims, and checkpoint tensor names to the module's state-dict names."""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

import torch

Tensors = dict[str, torch.Tensor]
if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance")


class CheckpointCode(StrEnum):
    """Why an export refused a checkpoint (`CheckpointError.code`; the export prints it before the report)."""

    INVALID_CHECKPOINT = "invalid_checkpoint"  # missing, unexpected or mis-shaped files or tensors
    UNSUPPORTED_TOKEN2WAV = "unsupported_token2wav"  # an assets/token2wav layout this build cannot stream


class CheckpointError(ValueError):
    """A checkpoint folder (or its config) that cannot become the preset's modules; the text is the report."""

    def __init__(self, message: str, code: CheckpointCode = CheckpointCode.INVALID_CHECKPOINT) -> None:
        super().__init__(message)
        self.code = CheckpointCode(code)



def strip_prefix(tensors: Tensors, prefix: str) -> Tensors:
    """`llm.model.norm.weight` -> `model.norm.weight` (every name must carry the prefix)."""
    return {name.removeprefix(prefix): value for name, value in tensors.items()}


def fold_weight_norm(tensors: Tensors) -> Tensors:
    """torch's weight norm folded into a plain `weight`: `w = g * v / ||v||` (norm over all but dim 0).

    New style (`torch.nn.utils.parametrizations.weight_norm`): `<m>.parametrizations.weight.original0`
    (g) and `.original1` (v). Old style (`torch.nn.utils.weight_norm`): `<m>.weight_g`, `<m>.weight_v`.
    """
    out = dict(tensors)
    for g_suffix, v_suffix in ((".parametrizations.weight.original0", ".parametrizations.weight.original1"),
                               (".weight_g", ".weight_v")):
        for key in [k for k in out if k.endswith(v_suffix)]:
            base = key[: -len(v_suffix)]
            if f"{base}{g_suffix}" not in out:
                continue  # reported as missing/unexpected by the loader
            v, g = out.pop(key), out.pop(f"{base}{g_suffix}")
            out[f"{base}.weight"] = g * v / v.norm(dim=tuple(range(1, v.dim())), keepdim=True)
    return out


def read_dims(dims: D, section: dict, keys: dict[str, str]) -> D:
    """`dims` with each field named in `keys` taken from `section[keys[field]]` where the config has it."""
    return dataclasses.replace(dims, **{f: section[k] for f, k in keys.items() if k in section})

"""Where a stage's per-session arrays live: host numpy (`HostArrays`, no torch needed) or torch tensors on a device
(`DeviceArrays`: on a GPU they stay in its memory and are updated there), behind the few operations token2wav's
flow caches use. An engine call goes through `run`: a TensorRT engine binds device tensors in place
(`TensorRTEngine.run_device`, no host round trip); any other engine gets numpy and its outputs are moved back to
the arrays' place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .engines import Engine

Array = Any  # np.ndarray or torch.Tensor, as the `Arrays` that made it


class Arrays(Protocol):
    device: str

    def zeros(self, shape: Sequence[int]) -> Array: ...
    def asarray(self, a: np.ndarray) -> Array: ...
    def host(self, a: Array) -> np.ndarray: ...
    def stack(self, parts: Sequence[Array], axis: int = 0) -> Array: ...
    def cat(self, parts: Sequence[Array], axis: int) -> Array: ...
    def take(self, a: Array, index: np.ndarray, axis: int) -> Array: ...
    def copy(self, a: Array) -> Array: ...
    def run(self, engine: Engine, feeds: dict[str, Array]) -> dict[str, Array]: ...


class HostArrays:
    """numpy float32 on the host: what the stages ran before, unchanged."""

    device = "cpu"

    def zeros(self, shape: Sequence[int]) -> np.ndarray:
        return np.zeros(tuple(shape), np.float32)

    def asarray(self, a: np.ndarray) -> np.ndarray:
        return a

    def host(self, a: np.ndarray) -> np.ndarray:
        return a

    def stack(self, parts: Sequence[np.ndarray], axis: int = 0) -> np.ndarray:
        return np.stack(parts, axis)

    def cat(self, parts: Sequence[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(parts, axis)

    def take(self, a: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
        return np.take(a, index, axis=axis)

    def copy(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def run(self, engine: Engine, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return engine.run(feeds)


class DeviceArrays:
    """torch tensors on `device` (float32 caches; index feeds int64)."""

    def __init__(self, device: str) -> None:
        import torch

        self._torch = torch
        self.device = device

    def zeros(self, shape: Sequence[int]) -> Any:
        return self._torch.zeros(tuple(shape), dtype=self._torch.float32, device=self.device)

    def asarray(self, a: np.ndarray) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def host(self, a: Any) -> np.ndarray:
        return a.detach().cpu().numpy()

    def stack(self, parts: Sequence[Any], axis: int = 0) -> Any:
        return self._torch.stack(list(parts), axis)

    def cat(self, parts: Sequence[Any], axis: int) -> Any:
        return self._torch.cat(list(parts), axis)

    def take(self, a: Any, index: np.ndarray, axis: int) -> Any:
        return a.index_select(axis, self._torch.as_tensor(index, dtype=self._torch.int64, device=a.device))

    def copy(self, a: Any) -> Any:
        return a.clone()

    def run(self, engine: Engine, feeds: dict[str, Any]) -> dict[str, Any]:
        tensors = {k: v if isinstance(v, self._torch.Tensor) else self.asarray(np.asarray(v)) for k, v in feeds.items()}
        run_device = getattr(engine, "run_device", None)
        if run_device is not None and self.device.startswith("cuda"):
            return run_device(tensors)
        out = engine.run({k: self.host(v) for k, v in tensors.items()})
        return {k: self.asarray(np.asarray(v)) for k, v in out.items()}


HOST = HostArrays()


def arrays_for(device: str) -> Arrays:
    """`cpu`: host numpy (no torch); anything else: torch tensors there."""
    return HOST if device == "cpu" else DeviceArrays(device)

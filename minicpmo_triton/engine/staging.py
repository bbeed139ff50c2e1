"""Host -> device in one copy: what changed this iteration is written into one pinned staging buffer, then copied
with one non-blocking copy, and scattered on the device into the persistent buffers it changes.

Nothing here makes the host wait for the device: the copy is from pinned memory (on CUDA) and asynchronous; the
scatters are `index_copy_` with index tensors that came with it. Two host buffers alternate, so the host writes
the next iteration's changes while the previous copy may still be queued; an event per buffer says when its copy
has run (by then it has: each iteration waits for its own download, which the stream runs after the copy).

`DeviceWrites` queues writes into persistent device tensors (rows of a batch buffer, entries of a pool's block
tables and maps) and applies them all at the next `flush`; `Staging.put` stages a one-off input (a prefill's ids
and embeddings) and hands back its device view after that flush.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .traffic import Traffic

ALIGN = 16


@dataclass
class Staged:
    """Where a staged array will be in the device buffer after the flush."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty(0, dtype=self.dtype).element_size()


class Staging:
    def __init__(self, device: torch.device, traffic: Traffic, capacity: int = 1 << 20) -> None:
        self.device = device
        self.traffic = traffic
        self.pinned = device.type == "cuda"
        self._host = [self._host_buffer(capacity) for _ in range(2)]
        self._views = [h.numpy() for h in self._host]  # made once: the copy writes through them
        self._events: list[Any] = [None, None]
        self._turn = 0
        self._used = 0
        self._staged: list[tuple[Staged, np.ndarray]] = []
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device)  # the device side

    def _host_buffer(self, capacity: int) -> torch.Tensor:
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pinned)

    def put(self, array: np.ndarray) -> Staged:
        """Stage `array` for the next flush; its device view is `view(handle)` after it."""
        array = np.ascontiguousarray(array)
        dtype = _TORCH.get(array.dtype) or torch.from_numpy(array[:0].copy()).dtype
        handle = Staged(self._used, dtype, tuple(array.shape))
        self._used += -(-max(handle.nbytes, 1) // ALIGN) * ALIGN
        self._staged.append((handle, array))
        return handle

    @property
    def pending(self) -> bool:
        return bool(self._staged)

    def copy(self) -> None:
        """One non-blocking copy of everything staged since the last one. Only `DeviceWrites.flush` calls it: the
        writes it queued name places in this copy, and are applied with it."""
        if not self._staged:
            return
        used = self._used
        host = self._host[self._turn]
        if self._events[self._turn] is not None:
            self._events[self._turn].synchronize()  # its copy of two flushes ago has run (it has: see above)
        if used > host.numel():
            host = self._host[self._turn] = self._host_buffer(max(used, 2 * host.numel()))
            self._views[self._turn] = host.numpy()
        if used > self.buffer.numel():
            self.buffer = torch.empty(max(used, 2 * self.buffer.numel()), dtype=torch.uint8, device=self.device)
        view = self._views[self._turn]
        for handle, array in self._staged:
            view[handle.offset: handle.offset + handle.nbytes] = array.reshape(-1).view(np.uint8)
        self.buffer[:used].copy_(host[:used], non_blocking=self.pinned)
        if self.pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[self._turn] = event
        self.traffic.to_device["inputs"] += used
        self._turn ^= 1
        self._staged, self._used = [], 0

    def view(self, handle: Staged) -> torch.Tensor:
        """The staged array on the device (valid until the next copy)."""
        raw = self.buffer[handle.offset: handle.offset + handle.nbytes]
        return raw.view(handle.dtype).view(handle.shape)


class DeviceWrites:
    """Writes into persistent device tensors, queued on the host and applied at the next flush, in order."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self._queued: list[tuple[torch.Tensor, Staged, Staged]] = []

    def rows(self, target: torch.Tensor, index: np.ndarray | list[int], values: np.ndarray) -> None:
        """target[index[i]] = values[i] along dim 0 (values' dtype made the target's)."""
        values = np.asarray(values).astype(_numpy_dtype(target.dtype), copy=False)
        index = np.asarray(index, np.int64)
        self._queued.append((target, self.staging.put(index), self.staging.put(values.reshape(len(index),
                                                                                               *target.shape[1:]))))

    @property
    def pending(self) -> bool:
        return bool(self._queued)

    def flush(self) -> None:
        """The one copy, and the queued writes applied from it (a staged input's view is valid until the next)."""
        self.staging.copy()
        for target, index, values in self._queued:
            target.index_copy_(0, self.staging.view(index), self.staging.view(values))
        self._queued = []


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32,
          torch.bool: np.bool_, torch.int8: np.int8, torch.uint8: np.uint8}


_TORCH = {np.dtype(n): t for t, n in _NUMPY.items()}  # a staged array's device dtype, made without a tensor


def _numpy_dtype(dtype: torch.dtype) -> Any:
    if dtype not in _NUMPY:  # bf16 rows (a prefill's embeddings into a bf16 buffer) are staged as fp32 and cast
        raise TypeError(f"no host dtype for {dtype}")
    return _NUMPY[dtype]

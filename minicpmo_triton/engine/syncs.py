"""A ledger of the operations that would make the host wait for a CUDA stream, counted on any device.

On a GPU the host runs ahead of the device only while nothing makes it wait: each of these drains the stream
(or, for an upload from a Python object, copies pageable memory synchronously). Counted at two levels:
- dispatch (`TorchDispatchMode`): `nonzero`, `item` (`_local_scalar_dense`: `int()`, `float()`, `bool()` of a
  tensor), indexing or index-writes with a boolean mask, `masked_select` / `masked_scatter`, `repeat_interleave`
  with tensor repeats, `unique`, a tensor made from Python data (`lift_fresh`: `torch.tensor`, `as_tensor`), a
  copy from the host into a device tensor that is not pinned;
- Python (`TorchFunctionMode`): `.cpu()`, `.numpy()`, `.tolist()`, `.item()` (a download), which on a CPU tensor
  dispatch nothing.
So a CPU run counts what a GPU run would wait for, and a decode iteration of the engine core is held to one: the
download of the chosen ids (tests/test_engine_core.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {"nonzero", "_local_scalar_dense", "masked_select", "masked_scatter", "_unique2", "unique_dim",
           "unique_consecutive", "lift_fresh", "argwhere", "nonzero_static_unbounded"}
_DOWNLOADS = {"cpu", "numpy", "tolist", "item"}


def _name(func: Any) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or [])


class _Dispatch(TorchDispatchMode):
    supports_higher_order_operators = True  # flex_attention: counted by the ops it runs

    def __init__(self, ledger: SyncLedger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name in _ALWAYS:
            self.ledger.count(name)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args[1]):
            self.ledger.count(f"{name}[bool]")
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) > 1 \
                and isinstance(args[1], torch.Tensor):
            self.ledger.count("repeat_interleave[tensor]")
        elif name in ("copy_", "_to_copy"):
            src = args[1] if name == "copy_" else args[0]
            dst_device = args[0].device if name == "copy_" else kwargs.get("device", src.device)
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and torch.device(dst_device).type != "cpu" \
                    and not src.is_pinned():
                self.ledger.count("upload[pageable]")
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, ledger: SyncLedger) -> None:
        super().__init__()
        self.ledger = ledger

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _DOWNLOADS and args and isinstance(args[0], torch.Tensor):
            self.ledger.count(f"download.{name}")
        return func(*args, **(kwargs or {}))


class SyncLedger:
    """`with SyncLedger() as ledger: ...` then `ledger.total` / `ledger.counts` (by operation)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._modes: list[Any] = []

    def count(self, what: str) -> None:
        self.counts[what] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> SyncLedger:
        self._modes = [_Function(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

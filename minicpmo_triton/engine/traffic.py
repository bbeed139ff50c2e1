"""Two ledgers: the bytes that cross between host and device (`Traffic`), and the work a forward executed
(`Work`: FLOPs, weight bytes read, KV bytes read and written).

Traffic is counted by kind, so a step's bill says what it moved: `state` (KV caches), `logits`, `inputs` (ids,
embeddings, positions, sampling settings) and `outputs` (token ids, the hidden rows the TTS needs). Both
paths are counted the same way: the engine core's one staging copy and one download per iteration, and for the
host-cache path every feed and output of an `Engine.run` (what a device engine fed from the host would copy each
call). On the CPU nothing really crosses; the count is what would on a GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..model_config import DecoderDims

if TYPE_CHECKING:
    from .exported import Engine

KINDS = ("state", "logits", "inputs", "outputs")
STATE_NAMES = {"past_key", "past_value", "past_mask", "present_key", "present_value"}


@dataclass
class Traffic:
    to_device: Counter[str] = field(default_factory=Counter)
    to_host: Counter[str] = field(default_factory=Counter)

    def total(self) -> int:
        return sum(self.to_device.values()) + sum(self.to_host.values())

    def by_kind(self) -> dict[str, int]:
        return {k: self.to_device[k] + self.to_host[k] for k in KINDS}

    def reset(self) -> None:
        self.to_device.clear()
        self.to_host.clear()


class CountingEngine:
    """Today's engines, counted: every feed goes to the device and every output comes back, each run."""

    def __init__(self, engine: Engine, traffic: Traffic) -> None:
        self.engine = engine
        self.traffic = traffic
        self.name = engine.name
        self.input_names = getattr(engine, "input_names", [])

    @staticmethod
    def _kind(name: str, inbound: bool) -> str:
        if name in STATE_NAMES:
            return "state"
        if name == "logits":
            return "logits"
        return "inputs" if inbound else "outputs"

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, value in feeds.items():
            self.traffic.to_device[self._kind(name, True)] += np.asarray(value).nbytes
        out = self.engine.run(feeds)
        for name, value in out.items():
            self.traffic.to_host[self._kind(name, False)] += np.asarray(value).nbytes
        return out


def _matmul_weights(d: DecoderDims) -> int:
    """One layer's matmul weights: q, k, v, o, gate, up, down."""
    return d.hidden * (2 * d.heads * d.head_dim + 2 * d.kv_heads * d.head_dim) + 3 * d.hidden * d.intermediate


def layer_flops_per_token(d: DecoderDims) -> int:
    """The matmuls of one token through every layer, 2 FLOPs a multiply-add."""
    return 2 * d.layers * _matmul_weights(d)


def layer_weight_count(d: DecoderDims) -> int:
    """Every layer's weights (the matmuls, two norms, q/k norms) and the final norm."""
    return d.layers * (_matmul_weights(d) + 2 * d.hidden + 2 * d.head_dim) + d.hidden


@dataclass
class Work:
    """What forwards executed: counted from shapes, so a shape-only model (no math) is billed the same."""

    flops: float = 0.0
    weight_bytes: float = 0.0
    kv_read: float = 0.0
    kv_written: float = 0.0
    forwards: int = 0

    def count_forward(self, d: DecoderDims, past: np.ndarray, count: np.ndarray, weight_bytes: int,
                      kv_token_bytes: int) -> None:
        """One packed forward (rows at `past` bringing `count` new tokens each): every layer's weights read once for
        the whole batch, each row's keys and values read once (its queries share them), the new tokens' written
        once."""
        past, count = np.asarray(past, np.int64), np.asarray(count, np.int64)
        n = int(count.sum())
        seen = int((count * past + count * (count + 1) // 2).sum())
        self.flops += n * layer_flops_per_token(d) + 4 * d.layers * d.heads * d.head_dim * seen
        self.weight_bytes += weight_bytes
        self.kv_read += int((past + count).sum()) * kv_token_bytes
        self.kv_written += n * kv_token_bytes
        self.forwards += 1

    def count_head(self, d: DecoderDims, rows: int, weight_bytes: int) -> None:
        self.flops += 2 * rows * d.hidden * d.vocab
        self.weight_bytes += weight_bytes

    def reset(self) -> None:
        self.flops = self.weight_bytes = self.kv_read = self.kv_written = 0.0
        self.forwards = 0

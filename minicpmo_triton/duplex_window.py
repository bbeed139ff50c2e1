"""The duplex session's sliding window, as MiniCPM-o 4.5's `StreamDecoder` keeps it (pure code on a KV cache).

OpenBMB/MiniCPM-o-Demo `MiniCPMO45/utils.py`: `DuplexWindowConfig`, `register_unit_start` / `register_unit_end`,
`enforce_window` and `drop_tokens_from_cache`. Mode `basic`: after a unit is closed (its terminator and </unit>
fed), if the cache holds more than `high` tokens, the oldest units are dropped until it holds at most `low`;
the system prompt (everything before the first <unit>) is kept, and the kept units' keys are re-rotated to
their new positions, so positions never pass `high` plus one unit. Mode `off`: the session ends at the
context's end (`context_full`), as the demo's service does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kv_batch import KvCache

WINDOW_MODES = ("off", "basic")  # LlmRequest.window_mode: the index in this tuple


@dataclass(frozen=True)
class WindowConfig:
    mode: str = "off"
    high: int = 8000  # DuplexWindowConfig.basic_window_high_tokens
    low: int = 6000  # basic_window_low_tokens


@dataclass
class UnitLedger:
    """Where the session's units lie in its cache (StreamDecoder's `_unit_history` lengths)."""

    preserve: int | None = None  # the system prompt's length (`_system_preserve_length`); None before a unit
    units: list[int] = field(default_factory=list)  # closed units' lengths, oldest first
    open_start: int = 0  # where the unit being filled began
    events: int = 0  # windows slid (`_sliding_event_count`)
    dropped: int = 0  # tokens dropped so far (`_total_dropped_tokens`, the `_position_offset`)

    def start(self, at: int) -> None:
        """`register_system_prompt`: the session's first <unit> is at cache index `at`; all before it is kept."""
        if self.preserve is None:
            self.preserve = self.open_start = at

    def close(self, end: int) -> None:
        """`register_unit_end`: the open unit ends at cache index `end` (after its </unit>)."""
        if self.preserve is not None and end > self.open_start:
            self.units.append(end - self.open_start)
        self.open_start = end

    def plan_basic(self, length: int, config: WindowConfig) -> int:
        """`enforce_window` (utils.py:1434-1477): how many tokens after the system prompt to drop from a cache of
        `length`. The unit just closed is never dropped (its last tokens are not yet in the cache here; the
        demo's thresholds leave thousands of tokens between them, so it never comes to that)."""
        if self.preserve is None or length <= config.high:
            return 0
        drop = 0
        while length - drop > config.low and len(self.units) > 1:
            drop += self.units.pop(0)
        if drop:
            self.events += 1
            self.dropped += drop
            self.open_start -= drop
        return drop

    def truncate(self, length: int) -> None:
        """The cache was cut to `length` (a rollback): the units past it are forgotten, the rest reopens."""
        if self.preserve is None:
            return
        if length <= self.preserve:
            self.preserve, self.units, self.open_start = None, [], 0
            return
        end = self.preserve
        kept = []
        for n in self.units:
            if end + n > length:
                break
            kept.append(n)
            end += n
        self.units, self.open_start = kept, end


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _cos_sin(head_dim: int, positions: np.ndarray, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """utils.py `get_rotary_cos_sin`: float32 angles, [cos, cos] / [sin, sin] along the head dimension."""
    inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).astype(np.float32)
    angles = np.einsum("i,j->ij", positions.astype(np.float32), inv_freq).astype(np.float32)
    return np.concatenate([np.cos(angles)] * 2, -1), np.concatenate([np.sin(angles)] * 2, -1)


def realign_rope(keys: np.ndarray, old_start: int, new_start: int, theta: float) -> np.ndarray:
    """utils.py `realign_rotary_suffix`: keys [..., n, head_dim] encoded at old_start.. re-encoded at new_start.."""
    n, d = keys.shape[-2], keys.shape[-1]
    cos_old, sin_old = _cos_sin(d, np.arange(old_start, old_start + n), theta)
    base = cos_old * keys - sin_old * _rotate_half(keys)
    cos_new, sin_new = _cos_sin(d, np.arange(new_start, new_start + n), theta)
    return (cos_new * base + sin_new * _rotate_half(base)).astype(np.float32)


def drop_tokens(cache: KvCache, preserve: int, length: int, theta: float) -> KvCache:
    """utils.py `drop_tokens_from_cache`: [preserve, preserve + length) out, the suffix moved up to `preserve`."""
    k, v = cache.key, cache.value
    suffix = realign_rope(k[:, :, preserve + length:], preserve + length, preserve, theta)
    return KvCache(np.concatenate([k[:, :, :preserve], suffix], axis=2),
                   np.concatenate([v[:, :, :preserve], v[:, :, preserve + length:]], axis=2))

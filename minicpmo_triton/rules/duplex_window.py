"""The duplex session's sliding window, as MiniCPM-o 4.5's `StreamDecoder` keeps it (pure code on a KV cache).

OpenBMB/MiniCPM-o-Demo `MiniCPMO45/utils.py`: `DuplexWindowConfig`, `register_unit_start` / `register_unit_end`,
`enforce_window` and `drop_tokens_from_cache`. Mode `basic`: after a unit is closed (its terminator and </unit>
fed), if the cache holds more than `high` tokens, the oldest units are dropped until it holds at most `low`;
the system prompt (everything before the first <unit>) is kept, and the kept units' keys are re-rotated to
their new positions, so positions never pass `high` plus one unit. Mode `context`
(`register_system_prompt_with_context`, `enforce_window_with_context`, `_update_previous`,
`_rebuild_cache_with_previous`, utils.py:1479-1944): once more than `max_units` units are held, the oldest go
one by one; what each said (a unit that ended listening says nothing; special tokens left out) is appended to a
"previous" text, `"\n\nprevious: "` + at most the last `previous_max` tokens, that sits inside the system prompt
between its prefix and its closing suffix (`<|audio_end|><|im_end|>`); previous + suffix are fed again after the
prefix each time, the kept units re-rotated after them. Mode `off`: the session ends at the context's end
(`context_full`), as the demo's service does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WINDOW_MODES = ("off", "basic", "context")  # LlmRequest.window_mode: the index in this tuple
PREVIOUS_MARKER = "\n\nprevious: "  # DuplexCapability.prepare's `context_previous_marker` default


@dataclass(frozen=True)
class WindowConfig:
    mode: str = "off"
    high: int = 8000  # DuplexWindowConfig.basic_window_high_tokens
    low: int = 6000  # basic_window_low_tokens
    max_units: int = 24  # context_max_units
    previous_max: int = 500  # context_previous_max_tokens
    marker: tuple[int, ...] = ()  # PREVIOUS_MARKER's tokens (`_previous_marker_token_ids`)


@dataclass(frozen=True)
class Slide:
    """One rewrite of a session's cache: [0, keep) stays, [keep, keep + drop) goes, `insert` is fed at `keep`,
    and the rest moves up to keep + len(insert), its keys re-rotated there. `basic` and a `context` slide with no
    previous text only cut (`insert` empty); a `context` slide with previous text re-feeds previous + suffix."""

    keep: int
    drop: int
    insert: tuple[int, ...] = ()


@dataclass
class UnitLedger:
    """Where the session's units lie in its cache (StreamDecoder's `_unit_history` lengths)."""

    preserve: int | None = None  # the system prompt's length (`_system_preserve_length`); None before a unit
    units: list[int] = field(default_factory=list)  # closed units' lengths, oldest first
    said: list[list[int]] = field(default_factory=list)  # what each closed unit said (`generated_tokens`, filtered)
    speaking: list[int] = field(default_factory=list)  # what the open unit said
    open_start: int = 0  # where the unit being filled began
    events: int = 0  # windows slid (`_sliding_event_count`)
    dropped: int = 0  # tokens dropped so far, net of those fed again (`_total_dropped_tokens`)
    suffix: list[int] = field(default_factory=list)  # context: the system prompt's closing tokens
    previous: list[int] = field(default_factory=list)  # context: marker + what dropped units said

    def start(self, at: int, suffix: list[int] | None = None) -> None:
        """`register_system_prompt`: the session's first <unit> is at cache index `at`; all before it is kept,
        and `suffix` (its last tokens) is what `context` mode feeds again after the previous text."""
        if self.preserve is None:
            self.preserve = self.open_start = at
            self.suffix = list(suffix or [])

    def close(self, end: int) -> None:
        """`register_unit_end`: the open unit ends at cache index `end` (after its </unit>)."""
        if self.preserve is not None and end > self.open_start:
            self.units.append(end - self.open_start)
            self.said.append(self.speaking)
        self.open_start = end
        self.speaking = []

    def plan(self, length: int, config: WindowConfig) -> list[Slide]:
        """What the window does to a cache of `length` once a unit is closed (`finalize_unit`,
        modeling_minicpmo_unified.py:5296-5300), in order; the ledger is moved on as if it were done."""
        if config.mode == "context":
            return self._plan_context(config)
        if config.mode == "basic" and (n := self.plan_basic(length, config)):
            assert self.preserve is not None
            return [Slide(self.preserve, n)]
        return []

    def plan_basic(self, length: int, config: WindowConfig) -> int:
        """`enforce_window` (utils.py:1434-1477): how many tokens after the system prompt to drop from a cache of
        `length`. The unit just closed is never dropped (its last tokens are not yet in the cache here; the
        demo's thresholds leave thousands of tokens between them, so it never comes to that)."""
        if self.preserve is None or length <= config.high:
            return 0
        drop = 0
        while length - drop > config.low and len(self.units) > 1:
            drop += self.units.pop(0)
            self.said.pop(0)
        if drop:
            self.events += 1
            self.dropped += drop
            self.open_start -= drop
        return drop

    def _plan_context(self, config: WindowConfig) -> list[Slide]:
        """`enforce_window_with_context` (utils.py:1898-1944): while more than `max_units` units are held, the
        oldest goes (`_drop_unit_with_context`, 1837-1883); what it said joins the previous text, cut on the left
        to `previous_max` tokens past the marker (`_update_previous`, 1778-1835); the cache is rebuilt
        (`_rebuild_cache_with_previous`, 1546-1675): cut only while there is no previous text (1576-1602), else
        previous + suffix fed again after the prefix (1606-1670)."""
        if self.preserve is None or len(self.units) <= config.max_units:
            return []
        slides = []
        while len(self.units) > config.max_units:
            n, said = self.units.pop(0), self.said.pop(0)
            prefix = self.preserve - len(self.previous) - len(self.suffix)
            old = len(self.previous)
            if said:
                self.previous = [*(self.previous or config.marker), *said]
                over = len(self.previous) - len(config.marker) - config.previous_max
                if over > 0:
                    self.previous = [*config.marker, *self.previous[len(config.marker) + over:]]
            if self.previous:
                slide = Slide(prefix, old + len(self.suffix) + n, (*self.previous, *self.suffix))
            else:
                slide = Slide(self.preserve, n)
            self.preserve = prefix + len(self.previous) + len(self.suffix)
            self.dropped += slide.drop - len(slide.insert)
            self.open_start -= slide.drop - len(slide.insert)
            slides.append(slide)
        self.events += 1
        return slides

    def truncate(self, length: int) -> None:
        """The cache was cut to `length` (a rollback): the units past it are forgotten, the rest reopens."""
        if self.preserve is None:
            return
        if length <= self.preserve:
            self.preserve, self.units, self.said, self.open_start = None, [], [], 0
            self.suffix, self.previous = [], []
            return
        end = self.preserve
        kept = 0
        for n in self.units:
            if end + n > length:
                break
            kept += 1
            end += n
        del self.units[kept:], self.said[kept:]
        self.open_start, self.speaking = end, []


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


def drop_tokens(key: np.ndarray, preserve: int, length: int, theta: float, gap: int = 0) -> np.ndarray:
    """utils.py `drop_tokens_from_cache` on a cache's keys [layers, kv_heads, length, head_dim]: [preserve, preserve +
    length) out; returns the keys that follow the cut, re-rotated to start at `preserve + gap` (`gap` tokens are to be
    fed between the two). The values move as they are."""
    return realign_rope(key[:, :, preserve + length:], preserve + length, preserve + gap, theta)

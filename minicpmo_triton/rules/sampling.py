"""Next-token choice: repetition penalty, temperature, top-k, top-p; greedy at temperature 0.

The ranges below are checked once per session at init (`DuplexOptions`) and again by each stage for
its row (`check_sampling`), so a bad setting fails its own session and never its batch's others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import Code, StepError

MAX_TEMPERATURE = 10.0  # far past any useful setting; far inside float32
MIN_TEMPERATURE = 1e-6  # a positive temperature below it is greedy in effect: say 0
MAX_TOP_K = 1_000_000  # over the vocabulary means no top-k (as 0 does)
MAX_PENALTY = 10.0  # repetition_penalty and length_penalty: (0, 10]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.05
    repetition_window: int = 512

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def temperature_problem(value: float) -> str | None:
    if not (value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        return f"must be 0 (greedy) or within [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {value!r}"
    return None


def sampling_problems(temperature: float, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                      length_penalty: float = 1.0) -> dict[str, str]:
    """Each setting out of range, by name, with why (NaN fails every comparison, so it is refused too)."""
    problems = {"temperature": temperature_problem(temperature)}
    if not 0 <= top_k <= MAX_TOP_K:
        problems["top_k"] = f"must be an integer within [0, {MAX_TOP_K}]"
    if not 0 < top_p <= 1:
        problems["top_p"] = f"must be within (0, 1], got {top_p!r}"
    for name, value in (("repetition_penalty", repetition_penalty), ("length_penalty", length_penalty)):
        if not 0 < value <= MAX_PENALTY:
            problems[name] = f"must be within (0, {MAX_PENALTY:g}], got {value!r}"
    return {k: v for k, v in problems.items() if v}


def check_sampling(what: str, **settings: float) -> None:
    """A stage's check of its row's settings: `invalid_config` for the first one out of range."""
    problems = sampling_problems(**settings)  # type: ignore[arg-type]
    if problems:
        name, why = next(iter(problems.items()))
        raise StepError(Code.INVALID_CONFIG, f"{what}: {name} {why}")


def seeded_rng(seed: int, corr_id: int) -> np.random.Generator:
    """A session's sampler: its seed, or its correlation ID when the seed is 0."""
    if seed < 0:
        raise StepError(Code.INVALID_CONFIG, f"a seed must be within [0, 2**63-1], got {seed}")
    return np.random.default_rng(seed or corr_id)


class DrawnAhead:
    """A session rng's uniforms drawn ahead for a row the device decodes (all it may use, before it runs), and given
    back when the row is done: the rng set to where it was and advanced by the draws the row made, so the session's
    next draws are the host path's."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self._at: Any = None
        self.used = 0

    def draw(self, n: int) -> np.ndarray:
        self._at = self.rng.bit_generator.state
        return self.rng.random(n)  # the same doubles as n `random()` calls

    def give_back(self) -> None:
        if self._at is not None:
            self.rng.bit_generator.state = self._at
            self.rng.random(self.used)
            self._at = None


def apply_repetition_penalty(logits: np.ndarray, history: list[int], penalty: float, window: int,
                             per_occurrence: bool = False) -> None:
    """Push the last `window` tokens' logits toward lower odds, by `penalty` once per token, or
    `penalty ** count` per token with `per_occurrence` (MiniCPM-o's TTS:
    `CustomRepetitionPenaltyLogitsProcessorRepeat`)."""
    if penalty == 1.0 or not history:
        return
    ids, counts = np.unique(np.asarray(history[-window:], np.int64), return_counts=True)
    keep = ids < logits.shape[0]
    ids, counts = ids[keep], counts[keep]
    alpha = penalty ** counts if per_occurrence else penalty
    vals = logits[ids]
    logits[ids] = np.where(vals < 0, vals * alpha, vals / alpha)


def check_finite(logits: np.ndarray) -> None:
    """NaN or +inf anywhere (or nothing but -inf): the row's forward broke, a coded error for this row."""
    if np.isnan(logits).any() or np.isposinf(logits).any() or not np.isfinite(logits).any():
        raise StepError(Code.NUMERIC_ERROR, "the model's logits are not finite for this row")


def kept_k(top_k: int, vocab: int) -> int:
    """How many ids a top-k keeps: `top_k` within 1..vocab, 0 (off) the whole vocabulary."""
    return min(top_k, vocab) if top_k > 0 else vocab


def distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """What a sampled draw picks from: the top-k ids by falling logit and their probabilities after top-p (zero
    past it), float64. logits as `sample` takes them."""
    scaled = logits.astype(np.float64) / params.temperature
    k = kept_k(params.top_k, scaled.shape[0])
    top = np.argpartition(-scaled, k - 1)[:k]
    top = top[np.argsort(-scaled[top])]
    probs = np.exp(scaled[top] - scaled[top[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = np.cumsum(probs) - probs < params.top_p
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return top, probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits: [vocab] float32, already penalised and masked (-inf where forbidden).

    NaN or +inf anywhere (or nothing but -inf) means the row's forward broke: a coded error for this
    row, never a token picked from garbage."""
    check_finite(logits)
    if params.greedy:
        return int(np.argmax(logits))
    top, probs = distribution(logits, params)
    return int(top[rng.choice(len(top), p=probs)])

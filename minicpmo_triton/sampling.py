"""Next-token choice: repetition penalty, temperature, top-k, top-p; greedy at temperature 0."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits: [vocab] float32, already penalised and masked (-inf where forbidden)."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    k = min(params.top_k, scaled.shape[0]) if params.top_k > 0 else scaled.shape[0]
    top = np.argpartition(-scaled, k - 1)[:k]
    top = top[np.argsort(-scaled[top])]
    probs = np.exp(scaled[top] - scaled[top[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = np.cumsum(probs) - probs < params.top_p
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return int(top[rng.choice(len(top), p=probs)])

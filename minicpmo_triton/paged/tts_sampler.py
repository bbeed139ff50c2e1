"""The TTS's next code for every row, chosen on the device in one batch: the logits [B, 6562] never leave it.

The rules are the TTS stage's host rules (`TtsStage.choose`, MiniCPM-o's `MiniCPMTTS.generate_chunk`,
OpenBMB/MiniCPM-o-Demo MiniCPMO45/modeling_minicpmo_unified.py:6792-6816), step for step and in the same
precision: the logits divided by the temperature (float32, :6792); the repetition penalty per occurrence over the
chunk's codes in its window (`CustomRepetitionPenaltyLogitsProcessorRepeat`, :6950-6968: `apply_repetition_penalty`
with `per_occurrence`, alpha = penalty ** count in float64, the result stored in float32); EOS masked mid-turn
(:6809-6810); then `sampling.sample` at temperature 1: the argmax when greedy, else the whole distribution (the
Demo's `generate_chunk` builds top-k / top-p warpers and never applies them; `TtsRules.top_k` 0 / `top_p` 1.0 are
off, other values apply them through `top_k_top_p`) and the inverse CDF at the host's `rng.random()`. Only each row's
window (up to 16 codes), its settings and its draw go up; its code and a flag come back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .protocol import TtsPick, TtsRules
from .sampler import inverse_cdf, not_finite, top_k_top_p
from .traffic import Traffic


class TtsSampler:
    def __init__(self, rules: TtsRules, device: torch.device, traffic: Traffic) -> None:
        self.rules = rules
        self.device = device
        self.traffic = traffic

    def _up(self, values: Any, dtype: Any) -> torch.Tensor:
        return self.traffic.upload("inputs", np.asarray(values, dtype), self.device)

    def adjusted(self, raw: torch.Tensor, picks: list[TtsPick]) -> torch.Tensor:
        """[B, vocab] float32: the logits after temperature, penalty and the EOS mask (what `sample` is given)."""
        return self._adjusted(raw, picks, self._up([p.temperature for p in picks], np.float32))

    def _adjusted(self, raw: torch.Tensor, picks: list[TtsPick], temps: torch.Tensor) -> torch.Tensor:
        x = raw.to(torch.float32) / torch.where(temps > 0, temps, 1.0)[:, None]
        vocab = x.shape[1]
        width = max(1, max(len(p.history) for p in picks))
        ids = np.full((len(picks), width), vocab, np.int64)  # padded with a column past the vocabulary, cut below
        for r, p in enumerate(picks):
            ids[r, : len(p.history)] = p.history
        counts = torch.zeros((x.shape[0], vocab + 1), dtype=torch.float64, device=x.device)
        counts.scatter_add_(1, self._up(ids, np.int64), torch.ones(ids.shape, dtype=torch.float64, device=x.device))
        alpha = torch.pow(torch.tensor(self.rules.repetition_penalty, dtype=torch.float64, device=x.device),
                          counts[:, :vocab])
        x64 = x.to(torch.float64)
        x = torch.where(x64 < 0, x64 * alpha, x64 / alpha).to(torch.float32)
        eos = x[:, self.rules.eos]
        x[:, self.rules.eos] = torch.where(self._up([p.allow_eos for p in picks], np.bool_), eos, float("-inf"))
        return x

    def distribution(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`sampling.distribution` at temperature 1 of the adjusted logits: [B, k] ids and probabilities."""
        k = min(self.rules.top_k, x.shape[1]) if self.rules.top_k > 0 else x.shape[1]
        ks = torch.full((x.shape[0],), k, dtype=torch.int64, device=x.device)
        top_p = torch.full((x.shape[0],), self.rules.top_p, dtype=torch.float64, device=x.device)
        return top_k_top_p(x.to(torch.float64), ks, k, top_p)

    def pick(self, logits: torch.Tensor, picks: list[TtsPick]) -> tuple[np.ndarray, np.ndarray]:
        """logits [B, vocab] on the device, one TtsPick per row -> each row's code [B] and whether its logits were
        not finite [B] (that row fails alone: `sampling.check_finite`)."""
        temps = self._up([p.temperature for p in picks], np.float32)
        x = self._adjusted(logits, picks, temps)
        greedy = temps <= 0
        top_ids, probs = self.distribution(x)
        sampled = inverse_cdf(top_ids, probs, self._up([p.u for p in picks], np.float64))
        code = torch.where(greedy, x.argmax(1), sampled)
        out = self.traffic.download("outputs", torch.cat([code, not_finite(x).to(torch.int64)]))
        return out[: len(picks)], out[len(picks) :].astype(bool)

"""The next token of every decoding row, chosen on the device in one batch: the logits never leave it.

The host keeps what it always kept (each row's decode rules, history and rng) and sends per row only a few
numbers (`RowPick`): which allowed-token mask, the one token the rules force, the token the length penalty
touches, a teacher-forced token, the repetition window, the sampling settings and one uniform draw from the
session's rng. The device applies the rules as `ChunkDecoder.adjust` / `ChatDecoder.adjust` do, the repetition
penalty as `apply_repetition_penalty` does, and samples as `sampling.sample` does (top-k, then top-p over the
sorted top-k, then the inverse CDF at the row's draw: `Generator.choice` draws exactly one `random()`), so a
session's tokens are the host path's, sampled or greedy. Only token ids (and a broken-row flag) come back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..chat_rules import ChatDecoder
from ..duplex_rules import ChunkDecoder
from ..errors import Code, StepError
from ..sampling import SamplingParams
from .traffic import Traffic

DUPLEX_MASK, CHAT_MASK = 0, 1


@dataclass
class LogitRule:
    """What a chunk's decode rules do to the logits this step (`adjust`), as numbers."""

    mask: int  # DUPLEX_MASK or CHAT_MASK
    only: int = -1  # >= 0: every other token is forbidden and this one's logit is 0 (the last allowed step)
    penalised: int = -1  # >= 0: this token's logit is divided (positive) or multiplied (negative) by `penalty`
    penalty: float = 1.0


def logit_rule(dec: ChunkDecoder | ChatDecoder) -> LogitRule:
    if isinstance(dec, ChatDecoder):
        return LogitRule(CHAT_MASK)
    if len(dec.generated) >= dec.max_new_tokens - 1:
        return LogitRule(DUPLEX_MASK, only=dec.tokens.chunk_eos)
    if dec.length_penalty != 1.0:
        return LogitRule(DUPLEX_MASK, penalised=dec.tokens.turn_eos, penalty=dec.length_penalty)
    return LogitRule(DUPLEX_MASK)


def rule_allows(rule: LogitRule, masks: np.ndarray, token: int) -> bool:
    return token == rule.only if rule.only >= 0 else bool(masks[rule.mask][token])


def rule_leaves_choice(rule: LogitRule, masks: np.ndarray) -> bool:
    return rule.only < 0 and int(masks[rule.mask].sum()) > 1


@dataclass
class RowPick:
    rule: LogitRule
    params: SamplingParams
    forced: int = -1  # >= 0: fed in place of a sample (teacher forcing)
    history: list[int] = field(default_factory=list)  # the repetition window
    u: float = 0.0  # the row's uniform draw, when it samples


def _padded_history(picks: list[RowPick]) -> tuple[np.ndarray, np.ndarray]:
    """[B, W] ids, each row padded with its own first id (a repeated id gets the same write: deterministic),
    and each row's penalty (1 for a row without history)."""
    width = max(1, max(len(p.history) for p in picks))
    ids = np.zeros((len(picks), width), np.int64)
    alpha = np.ones(len(picks), np.float32)
    for r, p in enumerate(picks):
        if p.history:
            ids[r] = p.history[0]
            ids[r, : len(p.history)] = p.history
            alpha[r] = p.params.repetition_penalty
    return ids, alpha


class DeviceSampler:
    def __init__(self, masks: np.ndarray, device: torch.device, traffic: Traffic) -> None:
        self.masks_host = masks  # [kinds, vocab] bool: the allowed tokens of each rule set
        self.masks = torch.as_tensor(masks, device=device)  # uploaded once
        self.device = device
        self.traffic = traffic

    def _up(self, values: list | np.ndarray, dtype: np.dtype) -> torch.Tensor:
        return self.traffic.upload("inputs", np.asarray(values, dtype), self.device)

    def adjust(self, logits: torch.Tensor, rules: list[LogitRule]) -> torch.Tensor:
        """The rules' logits, as each row's decoder's `adjust` gives them."""
        neg = torch.tensor(float("-inf"), device=logits.device)
        x = torch.where(self.masks[self._up([r.mask for r in rules], np.int64)], logits, neg)
        only = self._up([r.only for r in rules], np.int64)
        vocab = torch.arange(x.shape[1], device=x.device)
        x = torch.where(only[:, None] < 0, x, torch.where(vocab[None, :] == only[:, None], 0.0, neg))
        pen_tok = self._up([max(r.penalised, 0) for r in rules], np.int64)[:, None]
        pen = self._up([r.penalty if r.penalised >= 0 else 1.0 for r in rules], np.float32)[:, None]
        val = x.gather(1, pen_tok)
        return x.scatter(1, pen_tok, torch.where(val > 0, val / pen, val * pen))

    def pick(self, logits: torch.Tensor, picks: list[RowPick]) -> np.ndarray:
        """logits [B, vocab] fp32 on the device, one RowPick per row. Returns the B tokens (host)."""
        x = self.adjust(logits, [p.rule for p in picks])
        hist, alpha = _padded_history(picks)
        hist_t, alpha_t = self._up(hist, np.int64), self._up(alpha, np.float32)[:, None]
        vals = x.gather(1, hist_t)
        x = x.scatter(1, hist_t, torch.where(vals < 0, vals * alpha_t, vals / alpha_t))
        bad = torch.isnan(x).any(1) | torch.isposinf(x).any(1) | ~torch.isfinite(x).any(1)
        greedy = torch.argmax(x, dim=1)
        sampled = self._sample(x, picks)
        forced = self._up([p.forced for p in picks], np.int64)
        is_greedy = self._up([p.params.greedy for p in picks], np.bool_)
        token = torch.where(forced >= 0, forced, torch.where(is_greedy, greedy, sampled))
        bad = bad & (forced < 0)
        out = self.traffic.download("outputs", torch.cat([token, bad.to(torch.int64)]))
        if out[len(picks):].any():
            raise StepError(Code.NUMERIC_ERROR, "the model's logits are not finite for this row")
        return out[: len(picks)]

    def _sample(self, x: torch.Tensor, picks: list[RowPick]) -> torch.Tensor:
        vocab = x.shape[1]
        temps = [p.params.temperature if not p.params.greedy else 1.0 for p in picks]
        ks = [min(p.params.top_k, vocab) if p.params.top_k > 0 else vocab for p in picks]
        if all(p.params.greedy for p in picks):
            return torch.zeros(len(picks), dtype=torch.int64, device=x.device)
        scaled = x.to(torch.float64) / self._up(temps, np.float64)[:, None]
        top_vals, top_ids = torch.topk(scaled, max(ks), dim=1)
        k = self._up(ks, np.int64)[:, None]
        cols = torch.arange(top_vals.shape[1], device=x.device)[None, :]
        probs = torch.where(cols < k, torch.exp(top_vals - top_vals[:, :1]), 0.0)
        probs = probs / probs.sum(1, keepdim=True)
        top_p = self._up([p.params.top_p for p in picks], np.float64)[:, None]
        keep = (torch.cumsum(probs, 1) - probs < top_p) | (top_p >= 1.0)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(1, keepdim=True)
        cdf = torch.cumsum(probs, 1)
        cdf = cdf / cdf[:, -1:]
        u = self._up([p.u for p in picks], np.float64)[:, None]
        choice = torch.searchsorted(cdf, u, right=True).clamp(max=top_vals.shape[1] - 1)
        return top_ids.gather(1, choice)[:, 0]

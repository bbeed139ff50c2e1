"""The next token of every decoding row, chosen on the device in one batch: the logits never leave it.

The host keeps what it always kept (each row's decode rules, draw history and rng) and sends per row only a few
numbers (`RowPick`): its rule set, a teacher-forced token, the repetition window, the sampling settings and the
uniform draws from the session's rng. The device then does what the host path does:
- a duplex row as `duplex_rules.stream_decode` (MiniCPM-o's `StreamDecoder.decode`): a first draw from the raw
  softmax (argmax when greedy), ending the chunk if it is <|chunk_eos|>; else the forbidden ids masked, the
  repetition penalty (divide whatever the sign), the length penalty on <|turn_eos|>, temperature, top-k, top-p
  (`top_k_top_p`) and a second draw;
- a chat row as `ChatDecoder.adjust` + `apply_repetition_penalty` + `sampling.sample`.
Each draw is the host's inverse CDF at the host's `rng.random()`, so a session's tokens are the host path's,
greedy or sampled. The host draws a duplex row's two uniforms before the device knows whether the second is
needed; `drew_second` comes back with the token, and the host rewinds its rng when it was not (`RowPick.rewind`).
Only token ids and two flags per row come back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import Code, StepError
from ..model_config import SpecialTokens
from .protocol import CHAT, DUPLEX, Picked, RowPick
from .traffic import Traffic


def _padded_history(picks: list[RowPick]) -> tuple[np.ndarray, np.ndarray]:
    """[B, W] ids, each row padded with its own first id (a repeated id gets the same write: deterministic),
    and each row's penalty (1 for a row without history)."""
    width = max(1, max(len(p.history) for p in picks))
    ids = np.zeros((len(picks), width), np.int64)
    alpha = np.ones(len(picks), np.float64)
    for r, p in enumerate(picks):
        if p.history:
            ids[r] = p.history[0]
            ids[r, : len(p.history)] = p.history
            alpha[r] = p.params.repetition_penalty
    return ids, alpha


def _softmax64(x: torch.Tensor) -> torch.Tensor:
    """As `duplex_rules._softmax`: exp in float64 of x less its (float32) max, normalised."""
    e = torch.exp(x.to(torch.float64) - x.max(1, keepdim=True).values.to(torch.float64))
    return e / e.sum(1, keepdim=True)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """As `duplex_rules._draw`: the inverse CDF (in index order) at u times the total."""
    cdf = torch.cumsum(probs, 1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp(max=probs.shape[1] - 1)


def not_finite(x: torch.Tensor) -> torch.Tensor:
    """Per row, as `sampling.check_finite`: NaN or +inf anywhere, or nothing but -inf."""
    return torch.isnan(x).any(1) | torch.isposinf(x).any(1) | ~torch.isfinite(x).any(1)


def top_k_top_p(scaled: torch.Tensor, ks: torch.Tensor, kmax: int, top_p: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `sampling.distribution`, batched: per row its top ids by falling value [B, max k] and their probabilities
    (float64, zero past the row's k and past its top_p). scaled: [B, vocab] float64; ks: [B] within 1..vocab, kmax
    their largest (known on the host: no sync)."""
    top_vals, top_ids = torch.topk(scaled, kmax, dim=1)
    cols = torch.arange(top_vals.shape[1], device=scaled.device)[None, :]
    probs = torch.where(cols < ks[:, None], torch.exp(top_vals - top_vals[:, :1]), 0.0)
    probs = probs / probs.sum(1, keepdim=True)
    top_p = top_p[:, None]
    probs = torch.where((torch.cumsum(probs, 1) - probs < top_p) | (top_p >= 1.0), probs, 0.0)
    return top_ids, probs / probs.sum(1, keepdim=True)


def inverse_cdf(top_ids: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`Generator.choice` with p, per row: the inverse CDF (normalised) at the host's one `random()` u [B]."""
    cdf = torch.cumsum(probs, 1)
    cdf = cdf / cdf[:, -1:]
    choice = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=top_ids.shape[1] - 1)
    return top_ids.gather(1, choice)[:, 0]


class DeviceSampler:
    def __init__(self, forbidden: np.ndarray, tokens: SpecialTokens, device: torch.device, traffic: Traffic) -> None:
        self.forbidden = torch.as_tensor(forbidden, device=device)  # [rule sets, vocab] bool, uploaded once
        self.tokens = tokens
        self.device = device
        self.traffic = traffic

    def _up(self, values: Any, dtype: Any) -> torch.Tensor:
        return self.traffic.upload("inputs", np.asarray(values, dtype), self.device)

    def pick(self, logits: torch.Tensor, picks: list[RowPick]) -> Picked:
        """logits [B, vocab] fp32 on the device, one RowPick per row."""
        b = len(picks)
        token = torch.zeros(b, dtype=torch.int64, device=self.device)
        second = torch.zeros(b, dtype=torch.bool, device=self.device)
        bad = torch.zeros(b, dtype=torch.bool, device=self.device)
        for kind, run in ((DUPLEX, self._duplex), (CHAT, self._chat)):
            rows = [r for r, p in enumerate(picks) if p.kind == kind and p.forced < 0]
            if rows:
                at = self._up(rows, np.int64)
                t, s, k = run(logits[at].to(torch.float32), [picks[r] for r in rows])
                token[at], second[at], bad[at] = t, s, k
        forced = self._up([p.forced for p in picks], np.int64)
        token = torch.where(forced >= 0, forced, token)
        out = self.traffic.download("outputs", torch.cat([token, second.to(torch.int64), bad.to(torch.int64)]))
        if out[2 * b :].any():
            raise StepError(Code.NUMERIC_ERROR, "the model's logits are not finite for this row")
        return Picked(out[:b], out[b : 2 * b].astype(bool))

    def _penalise_repeats(self, x: torch.Tensor, picks: list[RowPick], whatever_sign: bool) -> torch.Tensor:
        """The window's ids once each: divided by the penalty whatever the sign (duplex, `penalise`), or pushed
        toward lower odds by sign (chat, `apply_repetition_penalty`). Float32 as the host computes it."""
        ids, alpha = _padded_history(picks)
        ids_t = self._up(ids, np.int64)
        a32 = self._up(alpha.astype(np.float32), np.float32)[:, None]
        vals = x.gather(1, ids_t)
        if whatever_sign:
            inv = self._up((1.0 / alpha).astype(np.float32), np.float32)[:, None]
            new = torch.where(a32 > 1.0, vals / a32, vals * inv)
        else:
            new = torch.where(vals < 0, vals * a32, vals / a32)
        return x.scatter(1, ids_t, new)

    def _duplex(self, raw: torch.Tensor, picks: list[RowPick]) -> tuple[torch.Tensor, ...]:
        tk, neg = self.tokens, torch.tensor(float("-inf"), device=raw.device)
        bad = not_finite(raw)
        greedy = self._up([p.params.greedy for p in picks], np.bool_)
        u1 = self._up([p.u[0] for p in picks], np.float64)
        u2 = self._up([p.u[1] for p in picks], np.float64)
        first = torch.where(greedy, raw.argmax(1), _draw(_softmax64(raw), u1))
        out = torch.where(self.forbidden[DUPLEX], neg, raw)
        out = self._penalise_repeats(out, picks, whatever_sign=True)
        lp = self._up([p.length_penalty for p in picks], np.float32)
        v = out[:, tk.turn_eos]
        out[:, tk.turn_eos] = torch.where(v > 0, v / lp, v * lp)
        temps = self._up([1.0 if p.params.greedy else p.params.temperature for p in picks], np.float32)[:, None]
        scaled = out / temps
        # top_k_top_p: below the k-th logit out (ties kept), then past the token whose cumulative probability
        # first exceeds top_p (by falling logit, ties in index order)
        vocab = scaled.shape[1]
        ks = [min(p.params.top_k, vocab) if p.params.top_k > 0 else 0 for p in picks]
        if max(ks) > 0:
            top = torch.topk(scaled, max(ks), dim=1).values
            kth = top.gather(1, (self._up(ks, np.int64).clamp(min=1) - 1)[:, None])
            kth = torch.where(self._up(ks, np.int64)[:, None] > 0, kth, neg)
            scaled = torch.where(scaled < kth, neg, scaled)
        ordered, order = torch.sort(scaled, dim=1, descending=True, stable=True)
        cum = torch.cumsum(_softmax64(ordered), 1)
        top_p = self._up([p.params.top_p for p in picks], np.float64)[:, None]
        remove = torch.zeros_like(cum, dtype=torch.bool)
        remove[:, 1:] = cum[:, :-1] > top_p
        scaled = torch.where(torch.zeros_like(remove).scatter(1, order, remove), neg, scaled)
        second = torch.where(greedy, out.argmax(1), _draw(_softmax64(scaled), u2))
        ends = first == tk.chunk_eos
        return torch.where(ends, first, second), ~ends, bad

    def _chat(self, raw: torch.Tensor, picks: list[RowPick]) -> tuple[torch.Tensor, ...]:
        neg = torch.tensor(float("-inf"), device=raw.device)
        x = self._penalise_repeats(torch.where(self.forbidden[CHAT], neg, raw), picks, whatever_sign=False)
        bad = not_finite(x)
        greedy = self._up([p.params.greedy for p in picks], np.bool_)
        vocab = x.shape[1]
        ks = [min(p.params.top_k, vocab) if p.params.top_k > 0 else vocab for p in picks]
        temps = [1.0 if p.params.greedy else p.params.temperature for p in picks]
        scaled = x.to(torch.float64) / self._up(temps, np.float64)[:, None]
        top_p = self._up([p.params.top_p for p in picks], np.float64)
        top_ids, probs = top_k_top_p(scaled, self._up(ks, np.int64), max(ks), top_p)
        sampled = inverse_cdf(top_ids, probs, self._up([p.u[0] for p in picks], np.float64))
        return torch.where(greedy, x.argmax(1), sampled), torch.zeros_like(greedy), bad

"""The draws, written as fixed-shape tensor ops (no sort of the vocabulary, no data-dependent shape, no sync), so a
CUDA graph captures them: a batch's rows choose their tokens on the device at the host's own uniforms, and each
draw is the host's arithmetic step for step (`duplex_rules`, `sampling`), so a session's tokens are the host path's.

- `first_draw`: `duplex_rules._draw(_softmax(raw))`, the duplex rules' first draw over the whole raw softmax: an
  inverse CDF over a cumulative sum (float64), which needs no sort.
- `index_ordered`: `duplex_rules.top_k_top_p` then the draw among the kept tokens in index order: top-k first
  (`torch.topk` at a fixed width: the k-th value's ties kept within it), then top-p over those (by falling value,
  ties in index order), then the inverse CDF in index order.
- `value_ordered` + `inverse_cdf`: `sampling.distribution` + `Generator.choice` (chat rows, the TTS): top-k by
  falling value, top-p over them, the normalised CDF at the host's one uniform.
"""

from __future__ import annotations

import torch

TIE_MARGIN = 16  # columns past the largest k: the k-th value's ties the top-k keeps (a rule keeps all of them)


def candidates(k: int, vocab: int) -> int:
    """The top-k width for rows whose k is at most `k` (0: the whole vocabulary): a power of two with room for ties."""
    if k <= 0 or k + TIE_MARGIN >= vocab:
        return vocab
    return min(vocab, 1 << (k + TIE_MARGIN - 1).bit_length())


def not_finite(x: torch.Tensor) -> torch.Tensor:
    """Per row, as `sampling.check_finite`: NaN or +inf anywhere, or nothing but -inf."""
    return torch.isnan(x).any(1) | torch.isposinf(x).any(1) | ~torch.isfinite(x).any(1)


def softmax64(x: torch.Tensor) -> torch.Tensor:
    """As `duplex_rules._softmax`: exp in float64 of x less its max, normalised (-inf: 0)."""
    e = torch.exp(x.to(torch.float64) - x.max(1, keepdim=True).values.to(torch.float64))
    return e / e.sum(1, keepdim=True)


def first_draw(raw: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`_draw(_softmax(raw))`: the inverse CDF (in index order) at u times the total."""
    cdf = torch.cumsum(softmax64(raw), 1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp(max=raw.shape[1] - 1)


def index_ordered(scaled: torch.Tensor, ks: torch.Tensor, width: int, top_p: torch.Tensor,
                  u: torch.Tensor) -> torch.Tensor:
    """`duplex_rules.top_k_top_p(scaled, k, top_p)` then `live[_draw(_softmax(kept[live]))]`, batched.
    scaled [B, V] float32; ks [B] within 1..V (V: no top-k); width: the top-k's columns (>= every k + its ties);
    top_p [B] float64; u [B] float64. Returns the token [B]."""
    neg = scaled.new_full((), float("-inf"))
    vals, ids = torch.topk(scaled, width, dim=1)  # falling value
    kth = vals.gather(1, (ks - 1).clamp(0, width - 1)[:, None])
    keep = (vals >= kth) & (vals > neg)  # below the k-th value out, its ties kept; -inf is never live
    order = ids.argsort(1)  # the candidates in index order
    ids, vals, keep = ids.gather(1, order), vals.gather(1, order), keep.gather(1, order)
    # top-p by falling value, ties in index order (a stable sort of the index-ordered candidates)
    ranked, rank = torch.sort(torch.where(keep, vals, neg), dim=1, descending=True, stable=True)
    cum = torch.cumsum(softmax64(ranked), 1)
    out = torch.zeros_like(keep)
    out[:, 1:] = cum[:, :-1] > top_p[:, None]
    keep = keep & ~torch.zeros_like(keep).scatter(1, rank, out)
    # the draw among the kept tokens, in index order
    cdf = torch.cumsum(softmax64(torch.where(keep, vals, neg)), 1)
    pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    cols = torch.arange(width, device=scaled.device)
    last = torch.where(keep, cols, 0).max(1).values  # the host draws among the kept only
    return ids.gather(1, torch.minimum(pos, last)[:, None])[:, 0]


def value_ordered(scaled: torch.Tensor, ks: torch.Tensor, width: int, top_p: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `sampling.distribution`, batched: per row its top ids by falling value [B, width] and their probabilities
    (float64, zero past the row's k and past its top_p). scaled: [B, V] float64; ks: [B] within 1..V."""
    top_vals, top_ids = torch.topk(scaled, width, dim=1)
    cols = torch.arange(width, device=scaled.device)[None, :]
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


def take(buf: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """A batch buffer's rows: a view for a bucket (a slice), a gather for named rows (an index tensor)."""
    return buf[rows] if isinstance(rows, slice) else buf.index_select(0, rows)


def put(buf: torch.Tensor, rows: slice | torch.Tensor, value: torch.Tensor) -> None:
    """Write rows back (`take`'s inverse): a copy into the view, or an index copy."""
    if isinstance(rows, slice):
        buf[rows].copy_(value)
    else:
        buf.index_copy_(0, rows, value.to(buf.dtype))

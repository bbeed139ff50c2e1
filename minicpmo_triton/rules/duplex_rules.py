"""One duplex chunk's decode rules, as MiniCPM-o 4.5's own loop applies them (pure code: logits in, tokens out).

The reference is OpenBMB/MiniCPM-o-Demo `MiniCPMO45/`: `StreamDecoder.decode` (utils.py) picks each token,
`DuplexCapability.streaming_generate` / `finalize_unit` (modeling_minicpmo_unified.py) run the chunk:

- Each token is drawn twice: first from the raw softmax (whole vocabulary, no temperature); if that draw is
  <|chunk_eos|> the chunk ends. Otherwise <|chunk_eos|>, <|tts_pad|> and the tokenizer's `bad_token_ids` are
  masked, the repetition penalty (logit / penalty, over the set of the last 512 tokens drawn this session), then
  the length penalty on <|turn_eos|>, then temperature / top-k / top-p (or argmax when greedy).
- <|listen|>, <|chunk_eos|>, <|chunk_tts_eos|> end the chunk; they are not fed now but with </unit> at the next
  prefill. <|listen|> while a turn is open is rewritten to <|tts_bos|>.
- <|turn_eos|> is fed like text: the turn is over, the chunk goes on (usually to <|listen|>).
- From the second token on, a token whose text would bring the chunk's text to 28 characters is rejected
  (not fed, not voiced) and the chunk ends with <|chunk_eos|>; the last allowed step is a <|chunk_eos|>.
- The TTS conditions on every token fed from the second on (its id and hidden state); a chunk that ends in
  <|listen|> is not voiced at all, and reports no text.
- A forced listen ends an open turn first: <|turn_eos|><|listen|></unit>.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..model_config import SpecialTokens
from .sampling import SamplingParams, check_finite

NEG_INF = np.float32(-np.inf)


def forbidden_token_mask(vocab: int, tokens: SpecialTokens, bad_ids: Iterable[int]) -> np.ndarray:
    """What the second draw may never pick: <|tts_pad|> and the tokenizer's bad ids (DuplexCapability.__init__,
    modeling_minicpmo_unified.py:4323), and <|chunk_eos|>, which only the first draw decides (utils.py:1218)."""
    mask = np.zeros(vocab, bool)
    ids = np.asarray([i for i in bad_ids if 0 <= i < vocab], np.int64)
    mask[ids] = True
    mask[[tokens.tts_pad, tokens.chunk_eos]] = True
    return mask


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - np.max(x))
    return e / e.sum()


def top_k_top_p(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """utils.py `top_k_top_p_filtering`: below the k-th logit out (ties kept); then, by falling logit, every
    token after the one whose cumulative probability first exceeds top_p out."""
    out = logits.copy()
    if 0 < top_k < out.shape[0]:
        kth = np.partition(out, -top_k)[-top_k]
        out[out < kth] = NEG_INF
    if top_p > 0.0:
        live = np.flatnonzero(out > NEG_INF)  # the rest have probability 0 and stay out
        order = live[np.argsort(-out[live], kind="stable")]
        cum = np.cumsum(_softmax(out[order]))
        remove = np.zeros_like(cum, bool)
        remove[1:] = cum[:-1] > top_p
        out[order[remove]] = NEG_INF
    return out


def penalise(logits: np.ndarray, history: list[int], repetition_penalty: float, window: int,
             length_penalty: float, turn_eos: int) -> None:
    """utils.py StreamDecoder.decode steps 1 and 2, in place: every token among the last `window` drawn is divided
    by the penalty whatever its sign (>1: `/= p`, <1: `*= 1/p`), then <|turn_eos|>'s logit is pushed away from
    zero's side by `length_penalty` (>1 makes ending the turn less likely)."""
    if repetition_penalty != 1.0 and history:
        ids = np.asarray(sorted(set(history[-window:])), np.int64)
        ids = ids[ids < logits.shape[0]]
        if repetition_penalty > 1.0:
            logits[ids] /= np.float32(repetition_penalty)
        else:
            logits[ids] *= np.float32(1.0 / repetition_penalty)
    if length_penalty != 1.0:
        v = logits[turn_eos]
        logits[turn_eos] = v / np.float32(length_penalty) if v > 0 else v * np.float32(length_penalty)


def stream_decode(logits: np.ndarray, forbidden: np.ndarray, history: list[int], params: SamplingParams,
                  length_penalty: float, tokens: SpecialTokens, rng: np.random.Generator) -> int:
    """One token as StreamDecoder.decode (utils.py:2087-2200) picks it; `history` is the session's draws (the
    decoder's `generated_tokens`), extended here as the reference extends it."""
    raw = logits.astype(np.float32)
    check_finite(raw)  # a broken forward is this row's coded error, never a token
    first = int(np.argmax(raw)) if params.greedy else _draw(_softmax(raw), rng)
    if first == tokens.chunk_eos:
        return first
    out = np.where(forbidden, NEG_INF, raw).astype(np.float32)
    penalise(out, history, params.repetition_penalty, params.repetition_window, length_penalty, tokens.turn_eos)
    if params.greedy:
        token = int(np.argmax(out))
    else:
        kept = top_k_top_p((out / np.float32(params.temperature)).astype(np.float32), params.top_k, params.top_p)
        live = np.flatnonzero(kept > NEG_INF)  # a draw among the kept tokens alone: the same distribution
        token = int(live[_draw(_softmax(kept[live]), rng)])
    history.append(token)
    return token


@dataclass
class ChunkDecoder:
    """streaming_generate's loop (modeling_minicpmo_unified.py:5025-5110) for one chunk, token by token.

    `turn_ended` is the session's `current_turn_ended` as the chunk starts; read it back when the chunk is done.
    `text_ids`: the tokens fed from the second on (the TTS condition, the chunk's text once specials are
    skipped); cleared when the chunk ends in <|listen|>, which the reference neither shows nor voices."""

    tokens: SpecialTokens
    turn_ended: bool
    max_new_tokens: int
    max_text_chars: int
    count_chars: Callable[[list[int]], int]
    generated: list[int] = field(default_factory=list)  # every token decided, in order (terminators included)
    text_ids: list[int] = field(default_factory=list)
    fed: int = 0  # tokens fed this chunk (j in the reference's loop counts decisions; this counts feeds)
    is_listen: bool = False
    end_of_turn: bool = False  # the last token fed was <|turn_eos|> (the reference's loop variable)
    turn_closed: bool = False  # a forced listen closed the open turn (<|turn_eos|> fed before <|listen|>)
    turn_start: bool = False  # this chunk opened a turn (a token was fed while no turn was open)
    pending: list[int] = field(default_factory=list)  # fed with </unit> at the next prefill
    done: bool = False

    @property
    def must_end(self) -> bool:
        """The last step of the chunk's budget: <|chunk_eos|> without a draw (modeling_minicpmo_unified.py:5030)."""
        return len(self.generated) >= self.max_new_tokens - 1

    def _finish(self, terminator: int) -> None:
        self.done = True
        self.pending = [*self.pending, terminator, self.tokens.unit_end]
        if self.is_listen:
            self.text_ids = []

    def end_now(self) -> None:
        """The budget is spent: <|chunk_eos|> is deferred with </unit> (not counted as drawn)."""
        self._finish(self.tokens.chunk_eos)

    def accept(self, token: int) -> int | None:
        """Record a decided token; return the token to feed next, or None when the chunk is over."""
        tk = self.tokens
        if token == tk.listen and not self.turn_ended:
            token = tk.tts_bos  # no listening mid-turn (modeling_minicpmo_unified.py:5056)
        self.generated.append(token)
        self.is_listen = token == tk.listen
        if token in (tk.listen, tk.chunk_eos, tk.chunk_tts_eos):
            self._finish(token)
            return None
        if self.turn_ended:
            self.turn_start = True
        self.turn_ended = False
        j = len(self.generated) - 1
        if j != 0 and self.count_chars([*self.text_ids, token]) >= self.max_text_chars:
            self.generated.pop()  # rejected: not fed, not voiced (the draw still counts in the history)
            self._finish(tk.chunk_eos)
            return None
        self.end_of_turn = token == tk.turn_eos
        if self.end_of_turn:
            self.turn_ended = True
        if j != 0:
            self.text_ids.append(token)
        self.fed += 1
        return token

    def force_listen(self) -> None:
        """Listen without decoding; an open turn is closed first with <|turn_eos|> (modeling_minicpmo_unified.py:
        5003-5011)."""
        if not self.turn_ended:
            self.pending = [self.tokens.turn_eos]
            self.turn_ended = self.end_of_turn = self.turn_closed = True
        self.generated.append(self.tokens.listen)
        self.is_listen = True
        self._finish(self.tokens.listen)

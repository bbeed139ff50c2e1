"""One duplex chunk's decode rules, as MiniCPM-o 4.5 applies them (pure code: logits in, tokens out).

- The chunk ends on <|listen|>, <|chunk_eos|>, <|chunk_tts_eos|> or <|turn_eos|>, or once the
  chunk's text reaches `max_text_chars`; the last allowed step is forced to <|chunk_eos|>.
- <|listen|> is not allowed mid-turn: it is rewritten to <|tts_bos|>.
- The terminator is not fed now: it and </unit> open the next step's prefill (the deferred finalize).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .model_config import SpecialTokens

NEG_INF = np.float32(-np.inf)


def allowed_token_mask(vocab: int, tokens: SpecialTokens, is_text: Callable[[int], bool]) -> np.ndarray:
    """Tokens the duplex decoder may emit: text plus the control tokens of the duplex loop."""
    mask = np.array([is_text(i) for i in range(vocab)], bool)
    for t in (tokens.listen, tokens.speak, tokens.tts_bos, tokens.turn_eos, tokens.chunk_eos,
              tokens.chunk_tts_eos):
        mask[t] = True
    return mask


@dataclass
class ChunkDecoder:
    tokens: SpecialTokens
    in_turn: bool
    max_new_tokens: int
    max_text_chars: int
    length_penalty: float
    allowed: np.ndarray
    count_chars: Callable[[list[int]], int]
    generated: list[int] = field(default_factory=list)
    text_ids: list[int] = field(default_factory=list)
    is_listen: bool = False
    end_of_turn: bool = False
    turn_start: bool = False
    pending: list[int] = field(default_factory=list)
    done: bool = False

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        out = np.where(self.allowed, logits, NEG_INF).astype(np.float32)
        if len(self.generated) >= self.max_new_tokens - 1:
            forced = np.full_like(out, NEG_INF)
            forced[self.tokens.chunk_eos] = 0.0
            return forced
        lp, t = self.length_penalty, self.tokens.turn_eos
        if lp != 1.0:  # >1 makes ending the turn less likely, as the reference's length_penalty does
            out[t] = out[t] / lp if out[t] > 0 else out[t] * lp
        return out

    @property
    def spoke(self) -> bool:
        return self.in_turn or bool(self.text_ids) or self.turn_start

    def _finish(self, terminator: int) -> None:
        self.done = True
        self.pending = [terminator, self.tokens.unit_end]
        if not self.spoke:
            self.is_listen = True

    def accept(self, token: int) -> int | None:
        """Record a sampled token; return the token to feed next, or None when the chunk is over.

        A token may be returned with `done` set: it is fed, and then the chunk is over."""
        tk = self.tokens
        self.generated.append(token)
        if token == tk.listen:
            if not self.spoke:
                self._finish(tk.listen)
                return None
            token = tk.tts_bos  # no listening mid-turn
        if token in (tk.chunk_eos, tk.chunk_tts_eos):
            self._finish(token)
            return None
        if token == tk.turn_eos:
            self.end_of_turn = self.spoke
            self._finish(token)
            return None
        if token in (tk.speak, tk.tts_bos):
            if not self.in_turn:
                self.turn_start = True
            return token
        self.text_ids.append(token)
        if not self.in_turn:
            self.turn_start = True
        if self.count_chars(self.text_ids) >= self.max_text_chars:
            self._finish(tk.chunk_eos)  # done, but this text token is still fed (the TTS needs its state)
        return token

    def force_listen(self) -> None:
        """Listen without decoding; a turn in progress is ended first (<|turn_eos|>)."""
        self.is_listen = True
        self.done = True
        self.end_of_turn = self.in_turn
        self.pending = [self.tokens.turn_eos if self.in_turn else self.tokens.listen, self.tokens.unit_end]

"""Turn-based decode rules: text until <|im_end|> or the chunk's token budget (pure code).

A turn is generated in chunks so text streams: the token sampled when a chunk's budget runs out is
not fed; it is carried into the next chunk, where it is fed first and counted as that chunk's text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..model_config import SpecialTokens
from .duplex_rules import NEG_INF


def chat_token_mask(vocab: int, tokens: SpecialTokens, is_text: Callable[[int], bool]) -> np.ndarray:
    """Text tokens and <|im_end|>; none of the duplex control tokens."""
    mask = np.array([is_text(i) for i in range(vocab)], bool)
    for t in (tokens.listen, tokens.speak, tokens.tts_bos, tokens.turn_eos, tokens.chunk_eos, tokens.chunk_tts_eos):
        mask[t] = False
    mask[tokens.im_end] = True
    return mask


@dataclass
class ChatDecoder:
    tokens: SpecialTokens
    budget: int  # tokens to sample in this chunk
    last_chunk: bool  # the turn's budget ends with this chunk: close the turn whatever is sampled
    allowed: np.ndarray
    turn_close: list[int]  # <|im_end|> + newline, what ends an assistant message in the context
    carry: int | None = None  # sampled at the end of the previous chunk, fed first now
    generated: list[int] = field(default_factory=list)
    text_ids: list[int] = field(default_factory=list)
    end_of_turn: bool = False
    pending: list[int] = field(default_factory=list)
    done: bool = False
    is_listen: bool = False
    turn_start: bool = False

    def __post_init__(self) -> None:
        if self.carry is not None:
            self.text_ids.append(self.carry)

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        return np.where(self.allowed, logits, NEG_INF).astype(np.float32)

    def accept(self, token: int) -> int | None:
        self.generated.append(token)
        if token == self.tokens.im_end:
            self.done, self.end_of_turn, self.pending = True, True, list(self.turn_close)
            return None
        if len(self.generated) >= self.budget:
            self.done = True
            if self.last_chunk:  # the sampled token is dropped and the message closed
                self.end_of_turn, self.pending = True, list(self.turn_close)
            else:
                self.pending = [token]
            return None
        self.text_ids.append(token)
        return token

"""Rows whose rules follow a script, for the benches with random weights (which say nothing of their own): each row
runs the device's full rules every iteration (the draws, the penalties, the window; teacher-forced tokens win), so
its device and host work are a served row's, and it says what the script says and ends when it does."""

from __future__ import annotations

import numpy as np

from minicpmo_triton.engine.protocol import DUPLEX, ENDED, LlmRow, TtsRow
from minicpmo_triton.model_config import SpecialTokens


class Scripted:
    """The hooks a scripted row does nothing in: it draws nothing ahead and keeps no hidden rows."""

    hidden_on_device = False  # its hidden rows (an LLM row's) come to the host, as a caller over Triton needs

    def done(self) -> None:
        pass

    def take_hidden(self, hidden: object) -> None:
        pass


class SpokenChunk(Scripted):
    """A duplex chunk: speaking, `text` text tokens then <|chunk_eos|> (the TTS's condition: their hidden rows);
    listening, <|listen|>. Sampled at the defaults over a 512-token window."""

    def __init__(self, tokens: SpecialTokens, speaking: bool, text: int, rng: np.random.Generator) -> None:
        script = [int(t) for t in rng.integers(32, 127, text)] + [tokens.chunk_eos] if speaking else [tokens.listen]
        self.n_text = text - 1 if speaking else 0  # the chunk's first token is not text (`ChunkDecoder`)
        self.row = LlmRow(DUPLEX, 0.7, 20, 0.8, 1.05, 1.1, len(script) + 1,
                          [int(t) for t in rng.integers(32, 127, 512)], script, True, rng.random(2 * len(script) + 2))
        self.left = len(script)

    @property
    def n_hidden(self) -> int:
        return self.n_text

    def confirm(self, token: int, flags: int) -> bool:
        self.left -= 1
        return self.left > 0 and not flags & ENDED


class SpokenCodes(Scripted):
    """A TTS chunk: `n_tokens` codes (and the one chosen and dropped), sampled at 0.8, EOS masked (a mid-turn
    chunk), so it runs its whole length whatever random weights say."""

    n_hidden = 0

    def __init__(self, n_tokens: int, rng: np.random.Generator) -> None:
        self.row = TtsRow(0.8, False, n_tokens, rng.random(n_tokens + 1))

    def confirm(self, token: int, flags: int) -> bool:
        return not flags & ENDED

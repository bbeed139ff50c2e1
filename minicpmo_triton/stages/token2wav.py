"""token2wav: per session a buffer of speech tokens; emits audio once the lookahead has arrived.

Each turn's buffer starts with 3 silence tokens (as MiniCPM-o's does). Audio for token i needs
tokens up to i + lookahead, so a chunk's last `lookahead` tokens wait for the next chunk or the
turn's end (`finalize`), which pads with silence. Chunks of equal window length share a forward.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..engines import Engine
from ..errors import StepError
from ..model_config import SAMPLES_PER_SPEECH_TOKEN, PresetConfig
from ..stage_io import Token2WavRequest, Token2WavResult
from .base import SequenceStage, StageCall

TURN_LEAD_SILENCE = 3


@dataclass
class Token2WavSession:
    tokens: list[int] = field(default_factory=list)  # left context + everything of the turn
    emitted: int = 0  # index in `tokens` of the first token whose audio is not out yet


class Token2WavStage(SequenceStage[Token2WavRequest, Token2WavResult, Token2WavSession]):
    def __init__(self, engine: Engine, preset: PresetConfig, ttl_s: float) -> None:
        super().__init__(ttl_s)
        self.engine = engine
        self.d = preset.token2wav
        self.speaker_dim = preset.speaker.dim
        self.vocab = preset.tts.num_audio_tokens

    def new_state(self, call: StageCall[Token2WavRequest]) -> Token2WavSession:
        return Token2WavSession()

    def check(self, request: Token2WavRequest, state: Token2WavSession) -> None:
        if len(request.speaker) not in (0, self.speaker_dim):
            raise ValueError(f"token2wav: a speaker embedding has {self.speaker_dim} values")
        if ((request.speech_tokens < 0) | (request.speech_tokens >= self.vocab)).any():
            raise StepError("invalid_input", "token2wav: speech token id out of the vocabulary")
        if not np.isfinite(request.speaker).all():
            raise StepError("invalid_input", "token2wav: the speaker embedding holds NaN or infinite values")

    def is_noop(self, request: Token2WavRequest) -> bool:
        return len(request.speech_tokens) == 0 and not request.finalize and not request.turn_start

    def empty_result(self) -> Token2WavResult:
        return Token2WavResult()

    def _window(self, req: Token2WavRequest, sess: Token2WavSession) -> np.ndarray | None:
        d = self.d
        if req.turn_start or not sess.tokens:
            sess.tokens = [d.silence_token] * (d.left_context + TURN_LEAD_SILENCE)
            sess.emitted = d.left_context
        sess.tokens.extend(int(t) for t in req.speech_tokens)
        end = len(sess.tokens) if req.finalize else len(sess.tokens) - d.lookahead
        if end <= sess.emitted:
            return None
        window = sess.tokens[sess.emitted - d.left_context: end + d.lookahead]
        window += [d.silence_token] * (end + d.lookahead - len(sess.tokens))  # the turn's end: pad
        sess.emitted = end
        if req.finalize:
            sess.tokens, sess.emitted = [], 0
        return np.asarray(window, np.int64)

    def compute(self, items: list[tuple[Token2WavRequest, Token2WavSession]]) -> list[Token2WavResult]:
        results = [Token2WavResult() for _ in items]
        groups: dict[int, list[tuple[int, np.ndarray]]] = defaultdict(list)
        for i, (req, sess) in enumerate(items):
            window = self._window(req, sess)
            if window is not None:
                groups[len(window)].append((i, window))
        speakers = [req.speaker if len(req.speaker) else np.zeros(self.speaker_dim, np.float32) for req, _ in items]
        for rows in groups.values():
            wav = self.engine.run({"tokens": np.stack([w for _, w in rows]),
                                   "speaker": np.stack([speakers[i] for i, _ in rows])})["waveform"]
            for row, (i, _) in enumerate(rows):
                results[i] = Token2WavResult(waveform=wav[row])
        return results

    @staticmethod
    def samples_for(n_tokens: int) -> int:
        return n_tokens * SAMPLES_PER_SPEECH_TOKEN

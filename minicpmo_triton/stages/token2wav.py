"""token2wav: per session a Step-Audio2 stream (flow caches, HiFT caches, tokens awaiting their lookahead).

Each turn restarts from its voice prompt's caches with 3 silence tokens; every 25 tokens + 3 lookahead make
one chunk (1 s of audio), the turn's end (`finalize`) decodes what is left. The chunks of all sessions in a
batch run together (token2wav_stream). A voice prompt is set up once per distinct voice and shared.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import StepError
from ..model_config import PresetConfig
from ..stage_io import Token2WavRequest, Token2WavResult
from .base import SequenceStage, StageCall
from .token2wav_stream import Stream, Token2WavStreamer, VoicePrompt

DEFAULT_VOICE_FILE = "default_voice.npz"  # tokens [T], mel [2T, 80], embedding [192]
PROMPT_CACHE_SIZE = 64


@dataclass
class Token2WavSession:
    stream: Stream | None = None
    voice: bytes = b""  # the key of the voice its stream was set up with
    turn_open: bool = False


class VoicePrompts:
    """Voice prompts by voice key, set up once and shared by every session with that voice (LRU-bounded)."""

    def __init__(self, streamer: Token2WavStreamer, tokens: np.ndarray, mel: np.ndarray, embedding: np.ndarray):
        self.streamer = streamer
        self.default = (tokens, mel, embedding)
        self._prompts: OrderedDict[bytes, VoicePrompt] = OrderedDict()
        self._lock = threading.Lock()
        self.setups = 0  # prompts computed (a reused voice does not add)

    @staticmethod
    def key(speaker: np.ndarray) -> bytes:
        return hashlib.sha256(np.ascontiguousarray(speaker, np.float32).tobytes()).digest()

    def get(self, speaker: np.ndarray) -> tuple[bytes, VoicePrompt]:
        key = self.key(speaker)
        with self._lock:
            if key in self._prompts:
                self._prompts.move_to_end(key)
                return key, self._prompts[key]
        tokens, mel, embedding = self.default
        prompt = self.streamer.setup(tokens, mel, speaker if len(speaker) else embedding)
        with self._lock:
            self._prompts[key] = prompt
            self.setups += 1
            while len(self._prompts) > PROMPT_CACHE_SIZE:
                self._prompts.popitem(last=False)
        return key, prompt


class Token2WavStage(SequenceStage[Token2WavRequest, Token2WavResult, Token2WavSession]):
    def __init__(self, streamer: Token2WavStreamer, prompts: VoicePrompts, preset: PresetConfig,
                 ttl_s: float) -> None:
        super().__init__(ttl_s)
        self.streamer = streamer
        self.prompts = prompts
        self.d = preset.token2wav
        self.speaker_dim = preset.speaker.dim
        self.vocab = preset.token2wav.vocab

    @classmethod
    def load(cls, folder: Path, preset: PresetConfig, ttl_s: float, threads: int = 1) -> Token2WavStage:
        streamer = Token2WavStreamer.load(folder, preset.token2wav, threads)
        with np.load(folder / DEFAULT_VOICE_FILE) as v:
            prompts = VoicePrompts(streamer, v["tokens"], v["mel"], v["embedding"])
        return cls(streamer, prompts, preset, ttl_s)

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

    def _chunks(self, req: Token2WavRequest, sess: Token2WavSession) -> list[tuple[list[int], bool]]:
        """The chunks this request completes: 25 tokens + 3 lookahead each, then what is left at the turn's end."""
        d = self.d
        if req.turn_start or not sess.turn_open or sess.stream is None:
            key, prompt = self.prompts.get(np.asarray(req.speaker, np.float32))
            if sess.stream is None or key != sess.voice:
                sess.stream, sess.voice = self.streamer.new_stream(prompt), key
            self.streamer.restart(sess.stream)
            sess.turn_open = True
        pending = sess.stream.pending
        pending.extend(int(t) for t in req.speech_tokens)
        chunks = []
        while len(pending) >= d.chunk_tokens + d.lookahead:
            chunks.append((pending[: d.chunk_tokens + d.lookahead], False))
            del pending[: d.chunk_tokens]
        if req.finalize:
            chunks.append((list(pending), True))
            pending.clear()
            sess.turn_open = False
        return chunks

    def compute(self, items: list[tuple[Token2WavRequest, Token2WavSession]]) -> list[Token2WavResult]:
        work = [self._chunks(req, sess) for req, sess in items]
        audio: list[list[np.ndarray]] = [[] for _ in items]
        for r in range(max((len(w) for w in work), default=0)):  # round r: every session's r-th chunk, batched
            rows = [(i, w[r]) for i, w in enumerate(work) if r < len(w)]
            out = self.streamer.chunk([(items[i][1].stream, toks, last) for i, (toks, last) in rows])
            for (i, _), wav in zip(rows, out, strict=True):
                audio[i].append(wav)
        return [Token2WavResult(np.concatenate(a) if a else np.zeros(0, np.float32)) for a in audio]

    def state_bytes(self, corr_id: int) -> int:
        sess = self.store.get(corr_id)
        return 0 if sess.stream is None else sess.stream.nbytes

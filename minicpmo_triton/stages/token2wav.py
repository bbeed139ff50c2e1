"""token2wav: per session a Step-Audio2 stream (flow caches, HiFT caches, tokens awaiting their lookahead).

Each turn restarts from its voice prompt's caches with 3 silence tokens. Each call flushes what it can, as
MiniCPM-o's duplex demo does (`_generate_waveform_from_tokens` with `force_flush`, always on in
MiniCPMO45/modeling_minicpmo_unified.py:5196): chunks of up to 25 tokens + 3 lookahead while 8 or more are
buffered, and a call's audio short of 1 s is left-padded with silence to 1 s (not at the turn's end); the turn's
end (`finalize`) decodes what is left. The chunks of all sessions in a batch run together (token2wav_stream).
A voice prompt is set up once per distinct voice and shared.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import Code, StepError
from ..model_config import PresetConfig, Token2WavDims
from ..stage_io import Token2WavRequest, Token2WavResult
from .base import SequenceStage, StageCall
from .token2wav_stream import Streamer, Token2WavStreamer
from .voice_prompt import SAMPLE_RATE, VoiceFeatures, VoiceFeaturizer, read_wav

DEFAULT_VOICE_WAV = "default_voice.wav"  # the checkpoint's own reference voice, where it ships one
DEFAULT_VOICE_FILE = "default_voice.npz"  # else the export's prompt: tokens [T], mel [2T, 80], embedding [192]
# Voice prompts kept (LRU), by their flow caches' bytes: ~0.28 MB per second of reference at tiny's dims, ~66 MB
# at the real ones (the estimator's attention cache: 5 steps x 16 layers x 2 (CFG) x 8 heads x 256 x 4 B per frame).
PROMPT_CACHE_MB = 2048
MIN_VOICE_SAMPLES = SAMPLE_RATE // 2  # the gateway refuses references under 0.5 s
DEFAULT_KEY = b"default"
FLUSH_MIN_NEW = 5  # a forced flush leaves a chunk for later while fewer than lookahead + this are buffered
MIN_CALL_SAMPLES = 24_000  # a call's audio at 24 kHz, unless the turn ends, is at least 1 s (left-padded with silence)


def take_chunks(pending: list[int], d: Token2WavDims, flush: bool = True) -> list[list[int]]:
    """The chunks (tokens with their lookahead) the buffered tokens make now; consumed tokens leave `pending`.
    `flush`: MiniCPM-o's forced flush (modeling_minicpmo_unified.py:5479-5488): while lookahead + 5 are
    buffered, a chunk of up to 25 + 3, keeping its 3 lookahead; else whole chunks only (:5490-5496)."""
    chunks = []
    if flush:
        while len(pending) >= d.lookahead + FLUSH_MIN_NEW:
            n = min(d.chunk_tokens + d.lookahead, len(pending))
            chunks.append(pending[:n])
            del pending[: min(d.chunk_tokens, n - d.lookahead)]
    while len(pending) >= d.chunk_tokens + d.lookahead:
        chunks.append(pending[: d.chunk_tokens + d.lookahead])
        del pending[: d.chunk_tokens]
    return chunks


@dataclass
class Token2WavSession:
    stream: Any = None  # the streamer's (token2wav_stream.Stream, token2wav_device.SlotStream)
    voice: bytes = b""  # the key of the voice its stream was set up with
    turn_open: bool = False


class VoicePrompts:
    """Voice prompts by the hash of their reference audio: the S3 tokens, prompt mel and CAM++ vector and the
    flow's setup from them are computed once per distinct voice and shared by every session with it (LRU)."""

    def __init__(self, streamer: Streamer, featurize: Callable[[np.ndarray], VoiceFeatures],
                 default: VoiceFeatures, budget_bytes: int = PROMPT_CACHE_MB << 20) -> None:
        self.streamer = streamer
        self.featurize = featurize
        self.default = default
        self.budget_bytes = budget_bytes
        self._prompts: OrderedDict[bytes, Any] = OrderedDict()  # the streamer's prompts
        self._unclaimed: set[bytes] = set()  # prepared ahead (`prepare`), not yet taken by a session
        self._lock = threading.Lock()
        self.computed = 0  # prompts computed
        self.reused = 0  # sessions given a prompt already computed
        self.nbytes = 0  # held by the prompts kept

    def has(self, key: bytes) -> bool:
        with self._lock:
            return key in self._prompts

    def get(self, key: bytes, audio: np.ndarray | None) -> Any:
        """The prompt of a reference by its key (`audio_key`; audio None: the default voice, DEFAULT_KEY)."""
        with self._lock:
            prompt = self._prompts.get(key)
            if prompt is not None:
                self._prompts.move_to_end(key)
                if key in self._unclaimed:  # prepared for this session ahead of its step: not a reuse
                    self._unclaimed.discard(key)
                else:
                    self.reused += 1
                return prompt
        return self._compute(key, audio)

    def prepare(self, key: bytes, audio: np.ndarray) -> None:
        """Compute a reference's prompt ahead of the step that uses it (off the batch: `VoicePreparer`); the first
        session to `get` it takes it as computed for it, not reused."""
        self._compute(key, audio, unclaimed=True)

    def _compute(self, key: bytes, audio: np.ndarray | None, unclaimed: bool = False) -> Any:
        f = self.default if audio is None else self.featurize(audio)
        prompt = self.streamer.setup(f.tokens, f.mel, f.embedding)
        with self._lock:
            self._prompts[key] = prompt
            if unclaimed:
                self._unclaimed.add(key)
            self.computed += 1
            self.nbytes += prompt.nbytes
            while self.nbytes > self.budget_bytes and len(self._prompts) > 1:  # the newest always stays
                old, dropped = self._prompts.popitem(last=False)
                self._unclaimed.discard(old)
                self.nbytes -= dropped.nbytes
                self.streamer.forget(dropped)  # the device path's voice slot goes once no stream has it
        return prompt


def voice_problem(voice: np.ndarray) -> StepError | None:
    """Why a voice reference (16 kHz; empty: none given) cannot be used, or None."""
    if 0 < len(voice) < MIN_VOICE_SAMPLES:
        return StepError(Code.INVALID_VOICE, f"token2wav: a voice reference needs {MIN_VOICE_SAMPLES} samples (16 kHz)")
    if not np.isfinite(voice).all():
        return StepError(Code.INVALID_VOICE, "token2wav: the voice reference holds NaN or infinite samples")
    return None


class Token2WavStage(SequenceStage[Token2WavRequest, Token2WavResult, Token2WavSession]):
    def __init__(self, streamer: Streamer, prompts: VoicePrompts, preset: PresetConfig,
                 ttl_s: float) -> None:
        super().__init__(ttl_s)
        self.flush = True  # the duplex demo's forced flush; False: whole 25 + 3 chunks only (for comparison)
        self.streamer = streamer
        self.prompts = prompts
        self.d = preset.token2wav
        self.vocab = preset.token2wav.vocab

    @classmethod
    def load(cls, folder: Path, preset: PresetConfig, ttl_s: float, threads: int = 1,
             prompt_cache_mb: float = PROMPT_CACHE_MB, streamer: Streamer | None = None) -> Token2WavStage:
        """`streamer`: the device path's (token2wav_device.DeviceStreamer) where the instance runs on a device;
        by default the host path (numpy + ONNX Runtime)."""
        streamer = streamer or Token2WavStreamer.load(folder, preset.token2wav, threads)
        featurize = VoiceFeaturizer.load(folder, threads)
        if (folder / DEFAULT_VOICE_WAV).exists():
            default = featurize(read_wav(folder / DEFAULT_VOICE_WAV))
        else:
            with np.load(folder / DEFAULT_VOICE_FILE) as v:
                default = VoiceFeatures(v["tokens"], v["mel"], v["embedding"])
        prompts = VoicePrompts(streamer, featurize, default, int(prompt_cache_mb * (1 << 20)))
        return cls(streamer, prompts, preset, ttl_s)

    def new_state(self, call: StageCall[Token2WavRequest]) -> Token2WavSession:
        return Token2WavSession()

    def check(self, request: Token2WavRequest, state: Token2WavSession) -> None:
        if ((request.speech_tokens < 0) | (request.speech_tokens >= self.vocab)).any():
            raise StepError(Code.INVALID_INPUT, "token2wav: speech token id out of the vocabulary")
        problem = voice_problem(request.voice)
        if problem is not None:
            raise problem

    def new_voice(self, request: Token2WavRequest) -> tuple[bytes, np.ndarray] | None:
        """A usable reference whose prompt is not computed yet (its key and audio): `VoicePreparer` computes it
        before the call runs. None: the call runs now (no reference, a known one, or one `check` refuses)."""
        if len(request.voice) == 0 or voice_problem(request.voice) is not None:
            return None
        key = request.voice_key
        return None if self.prompts.has(key) else (key, np.asarray(request.voice, np.float32))

    def is_noop(self, request: Token2WavRequest) -> bool:
        return len(request.speech_tokens) == 0 and not request.finalize and not request.turn_start

    def empty_result(self) -> Token2WavResult:
        return Token2WavResult()

    def plan(self, req: Token2WavRequest, sess: Token2WavSession) -> tuple[Any, list[tuple[list[int], bool]]]:
        """The session's stream, and the chunks this request completes (`take_chunks`), then what is left at
        the turn's end."""
        voice = np.asarray(req.voice, np.float32) if len(req.voice) else None
        if voice is not None:
            key = req.voice_key  # hashed once: `new_voice` asked first
        else:
            key = DEFAULT_KEY if req.default_voice else sess.voice or DEFAULT_KEY
        if sess.stream is None or key != sess.voice:  # a session's voice is set once, and again when it changes
            prompt = self.prompts.get(key, voice)
            if sess.stream is not None:
                self.streamer.close(sess.stream)
            sess.stream, sess.voice, sess.turn_open = self.streamer.new_stream(prompt), key, False
        if req.turn_start or not sess.turn_open:
            self.streamer.restart(sess.stream)
            sess.turn_open = True
        pending = sess.stream.pending
        pending.extend(int(t) for t in req.speech_tokens)
        chunks = [(c, False) for c in take_chunks(pending, self.d, self.flush)]
        if req.finalize:
            chunks.append((list(pending), True))
            pending.clear()
            sess.turn_open = False
        return sess.stream, chunks

    def compute(self, items: list[tuple[Token2WavRequest, Token2WavSession]]) -> list[Token2WavResult]:
        prepared = [self.plan(req, sess) for req, sess in items]
        streams = [stream for stream, _ in prepared]
        work = [chunks for _, chunks in prepared]
        audio: list[list[np.ndarray]] = [[] for _ in items]
        for r in range(max((len(w) for w in work), default=0)):  # round r: every session's r-th chunk, batched
            rows = [(i, w[r]) for i, w in enumerate(work) if r < len(w)]
            out = self.streamer.chunk([(streams[i], toks, last) for i, (toks, last) in rows])
            for (i, _), wav in zip(rows, out, strict=True):
                audio[i].append(wav)
        return [self.result(req, a) for (req, _), a in zip(items, audio, strict=True)]

    @staticmethod
    def result(req: Token2WavRequest, pieces: list[np.ndarray]) -> Token2WavResult:
        """A call's audio from its chunks' pieces: short of 1 s (unless the turn ends) left-padded with silence,
        as the demo's `_generate_waveform_from_tokens` pads it (modeling_minicpmo_unified.py:5521-5525)."""
        wav = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        if pieces and not req.finalize and len(wav) < MIN_CALL_SAMPLES:
            wav = np.pad(wav, (MIN_CALL_SAMPLES - len(wav), 0))
        return Token2WavResult(wav)

    def drop_state(self, state: Token2WavSession) -> None:
        """END, eviction, a restarted sequence: the device path's slots go back (`close`)."""
        if state.stream is not None:
            self.streamer.close(state.stream)

    def state_bytes(self, corr_id: int) -> int:
        sess = self.store.get(corr_id)
        return 0 if sess.stream is None else sess.stream.nbytes

"""The TTS stage: per session a KV cache that lives for one spoken turn; 25 speech tokens per chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..engines import Engine
from ..errors import StepError
from ..kv_batch import KvCache
from ..model_config import PresetConfig
from ..sampling import SamplingParams, apply_repetition_penalty, check_sampling, sample, seeded_rng
from ..stage_io import TtsRequest, TtsResult
from .base import SequenceStage, StageCall
from .decode_loop import batched_decode

MAX_TOKENS_PER_CALL = 2048  # about 80 s of speech: far over a chunk's 25 or a chat chunk's share


@dataclass
class TtsSession:
    cache: KvCache
    rng: np.random.Generator
    pending: int | None = None  # the last speech token, fed at the start of the next chunk
    history: list[int] = field(default_factory=list)


class TtsStage(SequenceStage[TtsRequest, TtsResult, TtsSession]):
    def __init__(self, engine: Engine, preset: PresetConfig, ttl_s: float) -> None:
        super().__init__(ttl_s)
        self.engine = engine
        self.preset = preset
        d = preset.tts.decoder
        self._empty = lambda: KvCache.empty(d.layers, d.kv_heads, d.head_dim)  # noqa: E731
        self.eos = preset.tts.num_audio_tokens - 1

    def new_state(self, call: StageCall[TtsRequest]) -> TtsSession:
        return TtsSession(self._empty(), seeded_rng(call.request.seed, call.corr_id))

    def is_noop(self, request: TtsRequest) -> bool:
        return len(request.text_ids) == 0 and not request.turn_start and request.n_tokens == 0

    def empty_result(self) -> TtsResult:
        return TtsResult()

    def _prefill(self, req: TtsRequest, sess: TtsSession) -> dict[str, np.ndarray]:
        h = self.preset.llm.hidden
        n_text = len(req.text_ids)
        text = list(req.text_ids) + ([self.preset.tokens.tts_bos] if req.turn_start else [])
        hidden = np.zeros((len(text), h), np.float32)
        hidden[:n_text] = req.tts_hidden
        codes = np.zeros(len(text), np.int64)
        is_code = np.zeros(len(text), bool)
        if sess.pending is not None:
            text, codes = [0, *text], np.concatenate([[sess.pending], codes])
            hidden = np.concatenate([np.zeros((1, h), np.float32), hidden])
            is_code = np.concatenate([[True], is_code])
        return {"text_ids": np.asarray(text, np.int64), "llm_hidden": hidden, "code_ids": codes, "is_code": is_code}

    def check(self, request: TtsRequest, state: TtsSession) -> None:
        if len(request.tts_hidden) != len(request.text_ids):
            raise ValueError(f"tts: {len(request.text_ids)} text ids but {len(request.tts_hidden)} hidden states")
        if len(request.speaker) not in (0, self.preset.speaker.dim):
            raise ValueError(f"tts: a speaker embedding has {self.preset.speaker.dim} values")
        if not (request.turn_start or len(request.text_ids) or state.pending is not None):
            raise ValueError("tts: nothing to condition on (no text, no pending token, not a turn start)")
        if ((request.text_ids < 0) | (request.text_ids >= self.preset.tts.num_text_tokens)).any():
            raise StepError("invalid_input", "tts: text token id out of the vocabulary")
        if not (np.isfinite(request.tts_hidden).all() and np.isfinite(request.speaker).all()):
            raise StepError("invalid_input", "tts: hidden states or speaker hold NaN or infinite values")
        if not 0 <= request.n_tokens <= MAX_TOKENS_PER_CALL:
            raise StepError("invalid_input", f"tts: n_tokens must be within [0, {MAX_TOKENS_PER_CALL}]")
        check_sampling("tts", temperature=request.temperature)

    def _speaker(self, req: TtsRequest) -> np.ndarray:
        return req.speaker if len(req.speaker) else np.zeros(self.preset.speaker.dim, np.float32)

    def compute(self, items: list[tuple[TtsRequest, TtsSession]]) -> list[TtsResult]:
        for req, sess in items:
            if req.turn_start:
                sess.cache, sess.pending, sess.history = self._empty(), None, []
        prefill = [self._prefill(req, sess) for req, sess in items]
        speakers = np.stack([self._speaker(req) for req, _ in items])
        codes: list[list[int]] = [[] for _ in items]

        def choose(row: int, out: dict[str, np.ndarray]) -> int | None:
            req, sess = items[row]
            if len(codes[row]) >= req.n_tokens:
                return None
            logits = out["logits"].astype(np.float32)
            if not req.turn_end:
                logits[self.eos] = -np.inf  # a chunk mid-turn is always a full second
            apply_repetition_penalty(logits, sess.history, 1.05, 512)
            token = sample(logits, SamplingParams(req.temperature, 20, 1.0, 1.0), sess.rng)
            if token == self.eos:
                sess.pending = None
                return None
            codes[row].append(token)
            sess.history.append(token)
            if len(codes[row]) == req.n_tokens:
                sess.pending = token  # fed with the next chunk, not now
                return None
            return token

        def step_feeds(rows: list[int], tokens: list[int]) -> dict[str, np.ndarray]:
            n = len(rows)
            return {"text_ids": np.zeros((n, 1), np.int64),
                    "llm_hidden": np.zeros((n, 1, self.preset.llm.hidden), np.float32),
                    "code_ids": np.array(tokens, np.int64)[:, None], "is_code": np.ones((n, 1), bool),
                    "speaker": speakers[rows]}

        caches, _ = batched_decode(self.engine, [s.cache for _, s in items], prefill, step_feeds, choose,
                                   ("logits",), constant_feeds={"speaker": speakers})
        results = []
        for (req, sess), cache, row_codes in zip(items, caches, codes, strict=True):
            sess.cache = cache
            if req.turn_end:
                sess.pending = None
            results.append(TtsResult(speech_tokens=np.asarray(row_codes, np.int64), kv_length=cache.length))
        return results

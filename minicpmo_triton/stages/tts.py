"""The TTS stage: per session a KV cache that lives for one spoken turn; 25 speech tokens per chunk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ..engines import Engine
from ..errors import Code, StepError
from ..kv_batch import KvCache
from ..model_config import SPEECH_TOKENS_PER_SECOND, PresetConfig
from ..sampling import SamplingParams, apply_repetition_penalty, check_sampling, sample, seeded_rng
from ..stage_io import TtsRequest, TtsResult
from .base import SequenceStage, StageCall
from .decode_loop import batched_decode
from .llm import PagedCache

if TYPE_CHECKING:  # torch: imported where the paged engine is built, not by every host of this stage
    from ..paged.tts import PagedTtsEngine

MAX_TOKENS_PER_CALL = 2048  # about 80 s of speech: far over a chunk's 25 or a chat chunk's share
TURN_TOKENS = 32_768  # the paged pool's longest turn (about 15 minutes of speech; a turn's cache is its only one)


def tts_admit_tokens(preset: PresetConfig) -> int:
    """The paged pool's room a session is admitted with and keeps between turns: one spoken second (its text,
    audio_bos and 25 codes)."""
    return preset.duplex.max_new_speak_tokens_per_chunk + 1 + SPEECH_TOKENS_PER_SECOND


@dataclass
class TtsSession:
    cache: KvCache | PagedCache  # PagedCache: its place in the paged engine's pool
    rng: np.random.Generator


class TtsStage(SequenceStage[TtsRequest, TtsResult, TtsSession]):
    """MiniCPM-o 4.5's duplex TTS, per chunk as `DuplexCapability` + `MiniCPMTTS.generate_chunk` do it
    (OpenBMB/MiniCPM-o-Demo `MiniCPMO45/modeling_minicpmo_unified.py`):

    - the condition is [emb_text(id) + L2norm(projector_semantic(h)) per text token, emb_text(audio_bos)]
      (`_convert_results_to_tts_input`), after the turn's cache (positions continue within the turn);
    - up to `n_tokens + 1` codes are sampled; each but the last is fed back and returned, the last
      (the 26th, or the speech EOS) is dropped: 25 codes = 1 s per chunk;
    - EOS is forbidden until `n_tokens + 1` codes (min_new_tokens 26) except at a turn's start or end;
    - temperature, then the repetition penalty (1.05 per occurrence over the chunk's last 16 codes),
      then top-k 20 / top-p 0.7;
    - the cache is dropped at the turn's end.

    Departure: a turn whose next chunk would run past the TTS's position table (`max_positions`, 4096: about
    90 s of speech) starts its cache over, as a new turn would. The reference keeps `tts_past_key_values` until a
    voiced `<|turn_eos|>` (modeling_minicpmo_unified.py:5218-5227) and forced listens leave the turn open, so a
    caller who keeps cutting the model off would grow the cache, and the positions, for the whole call.
    """

    def __init__(self, engine: Engine | PagedTtsEngine, preset: PresetConfig, ttl_s: float) -> None:
        super().__init__(ttl_s)
        # the paged engine keeps every session's turn cache in its pool; ONNX takes it in each call
        self.paged = cast("PagedTtsEngine", engine) if getattr(engine, "name", "") == "paged" else None
        self.engine = cast(Engine, engine)  # used only where self.paged is None
        self.preset = preset
        d = preset.tts.decoder
        self._empty = lambda: KvCache.empty(d.layers, d.kv_heads, d.head_dim)
        self.eos = preset.tts.num_audio_tokens - 1
        self.admit_tokens = tts_admit_tokens(preset)

    def new_state(self, call: StageCall[TtsRequest]) -> TtsSession:
        rng = seeded_rng(call.request.seed, call.corr_id)
        if self.paged is not None:
            return TtsSession(PagedCache(self.paged.pool.open(self.admit_tokens), 0), rng)
        return TtsSession(self._empty(), rng)

    def drop_state(self, state: TtsSession) -> None:
        if isinstance(state.cache, PagedCache) and self.paged is not None:
            self.paged.pool.free(state.cache.seq)

    def _reset(self, cache: KvCache | PagedCache, release: bool) -> KvCache | PagedCache:
        """A turn's start or end: an empty cache. `release` (a turn's end): the pool keeps the session's admission
        room, the rest goes back (at a turn's start the blocks its check reserved are kept for the chunk)."""
        if isinstance(cache, PagedCache) and self.paged is not None:
            if release:
                self.paged.pool.truncate(cache.seq, 0)
            return cache.truncated(0)
        return self._empty()

    def is_noop(self, request: TtsRequest) -> bool:
        return request.n_tokens == 0

    def empty_result(self) -> TtsResult:
        return TtsResult()

    def _prefill(self, req: TtsRequest) -> dict[str, np.ndarray]:
        """[text tokens with their LLM hidden states..., audio_bos]."""
        n = len(req.text_ids)
        hidden = np.zeros((n + 1, self.preset.llm.hidden), np.float32)
        hidden[:n] = req.tts_hidden
        return {"text_ids": np.asarray([*req.text_ids, self.preset.tts.audio_bos_token_id], np.int64),
                "llm_hidden": hidden, "has_hidden": np.arange(n + 1) < n,
                "code_ids": np.zeros(n + 1, np.int64), "is_code": np.zeros(n + 1, bool)}

    def opens_turn(self, request: TtsRequest, state: TtsSession) -> bool:
        """The chunk starts from an empty cache: a turn's start, or the turn's positions would run out."""
        need = len(request.text_ids) + 1 + request.n_tokens
        return request.turn_start or state.cache.length + need > self.preset.tts.max_positions

    def check(self, request: TtsRequest, state: TtsSession) -> None:
        if len(request.tts_hidden) != len(request.text_ids):
            raise ValueError(f"tts: {len(request.text_ids)} text ids but {len(request.tts_hidden)} hidden states")
        if ((request.text_ids < 0) | (request.text_ids >= self.preset.tts.num_text_tokens)).any():
            raise StepError(Code.INVALID_INPUT, "tts: text token id out of the vocabulary")
        if not np.isfinite(request.tts_hidden).all():
            raise StepError(Code.INVALID_INPUT, "tts: hidden states hold NaN or infinite values")
        if not 0 <= request.n_tokens <= MAX_TOKENS_PER_CALL:
            raise StepError(Code.INVALID_INPUT, f"tts: n_tokens must be within [0, {MAX_TOKENS_PER_CALL}]")
        check_sampling("tts", temperature=request.temperature)
        if isinstance(state.cache, PagedCache) and self.paged is not None:  # refused now (pool_full), never mid-step
            past = 0 if self.opens_turn(request, state) else state.cache.length
            self.paged.pool.reserve(state.cache.seq, past + len(request.text_ids) + 1 + request.n_tokens)

    def compute(self, items: list[tuple[TtsRequest, TtsSession]]) -> list[TtsResult]:
        dx = self.preset.duplex
        opens = [self.opens_turn(req, sess) for req, sess in items]
        for (_, sess), opened in zip(items, opens, strict=True):
            if opened:
                sess.cache = self._reset(sess.cache, release=False)
        prefill = [self._prefill(req) for req, _ in items]
        codes: list[list[int]] = [[] for _ in items]

        def choose(row: int, row_logits: np.ndarray) -> int | None:
            req, sess = items[row]
            logits = row_logits.astype(np.float32)
            if req.temperature > 0:
                logits /= req.temperature
            apply_repetition_penalty(logits, codes[row], dx.tts_repetition_penalty, dx.tts_repetition_window,
                                     per_occurrence=True)
            if not (opens[row] or req.turn_end):
                logits[self.eos] = -np.inf  # min_new_tokens = n_tokens + 1 mid-turn: a chunk is a full second
            token = sample(logits, SamplingParams(1.0 if req.temperature > 0 else 0.0, dx.tts_top_k, dx.tts_top_p),
                           sess.rng)
            if token == self.eos or len(codes[row]) == req.n_tokens:
                return None  # the EOS, or the (n_tokens + 1)-th code: sampled, never fed nor returned
            codes[row].append(token)
            return token

        def step_feeds(rows: list[int], tokens: list[int]) -> dict[str, np.ndarray]:
            n = len(rows)
            return {"text_ids": np.zeros((n, 1), np.int64),
                    "llm_hidden": np.zeros((n, 1, self.preset.llm.hidden), np.float32),
                    "has_hidden": np.zeros((n, 1), bool),
                    "code_ids": np.array(tokens, np.int64)[:, None], "is_code": np.ones((n, 1), bool)}

        caches: list[KvCache | PagedCache]
        if self.paged is not None:
            caches = self._paged_decode(items, prefill, choose)
        else:
            caches = list(batched_decode(self.engine, [cast(KvCache, s.cache) for _, s in items], prefill, step_feeds,
                                         lambda row, out: choose(row, out["logits"]), ("logits",))[0])
        results = []
        for (req, sess), cache, row_codes in zip(items, caches, codes, strict=True):
            sess.cache = self._reset(cache, release=True) if req.turn_end else cache
            results.append(TtsResult(speech_tokens=np.asarray(row_codes, np.int64), kv_length=cache.length))
        return results

    def _paged_decode(self, items: list[tuple[TtsRequest, TtsSession]], prefill: list[dict[str, np.ndarray]],
                      choose: Callable[[int, np.ndarray], int | None]) -> list[KvCache | PagedCache]:
        """The same decode on the paged engine: the caches stay in its pool, each session's blocks past its new
        length go back after the chunk."""
        from ..paged.tts import TtsFeed

        assert self.paged is not None
        pool = self.paged.pool
        feeds = [TtsFeed(p["text_ids"], p["llm_hidden"][p["has_hidden"]], p["has_hidden"], p["code_ids"],
                         p["is_code"]) for p in prefill]
        cached = [s.cache for _, s in items]
        assert all(isinstance(c, PagedCache) for c in cached)
        seqs = [c.seq for c in cached]  # type: ignore[union-attr]
        lengths = self.paged.run(seqs, [c.length for c in cached], feeds, choose)
        for seq, n in zip(seqs, lengths, strict=True):
            pool.truncate(seq, n)
        return [PagedCache(seq, n) for seq, n in zip(seqs, lengths, strict=True)]

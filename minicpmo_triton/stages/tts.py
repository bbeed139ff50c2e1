"""The TTS stage: per session a KV cache that lives for one spoken turn; 25 speech tokens per chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ..engines import Engine
from ..errors import Code, StepError
from ..kv_batch import KvCache
from ..model_config import SPEECH_TOKENS_PER_SECOND, PresetConfig
from ..paged.protocol import TtsPick, TtsRules
from ..sampling import (
    SamplingParams,
    apply_repetition_penalty,
    check_sampling,
    sample,
    sampling_problems,
    seeded_rng,
)
from ..stage_io import TtsRequest, TtsResult
from .base import SequenceStage, StageCall
from .decode_loop import batched_decode
from .llm import PagedCache

if TYPE_CHECKING:  # torch: imported where the paged engine is built, not by every host of this stage
    from ..paged.tts import PagedTtsEngine, TtsFeed

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
    - temperature, then the repetition penalty (1.05 per occurrence over the chunk's last 16 codes), then
      the draw from the whole distribution: the reference builds top-k 20 / top-p 0.7 warpers and never applies
      them (:6711, 6788-6822); `top_k` / `top_p` (the `tts_top_k` / `tts_top_p` settings) turn them on;
    - the cache is dropped at the turn's end.

    Departure: a turn whose next chunk would run past the TTS's position table (`max_positions`, 4096: about
    90 s of speech) starts its cache over, as a new turn would. The reference keeps `tts_past_key_values` until a
    voiced `<|turn_eos|>` (modeling_minicpmo_unified.py:5218-5227) and forced listens leave the turn open, so a
    caller who keeps cutting the model off would grow the cache, and the positions, for the whole call.
    """

    def __init__(self, engine: Engine | PagedTtsEngine, preset: PresetConfig, ttl_s: float,
                 top_k: int | None = None, top_p: float | None = None) -> None:
        super().__init__(ttl_s)
        dx = preset.duplex
        self.top_k = dx.tts_top_k if top_k is None else top_k  # 0 / 1.0: off (the reference's draw)
        self.top_p = dx.tts_top_p if top_p is None else top_p
        if problems := sampling_problems(1.0, self.top_k, self.top_p):
            raise ValueError(f"tts: {problems}")
        # the paged engine keeps every session's turn cache in its pool; ONNX takes it in each call
        self.paged = cast("PagedTtsEngine", engine) if getattr(engine, "name", "") == "paged" else None
        self.engine = cast(Engine, engine)  # used only where self.paged is None
        self.preset = preset
        d = preset.tts.decoder
        self._empty = lambda: KvCache.empty(d.layers, d.kv_heads, d.head_dim)
        self.eos = preset.tts.num_audio_tokens - 1
        self.admit_tokens = tts_admit_tokens(preset)
        if self.paged is not None:
            self.paged.use_rules(self.rules())

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

    def rules(self) -> TtsRules:
        dx = self.preset.duplex
        return TtsRules(self.eos, self.top_k, self.top_p, dx.tts_repetition_penalty)

    def begin(self, req: TtsRequest, sess: TtsSession) -> tuple[bool, dict[str, np.ndarray]]:
        """A chunk's start: whether it opens a turn (its cache reset), and its prefill."""
        opened = self.opens_turn(req, sess)
        if opened:
            sess.cache = self._reset(sess.cache, release=False)
        return opened, self._prefill(req)

    def finish(self, req: TtsRequest, sess: TtsSession, cache: KvCache | PagedCache, codes: list[int]) -> TtsResult:
        """A chunk's end: the session's cache (dropped at a turn's end) and the chunk's codes."""
        sess.cache = self._reset(cache, release=True) if req.turn_end else cache
        return TtsResult(speech_tokens=np.asarray(codes, np.int64), kv_length=cache.length)

    def compute(self, items: list[tuple[TtsRequest, TtsSession]]) -> list[TtsResult]:
        rows = TtsRows(self)
        prefill = []
        for req, sess in items:
            opened, pre = self.begin(req, sess)
            rows.add(req, sess, opened)
            prefill.append(pre)

        def step_feeds(rows: list[int], tokens: list[int]) -> dict[str, np.ndarray]:
            n = len(rows)
            return {"text_ids": np.zeros((n, 1), np.int64),
                    "llm_hidden": np.zeros((n, 1, self.preset.llm.hidden), np.float32),
                    "has_hidden": np.zeros((n, 1), bool),
                    "code_ids": np.array(tokens, np.int64)[:, None], "is_code": np.ones((n, 1), bool)}

        caches: list[KvCache | PagedCache]
        if self.paged is not None:
            caches = self._paged_decode(items, prefill, rows)
        else:
            caches = list(batched_decode(self.engine, [cast(KvCache, s.cache) for _, s in items], prefill, step_feeds,
                                         lambda row, out: rows.choose(row, out["logits"]), ("logits",))[0])
        return [self.finish(req, sess, cache, row_codes)
                for (req, sess), cache, row_codes in zip(items, caches, rows.codes, strict=True)]

    def feeds(self, prefill: list[dict[str, np.ndarray]]) -> list[TtsFeed]:
        from ..paged.tts import TtsFeed

        return [TtsFeed(p["text_ids"], p["llm_hidden"][p["has_hidden"]], p["has_hidden"], p["code_ids"],
                        p["is_code"]) for p in prefill]

    def _paged_decode(self, items: list[tuple[TtsRequest, TtsSession]], prefill: list[dict[str, np.ndarray]],
                      rows: TtsRows) -> list[KvCache | PagedCache]:
        """The same decode on the paged engine, each code chosen on the device: the caches stay in its pool, each
        session's blocks past its new length go back after the chunk."""
        assert self.paged is not None
        cached = [s.cache for _, s in items]
        assert all(isinstance(c, PagedCache) for c in cached)
        seqs = [c.seq for c in cached]  # type: ignore[union-attr]
        lengths, _ = self.paged.run(seqs, [c.length for c in cached], self.feeds(prefill), rows)
        for seq, n in zip(seqs, lengths, strict=True):
            self.paged.pool.truncate(seq, n)
        return [PagedCache(seq, n) for seq, n in zip(seqs, lengths, strict=True)]


class TtsRows:
    """The TTS's rules per row of a decode: on the host (`choose`: today's path, the logits on the host) or as a
    `TtsPick` for the device (`pick`), and the same `accept` for both. The rules (`generate_chunk`,
    modeling_minicpmo_unified.py:6792-6816): temperature, then the repetition penalty (per occurrence over the
    chunk's last codes), EOS forbidden mid-turn until the chunk is a full second, then the draw (top-k / top-p
    only when the stage's settings turn them on)."""

    def __init__(self, stage: TtsStage) -> None:
        self.stage = stage
        self.items: list[tuple[TtsRequest, TtsSession]] = []
        self.opens: list[bool] = []
        self.codes: list[list[int]] = []

    def add(self, req: TtsRequest, sess: TtsSession, opened: bool) -> None:
        self.items.append((req, sess))
        self.opens.append(opened)
        self.codes.append([])

    def allow_eos(self, row: int) -> bool:
        return self.opens[row] or self.items[row][0].turn_end  # min_new_tokens = n_tokens + 1 mid-turn

    def adjusted(self, row: int, row_logits: np.ndarray) -> np.ndarray:
        """The row's logits as `sample` takes them: temperature, penalty, the EOS mask (float32)."""
        req = self.items[row][0]
        dx = self.stage.preset.duplex
        logits = row_logits.astype(np.float32)
        if req.temperature > 0:
            logits /= req.temperature
        apply_repetition_penalty(logits, self.codes[row], dx.tts_repetition_penalty, dx.tts_repetition_window,
                                 per_occurrence=True)
        if not self.allow_eos(row):
            logits[self.stage.eos] = -np.inf
        return logits

    def params(self, row: int) -> SamplingParams:
        return SamplingParams(1.0 if self.items[row][0].temperature > 0 else 0.0, self.stage.top_k, self.stage.top_p)

    def choose(self, row: int, row_logits: np.ndarray) -> int | None:
        return self.accept(row, sample(self.adjusted(row, row_logits), self.params(row), self.items[row][1].rng))

    def pick(self, row: int) -> TtsPick:
        """The device's pick: the same rules; a sampled row's one draw from its rng, as `sample` would make it."""
        req, sess = self.items[row]
        window = self.stage.preset.duplex.tts_repetition_window
        u = float(sess.rng.random()) if req.temperature > 0 else 0.0
        return TtsPick(req.temperature, self.codes[row][-window:], self.allow_eos(row), u)

    def accept(self, row: int, code: int) -> int | None:
        """The code to feed next, or None: the EOS, or the (n_tokens + 1)-th code (sampled, never fed nor
        returned). -1: the row's logits were not finite on the device."""
        if code < 0:
            raise StepError(Code.NUMERIC_ERROR, "the model's logits are not finite for this row")
        if code == self.stage.eos or len(self.codes[row]) == self.items[row][0].n_tokens:
            return None
        self.codes[row].append(code)
        return code

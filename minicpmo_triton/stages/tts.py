"""The TTS stage: per session a KV cache that lives for one spoken turn; 25 speech tokens per chunk."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..engine.exported import Engine
from ..engine.kv_batch import KvCache
from ..engine.protocol import NOT_FINITE, PagedCache, TtsFeed, TtsRow, TtsRules
from ..errors import Code, StepError
from ..model_config import SPEECH_TOKENS_PER_SECOND, PresetConfig
from ..rules.sampling import (
    DrawnAhead,
    SamplingParams,
    apply_repetition_penalty,
    check_sampling,
    sample,
    sampling_problems,
    seeded_rng,
)
from ..stage_io import TtsRequest, TtsResult
from .base import SequenceStage, StageCall
from .kv import HostKv, KvRow, StageKv

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


def with_tts_sampling(preset: PresetConfig, top_k: int, top_p: float) -> PresetConfig:
    """The preset with the `tts_top_k` / `tts_top_p` settings (0 / 1.0: off, the reference's draw), so the host and
    the device rules read one value."""
    if problems := sampling_problems(1.0, top_k, top_p):
        raise ValueError(f"tts: {problems}")
    return dataclasses.replace(preset, duplex=dataclasses.replace(preset.duplex, tts_top_k=top_k, tts_top_p=top_p))


def tts_rules(preset: PresetConfig) -> TtsRules:
    """The TTS sampling rules' settings, the same for every row (the device keeps them)."""
    dx = preset.duplex
    return TtsRules(preset.tts.num_audio_tokens - 1, dx.tts_top_k, dx.tts_top_p, dx.tts_repetition_penalty,
                    dx.tts_repetition_window)


def host_kv(engine: Engine, preset: PresetConfig) -> HostKv:
    """The exported graph's KV interface: host caches in and out each call, codes chosen from host logits."""
    d, llm_hidden = preset.tts.decoder, preset.llm.hidden

    def feeds(conditions: list[TtsFeed]) -> list[dict[str, np.ndarray]]:
        out: list[dict[str, np.ndarray]] = []
        for c in conditions:
            n = len(c)
            hidden = np.zeros((n, llm_hidden), np.float32)
            hidden[: len(c.hidden)] = c.hidden
            out.append({"text_ids": c.text_ids.astype(np.int64), "llm_hidden": hidden,
                        "has_hidden": np.arange(n) < len(c.hidden), "code_ids": np.zeros(n, np.int64),
                        "is_code": np.zeros(n, bool)})
        return out

    def step_feeds(rows: list[int], tokens: list[int]) -> dict[str, np.ndarray]:
        n = len(rows)
        return {"text_ids": np.zeros((n, 1), np.int64), "llm_hidden": np.zeros((n, 1, llm_hidden), np.float32),
                "has_hidden": np.zeros((n, 1), bool), "code_ids": np.array(tokens, np.int64)[:, None],
                "is_code": np.ones((n, 1), bool)}

    return HostKv(engine, lambda: KvCache.empty(d.layers, d.kv_heads, d.head_dim), feeds, step_feeds, ("logits",))


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

    def __init__(self, kv: StageKv | Engine, preset: PresetConfig, ttl_s: float) -> None:
        """`kv`: where the sessions' turn caches live and how a batch runs (`stages.kv`); an exported graph
        (`Engine`) is run with host caches (`host_kv`)."""
        super().__init__(ttl_s)
        self.kv: StageKv = cast(StageKv, kv) if hasattr(kv, "release") else host_kv(kv, preset)
        self.preset = preset
        self.eos = preset.tts.num_audio_tokens - 1
        self.admit_tokens = tts_admit_tokens(preset)

    def new_state(self, call: StageCall[TtsRequest]) -> TtsSession:
        return TtsSession(self.kv.open(self.admit_tokens), seeded_rng(call.request.seed, call.corr_id))

    def drop_state(self, state: TtsSession) -> None:
        self.kv.free(state.cache)

    def is_noop(self, request: TtsRequest) -> bool:
        return request.n_tokens == 0

    def empty_result(self) -> TtsResult:
        return TtsResult()

    def condition(self, req: TtsRequest) -> TtsFeed:
        """[text tokens with their LLM hidden states..., audio_bos]."""
        ids = np.asarray([*req.text_ids, self.preset.tts.audio_bos_token_id], np.int64)
        if not isinstance(req.tts_hidden, np.ndarray):  # the LLM's rows on the device, in this process: as they are
            return TtsFeed(ids, req.tts_hidden)
        return TtsFeed(ids, np.asarray(req.tts_hidden, np.float32).reshape(len(req.text_ids),
                                                                            self.preset.llm.hidden))

    def opens_turn(self, request: TtsRequest, state: TtsSession) -> bool:
        """The chunk starts from an empty cache: a turn's start, or the turn's positions would run out."""
        need = len(request.text_ids) + 1 + request.n_tokens
        return request.turn_start or state.cache.length + need > self.preset.tts.max_positions

    def check(self, request: TtsRequest, state: TtsSession) -> None:
        if len(request.tts_hidden) != len(request.text_ids):
            raise ValueError(f"tts: {len(request.text_ids)} text ids but {len(request.tts_hidden)} hidden states")
        if ((request.text_ids < 0) | (request.text_ids >= self.preset.tts.num_text_tokens)).any():
            raise StepError(Code.INVALID_INPUT, "tts: text token id out of the vocabulary")
        # (a caller's rows; the LLM's own on the device, in this process, are not read back to be checked)
        if isinstance(request.tts_hidden, np.ndarray) and not np.isfinite(request.tts_hidden).all():
            raise StepError(Code.INVALID_INPUT, "tts: hidden states hold NaN or infinite values")
        if not 0 <= request.n_tokens <= MAX_TOKENS_PER_CALL:
            raise StepError(Code.INVALID_INPUT, f"tts: n_tokens must be within [0, {MAX_TOKENS_PER_CALL}]")
        check_sampling("tts", temperature=request.temperature)
        past = 0 if self.opens_turn(request, state) else state.cache.length
        self.kv.reserve(state.cache, past + len(request.text_ids) + 1 + request.n_tokens)  # refused now, never mid-step

    def begin(self, req: TtsRequest, sess: TtsSession) -> tuple[TtsFeed, ChunkRules]:
        """A chunk's start: its condition and its rules (a chunk that opens a turn starts from an empty cache; the
        blocks its check reserved are kept for it)."""
        opened = self.opens_turn(req, sess)
        if opened:
            sess.cache = sess.cache.truncated(0)
        return self.condition(req), ChunkRules(self, req, sess, opened)

    def finish(self, rules: ChunkRules, cache: KvCache | PagedCache) -> TtsResult:
        """A chunk's end: the session's cache (dropped at a turn's end: a pool keeps the admission room) and the
        chunk's codes."""
        rules.sess.cache = self.kv.release(cache) if rules.req.turn_end else cache
        return TtsResult(speech_tokens=np.asarray(rules.codes, np.int64), kv_length=cache.length)

    def compute(self, items: list[tuple[TtsRequest, TtsSession]]) -> list[TtsResult]:
        chunks = [self.begin(req, sess) for req, sess in items]
        done = self.kv.run([KvRow(sess, sess.cache, feed, rules) for (_, sess), (feed, rules)
                            in zip(items, chunks, strict=True)])
        return [self.finish(rules, cache) for (_, rules), (cache, _, _) in zip(chunks, done, strict=True)]


class ChunkRules:
    """One chunk's rules (`generate_chunk`, modeling_minicpmo_unified.py:6792-6816), for either path: temperature,
    then the repetition penalty (per occurrence over the chunk's last codes), EOS forbidden mid-turn until the chunk
    is a full second, then top-k / top-p; the chunk ends on EOS or on its (n_tokens + 1)-th code (chosen, never fed
    nor returned). The host path picks from host logits (`choose`); the device path tells the device the chunk's
    rules once (`row`, the rng's uniforms drawn ahead) and reads each code it chose (`confirm`)."""

    def __init__(self, stage: TtsStage, req: TtsRequest, sess: TtsSession, opened: bool) -> None:
        self.stage, self.req, self.sess, self.opened = stage, req, sess, opened
        self.codes: list[int] = []
        self.ahead = DrawnAhead(sess.rng)

    decodes = True
    n_hidden = 0
    hidden_on_device = False

    @property
    def allow_eos(self) -> bool:
        return self.opened or self.req.turn_end  # min_new_tokens = n_tokens + 1 mid-turn

    def adjusted(self, row_logits: np.ndarray) -> np.ndarray:
        """The row's logits as `sample` takes them: temperature, penalty, the EOS mask (float32)."""
        dx = self.stage.preset.duplex
        logits = row_logits.astype(np.float32)
        if self.req.temperature > 0:
            logits /= self.req.temperature
        apply_repetition_penalty(logits, self.codes, dx.tts_repetition_penalty, dx.tts_repetition_window,
                                 per_occurrence=True)
        if not self.allow_eos:
            logits[self.stage.eos] = -np.inf
        return logits

    def params(self) -> SamplingParams:
        dx = self.stage.preset.duplex
        return SamplingParams(1.0 if self.req.temperature > 0 else 0.0, dx.tts_top_k, dx.tts_top_p)

    def choose(self, out: dict[str, np.ndarray]) -> int | None:
        return self.accept(sample(self.adjusted(out["logits"]), self.params(), self.sess.rng))

    def accept(self, code: int) -> int | None:
        """The code to feed next, or None: the EOS, or the (n_tokens + 1)-th code."""
        if code == self.stage.eos or len(self.codes) == self.req.n_tokens:
            return None
        self.codes.append(code)
        return code

    # ---- the device path ----
    @functools.cached_property
    def row(self) -> TtsRow:
        draws = self.req.n_tokens + 1 if self.req.temperature > 0 else 0  # `sample`'s one draw per code
        return TtsRow(self.req.temperature, self.allow_eos, self.req.n_tokens, self.ahead.draw(draws))

    def confirm(self, token: int, flags: int) -> bool:
        if flags & NOT_FINITE:
            raise StepError(Code.NUMERIC_ERROR, "the model's logits are not finite for this row")
        if self.req.temperature > 0:
            self.ahead.used += 1
        return self.accept(token) is not None

    def done(self) -> None:
        self.ahead.give_back()

    def take_hidden(self, hidden: np.ndarray | None) -> None:
        """A TTS chunk keeps no hidden rows."""

"""The LLM stage: per session a KV cache; per step a batched prefill of the chunk, then the duplex decode."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from ..chat_rules import ChatDecoder, chat_token_mask
from ..duplex_rules import ChunkDecoder, forbidden_token_mask, stream_decode
from ..duplex_window import PREVIOUS_MARKER, WINDOW_MODES, Slide, UnitLedger, WindowConfig, drop_tokens
from ..engines import Engine
from ..errors import Code, StepError
from ..kv_batch import KvBatch, KvCache
from ..model_config import PresetConfig
from ..paged.protocol import CHAT, DUPLEX, PagedCache, Prefill, RowPick
from ..pcm import pcm_problem
from ..sampling import SamplingParams, apply_repetition_penalty, check_sampling, sample, seeded_rng
from ..stage_io import LlmRequest, LlmResult
from ..tokenizer import Tokenizer
from .audio_encoder import AudioStream, AudioStreamEncoder
from .base import SequenceStage, StageCall
from .decode_loop import DecodeTiming, batched_decode

if TYPE_CHECKING:  # torch: imported where the paged engine is built, not by every host of this stage
    from ..paged.engine import LoopTiming, PagedLlmEngine


def is_prefill_chunk(request: LlmRequest) -> bool:
    """A long prefill's leading chunk (prefill_chunks.py): its session's step, which decodes, comes later."""
    return not request.decode and len(request.input_ids) > 0


def wants_hidden(dec: ChunkDecoder | ChatDecoder, got: list[np.ndarray]) -> bool:
    """The fed token's hidden state is wanted (the TTS conditions on it): position 0 of a prefill (a carried
    token) or of a step."""
    return bool(dec.text_ids) and len(got) < len(dec.text_ids)


class ContextFull(StepError):
    """The session's context (8192 tokens for MiniCPM-o 4.5) has no room for this step."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.CONTEXT_FULL, message)


@dataclass
class LlmSession:
    cache: KvCache | PagedCache
    rng: np.random.Generator
    pending: list[int] = field(default_factory=list)  # last chunk's terminator + </unit>
    turn_ended: bool = True  # the reference's `current_turn_ended`
    history: list[int] = field(default_factory=list)  # the duplex draws (StreamDecoder.generated_tokens)
    chat_history: list[int] = field(default_factory=list)
    audio: AudioStream = field(default_factory=AudioStream)  # what the session has heard, for the next chunk
    units: UnitLedger = field(default_factory=UnitLedger)  # for the sliding window


class LlmStage(SequenceStage[LlmRequest, LlmResult, LlmSession]):
    def __init__(self, engine: Engine | PagedLlmEngine, preset: PresetConfig, tokenizer: Tokenizer, ttl_s: float,
                 encoder: AudioStreamEncoder | None = None, admit_tokens: int = 1024) -> None:
        super().__init__(ttl_s)
        # the paged engine keeps every session's KV cache in its pool; the ONNX engine takes it in each call
        self.paged = cast("PagedLlmEngine", engine) if getattr(engine, "name", "") == "paged" else None
        self.engine = cast(Engine, engine)  # used only where self.paged is None
        self.admit_tokens = admit_tokens  # the pool's room a new session needs to be admitted
        self.encoder = encoder  # for requests that bring their step's audio (the duplex stream)
        self.preset = preset
        self.tokenizer = tokenizer
        d = preset.llm
        self._empty = lambda: KvCache.empty(d.layers, d.kv_heads, d.head_dim)
        self.forbidden = forbidden_token_mask(d.vocab, preset.tokens, tokenizer.bad_ids(d.vocab))
        self.chat_allowed = chat_token_mask(d.vocab, preset.tokens, tokenizer.is_text)
        self.turn_close = [preset.tokens.im_end, *tokenizer.encode("\n")]
        # Any token but a control token may be teacher-forced: caller text holds newlines and accents that
        # `tiny`'s byte tokenizer never samples (its sampling mask is printable ASCII).
        self.forcible = np.ones(d.vocab, bool)
        self.forcible[sorted(set(vars(preset.tokens).values()))] = False
        # `context` window: the tokens a dropped unit's text leaves out (StreamDecoder's `_all_special_ids`)
        self.unsaid = tokenizer.special_ids()
        self.marker = tuple(tokenizer.encode(PREVIOUS_MARKER))
        if self.paged is not None:
            self.paged.use_rules(np.stack([self.forbidden, ~self.chat_allowed]), preset.tokens)  # DUPLEX, CHAT

    def new_state(self, call: StageCall[LlmRequest]) -> LlmSession:
        rng = seeded_rng(call.request.seed, call.corr_id)
        if self.paged is not None:
            return LlmSession(PagedCache(self.paged.pool.open(self.admit_tokens), 0), rng)
        return LlmSession(self._empty(), rng)

    def drop_state(self, state: LlmSession) -> None:
        if isinstance(state.cache, PagedCache) and self.paged is not None:
            self.paged.pool.free(state.cache.seq)
        if self.encoder is not None:
            self.encoder.release(state.audio)

    def run(self, calls: list[StageCall[LlmRequest]]) -> list[LlmResult | Exception]:
        results = super().run(calls)
        self.sweep_pool()
        return results

    def sweep_pool(self) -> None:
        """With no call in flight: a slide copies a session into a new pool entry, and the one it left (or the
        one an undo dropped) is held by no session any more: it is given back."""
        if self.paged is not None:
            held = {s.cache.seq for s in self.store.values() if isinstance(s.cache, PagedCache)}
            for seq in [q for q in self.paged.pool.tables if q not in held]:
                self.paged.pool.free(seq)

    def is_noop(self, request: LlmRequest) -> bool:
        return len(request.input_ids) == 0 and not request.decode and request.rollback_to < 0

    def can_wait(self, request: LlmRequest) -> bool:
        return is_prefill_chunk(request)

    def empty_result(self) -> LlmResult:
        return LlmResult()

    def _count_chars(self, ids: list[int]) -> int:
        return len(self.tokenizer.decode(ids))

    def check(self, request: LlmRequest, state: LlmSession) -> None:
        tk = self.preset.tokens
        if request.rollback_to - state.units.dropped > state.cache.length:
            raise ValueError(f"llm: cannot roll back to {request.rollback_to}, past the {state.cache.length} cached")
        n_audio = 0
        if len(request.audio):
            if self.encoder is None:
                raise ValueError("llm: this stage has no audio encoder; send embeddings")
            n_audio = self.preset.audio_tokens(len(request.audio))
        n_placeholders = int((request.input_ids == tk.audio_placeholder).sum())
        if n_placeholders != len(request.embeds) + n_audio:
            raise ValueError(f"llm: {n_placeholders} audio placeholders but {len(request.embeds)} embeddings "
                             f"and {n_audio} audio tokens")
        if len(request.embeds) and request.embeds.shape[1] != self.preset.llm.hidden:
            raise ValueError(f"llm: embeddings of width {request.embeds.shape[1]}, not {self.preset.llm.hidden}")
        ids = np.concatenate([request.input_ids, request.forced_ids])
        if ((ids < 0) | (ids >= self.preset.llm.vocab)).any():
            raise ValueError("llm: token id out of the vocabulary")
        if not np.isfinite(request.embeds).all():
            raise StepError(Code.INVALID_INPUT, "llm: embeddings hold NaN or infinite values")
        if problem := pcm_problem(request.audio):
            raise StepError(Code.BAD_AUDIO, f"llm: {problem}")
        if request.decode:
            check_sampling("llm", temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                           repetition_penalty=request.repetition_penalty, length_penalty=request.length_penalty)
        if not 0 <= request.window_mode < len(WINDOW_MODES) or not 0 < request.window_low <= request.window_high \
                or request.window_units < 1 or request.window_previous < 0:
            raise StepError(Code.INVALID_CONFIG, "llm: the sliding window needs a known mode, 0 < low <= high, "
                                                 "units > 0 and previous >= 0")
        need = len(state.pending) + max(len(request.input_ids), 1) + (request.max_new_tokens if request.decode else 0)
        used = state.cache.length
        if WINDOW_MODES[request.window_mode] == "basic" and state.units.preserve is not None:
            used = min(used, request.window_high)  # past the high watermark, this step's close slides the window
        if need > self.preset.duplex.context_tokens - used:
            raise ContextFull(f"context full: {state.cache.length} of {self.preset.duplex.context_tokens} tokens used")
        if n_audio and self.encoder is not None:
            self.encoder.reserve(state.audio, len(request.audio))  # the paged encoder's pool: refused now too
        if isinstance(state.cache, PagedCache) and self.paged is not None:
            self.paged.pool.reserve(state.cache.seq, state.cache.length + need)  # refused now, never mid-step

    def encode(self, items: list[tuple[LlmRequest, LlmSession]]) -> tuple[list[np.ndarray], float]:
        """Each row's embeddings: what it brought, then its audio's, encoded as the next chunk of the session's
        audio stream (its Whisper KV cache), all rows' chunks in one encoder batch."""
        rows = [i for i, (req, _) in enumerate(items) if len(req.audio)]
        embeds = [req.embeds.reshape(-1, self.preset.llm.hidden) for req, _ in items]
        if not rows or self.encoder is None:
            return embeds, 0.0
        t0 = time.perf_counter()
        encoded = self.encoder.run([(items[i][0].audio, items[i][1].audio) for i in rows])
        for i, out in zip(rows, encoded, strict=True):
            embeds[i] = np.concatenate([embeds[i], out])
        return embeds, (time.perf_counter() - t0) * 1000

    def prepare(self, req: LlmRequest, sess: LlmSession, req_embeds: np.ndarray
                ) -> tuple[dict[str, np.ndarray], ChunkDecoder | ChatDecoder, SamplingParams]:
        """One row before its prefill: a rollback, the window's slide, what it feeds, its decode rules."""
        tk, h = self.preset.tokens, self.preset.llm.hidden
        if req.rollback_to >= 0:
            self._roll_back(sess, req.rollback_to - sess.units.dropped)
        self._slide(req, sess)
        ids = np.concatenate([np.asarray(sess.pending, np.int64), req.input_ids.astype(np.int64)])
        use = ids == tk.audio_placeholder
        if len(ids) == 0:
            ids, use = np.array([tk.unit], np.int64), np.zeros(1, bool)  # decode needs one fed token
        embeds = np.zeros((len(ids), h), np.float32)
        embeds[use] = req_embeds
        params = SamplingParams(req.temperature, req.top_k, req.top_p, req.repetition_penalty,
                                self.preset.duplex.repetition_window)
        return {"input_ids": ids, "embeds": embeds, "use_embeds": use}, self._decoder(req, sess), params

    def compute(self, items: list[tuple[LlmRequest, LlmSession]]) -> list[LlmResult]:
        fill = [i for i, (r, _) in enumerate(items) if not r.decode]
        if self.paged is None and 0 < len(fill) < len(items):
            # Prefill-only rows (a long prompt's chunks) go as a forward of their own: in one batch each decoding
            # row would carry their long past, padded, through every step of its decode.
            rest = [i for i, (r, _) in enumerate(items) if r.decode]
            out = dict(zip(rest, self._compute([items[i] for i in rest]), strict=True))
            out.update(zip(fill, self._compute([items[i] for i in fill]), strict=True))
            return [out[i] for i in range(len(items))]
        return self._compute(items)

    def _compute(self, items: list[tuple[LlmRequest, LlmSession]]) -> list[LlmResult]:
        h = self.preset.llm.hidden
        prefill, decoders, params = [], [], []
        row_embeds, encode_ms = self.encode(items)
        for (req, sess), req_embeds in zip(items, row_embeds, strict=True):
            pre, dec, par = self.prepare(req, sess, req_embeds)
            prefill.append(pre)
            decoders.append(dec)
            params.append(par)
        hidden_of: list[list[np.ndarray]] = [[] for _ in items]

        if self.paged is not None:
            driver = _DeviceRows(self, items, decoders, params, hidden_of)
            seqs = [s.cache.seq for _, s in items]  # type: ignore[union-attr]
            lengths, timing = self.paged.run(seqs, [s.cache.length for _, s in items],
                                             [Prefill(p["input_ids"], e, p["use_embeds"])
                                              for p, e in zip(prefill, row_embeds, strict=True)], driver)
            caches: list[KvCache | PagedCache] = [PagedCache(q, n) for q, n in zip(seqs, lengths, strict=True)]
            for q, n in zip(seqs, lengths, strict=True):
                self.paged.pool.truncate(q, n)
            return self._results(items, decoders, caches, hidden_of, prefill, timing, encode_ms)

        tk = self.preset.tokens

        def choose(row: int, out: dict[str, np.ndarray]) -> int | None:
            dec, sess = decoders[row], items[row][1]
            if wants_hidden(dec, hidden_of[row]):
                hidden_of[row].append(out["hidden"][0])
            if dec.done:
                return None
            forced = items[row][0].forced_ids
            if isinstance(dec, ChatDecoder):
                logits = dec.adjust(out["logits"])
                if len(dec.generated) < len(forced) and self._may_force(logits, int(forced[len(dec.generated)])):
                    return dec.accept(int(forced[len(dec.generated)]))
                apply_repetition_penalty(logits, sess.chat_history, params[row].repetition_penalty,
                                         self.preset.duplex.repetition_window)
                token = sample(logits, params[row], sess.rng)
                sess.chat_history.append(token)
                del sess.chat_history[:-self.preset.duplex.repetition_window]
                return dec.accept(token)
            if dec.must_end:
                dec.end_now()
                return None
            if len(dec.generated) < len(forced):  # teacher forcing: decided in place of a draw, recorded as one
                token = int(forced[len(dec.generated)])
                sess.history.append(token)
            else:
                token = stream_decode(out["logits"], self.forbidden, sess.history, params[row],
                                      items[row][0].length_penalty, tk, sess.rng)
                if len(sess.history) > 2 * params[row].repetition_window:  # only the window is read: keep it bounded
                    del sess.history[:-params[row].repetition_window]
            return dec.accept(token)

        def step_feeds(rows: list[int], tokens: list[int]) -> dict[str, np.ndarray]:
            n = len(rows)
            return {"input_ids": np.array(tokens, np.int64)[:, None],
                    "embeds": np.zeros((n, 1, h), np.float32), "use_embeds": np.zeros((n, 1), bool)}

        host_caches, host_timing = batched_decode(self.engine, [cast(KvCache, s.cache) for _, s in items], prefill,
                                                  step_feeds, choose, ("logits", "hidden"))
        return self._results(items, decoders, host_caches, hidden_of, prefill, host_timing, encode_ms)

    def _results(self, items: list[tuple[LlmRequest, LlmSession]], decoders: list[ChunkDecoder | ChatDecoder],
                 caches: Sequence[KvCache | PagedCache], hidden_of: list[list[np.ndarray]],
                 prefill: list[dict[str, np.ndarray]], timing: DecodeTiming | LoopTiming,
                 encode_ms: float) -> list[LlmResult]:
        return [self.result(req, sess, dec, cache, hid, len(pre["input_ids"]), timing.prefill_ms, timing.decode_ms,
                            encode_ms)
                for (req, sess), dec, cache, hid, pre in zip(items, decoders, caches, hidden_of, prefill, strict=True)]

    def result(self, req: LlmRequest, sess: LlmSession, dec: ChunkDecoder | ChatDecoder, cache: KvCache | PagedCache,
               hid: list[np.ndarray], n_prefill: int, prefill_ms: float, decode_ms: float, encode_ms: float,
               **loop: int) -> LlmResult:
        """One row's answer, the session moved on to its new cache. `loop`: the in-flight loop's counters."""
        cached = sess.cache.length
        sess.cache = cache
        if req.decode:
            sess.pending = dec.pending
            if isinstance(dec, ChunkDecoder):
                sess.turn_ended = dec.turn_ended
        else:
            sess.pending = []
        # what the open unit said (its `total_ids_in_unit`; nothing when it ends listening), for `context`
        sess.units.speaking = [] if dec.is_listen or not isinstance(dec, ChunkDecoder) else \
            [t for t in dec.text_ids if t not in self.unsaid]
        return LlmResult(
            generated=np.asarray(dec.generated, np.int64),
            text_ids=np.asarray(dec.text_ids, np.int64),
            tts_hidden=np.stack(hid).astype(np.float32) if hid else np.zeros((0, self.preset.llm.hidden), np.float32),
            is_listen=dec.is_listen or not req.decode,
            # a listen answers end_of_turn False, as the reference's `_make_generate_result` default
            # (modeling_minicpmo_unified.py:4928, 5130): the turn a listen closed is `turn_closed`
            end_of_turn=dec.end_of_turn and not dec.is_listen and req.decode,
            turn_closed=isinstance(dec, ChunkDecoder) and dec.turn_closed,
            turn_start=dec.turn_start,
            kv_length=cache.length,
            n_prefill=n_prefill,
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            encode_ms=encode_ms,
            cached_tokens=cached,
            kv_dropped=sess.units.dropped,
            window_events=sess.units.events,
            **loop,
        )

    def _may_force(self, logits: np.ndarray, token: int) -> bool:
        """The chunk's rules allow `token` now, or it is plain text and the rules leave a choice (they do not
        force a terminator)."""
        return bool(np.isfinite(logits[token])) or (self.forcible[token] and np.count_nonzero(np.isfinite(logits)) > 1)

    def _slide(self, req: LlmRequest, sess: LlmSession) -> None:
        """The unit the pending tokens close is closed (`finalize_unit`), the window slides if it must, and the
        session's first <unit> marks the end of its kept system prompt. Only where a unit closes: the reference
        slides in `finalize_unit` alone (modeling_minicpmo_unified.py:5296-5300), never within a unit (a long
        prefill's later chunks, which no pending tokens precede)."""
        closed_at = sess.cache.length + len(sess.pending)
        slides: list[Slide] = []
        if sess.pending:
            sess.units.close(closed_at)
            config = WindowConfig(WINDOW_MODES[req.window_mode], req.window_high, req.window_low, req.window_units,
                                  req.window_previous, self.marker)
            slides = sess.units.plan(closed_at, config)
        if slides:
            # the closing tokens first, seeing the whole unit history, as `finalize_unit` feeds them before the
            # window slides (one more forward for this row, once per slide)
            sess.cache = self._fed(sess.cache, sess.pending)
            sess.pending = []
            for slide in slides:
                sess.cache = self._rewrite(sess.cache, slide)
        units = np.flatnonzero(req.input_ids == self.preset.tokens.unit)
        if len(units):
            # `context` mode feeds the system prompt's closing `<|audio_end|><|im_end|>` (and whatever follows it
            # before the first unit) again after the previous text (core/processors/unified.py:881-882)
            head = req.input_ids[:units[0]]
            ends = np.flatnonzero(head == self.preset.tokens.audio_end)
            sess.units.start(sess.cache.length + len(sess.pending) + int(units[0]),
                             [int(t) for t in head[ends[-1]:]] if len(ends) else [])

    def _rewrite(self, cache: KvCache | PagedCache, slide: Slide) -> KvCache | PagedCache:
        """One window slide: [keep, keep + drop) cut, `insert` fed at `keep` over the kept head, the rest moved
        after it, re-rotated (`drop_tokens_from_cache` / `_rebuild_cache_with_previous`)."""
        theta, gap = self.preset.llm.rope_theta, len(slide.insert)
        length = cache.length - slide.drop + gap
        if isinstance(cache, PagedCache) and self.paged is not None:  # into a new pool entry: undoable
            seq = self.paged.pool.slid_copy(cache.seq, slide.keep, slide.drop, cache.length, theta, gap)
            if gap:
                self._fed(PagedCache(seq, slide.keep), list(slide.insert))
            return PagedCache(seq, length)
        head, tail = drop_tokens(cache, slide.keep, slide.drop, theta, gap)  # type: ignore[arg-type]
        if gap:
            head = self._fed(head, list(slide.insert))  # type: ignore[assignment]
        return KvCache(np.concatenate([head.key, tail.key], axis=2), np.concatenate([head.value, tail.value], axis=2))

    def _fed(self, cache: KvCache | PagedCache, ids: list[int]) -> KvCache | PagedCache:
        """Tokens into one session's cache, alone (no decode)."""
        if isinstance(cache, PagedCache) and self.paged is not None:
            self.paged.forward([cache.seq], [cache.length], [Prefill(np.asarray(ids, np.int64),
                                                                     np.zeros((0, self.preset.llm.hidden), np.float32),
                                                                     np.zeros(len(ids), bool))])
            return PagedCache(cache.seq, cache.length + len(ids))
        batch, n = KvBatch([cast(KvCache, cache)]), np.array([len(ids)], np.int64)
        out = self.engine.run({"input_ids": np.asarray(ids, np.int64)[None],
                               "embeds": np.zeros((1, len(ids), self.preset.llm.hidden), np.float32),
                               "use_embeds": np.zeros((1, len(ids)), bool), **batch.feeds(n)})
        batch.advance(out["present_key"], out["present_value"], n)
        return batch.extract(0)

    def _roll_back(self, sess: LlmSession, length: int) -> None:
        """Forget what was said but not heard: the cache ends where the listener stopped hearing, and the
        spoken turn ends there (its terminator and </unit> open the next prefill, as a chunk's would).
        `length` counts from the window's start: a point the window has already dropped cannot be returned to."""
        if length < (sess.units.preserve or 0):
            raise StepError(Code.INVALID_INPUT, "llm: the rollback point has left the sliding window")
        sess.cache = sess.cache.truncated(length)
        sess.units.truncate(length)
        sess.pending = [self.preset.tokens.turn_eos, self.preset.tokens.unit_end]
        sess.turn_ended = True

    def _decoder(self, req: LlmRequest, sess: LlmSession) -> ChunkDecoder | ChatDecoder:
        if req.chat:
            carry = sess.pending[0] if len(sess.pending) == 1 else None  # a chunk's carried text token
            dec: ChunkDecoder | ChatDecoder = ChatDecoder(
                self.preset.tokens, max(1, req.max_new_tokens), req.last_chunk, self.chat_allowed, self.turn_close,
                carry=carry)
        else:
            dec = ChunkDecoder(self.preset.tokens, sess.turn_ended, max(1, req.max_new_tokens),
                               self.preset.duplex.max_unit_text_chars, self._count_chars)
            if req.decode and req.force_listen:
                dec.force_listen()
        if not req.decode:
            dec.done = True
        return dec


class _DeviceRows:
    """The paged engine's side of the host rules: what `LlmStage.compute`'s `choose` does, with the logits left on
    the device (each row's pick is sent as numbers; the token comes back)."""

    def __init__(self, stage: LlmStage, items: list[tuple[LlmRequest, LlmSession]],
                 decoders: list[ChunkDecoder | ChatDecoder], params: list[SamplingParams],
                 hidden_of: list[list[np.ndarray]]) -> None:
        self.stage, self.items, self.decoders, self.params, self.hidden_of = stage, items, decoders, params, hidden_of
        self.picks: dict[int, RowPick] = {}  # each row's pick this step, read back when its token comes

    def wants_hidden(self, row: int) -> bool:
        return wants_hidden(self.decoders[row], self.hidden_of[row])

    def add_hidden(self, row: int, hidden: np.ndarray) -> None:
        self.hidden_of[row].append(hidden)

    def pick(self, row: int) -> RowPick | None:
        dec, (req, sess), params = self.decoders[row], self.items[row], self.params[row]
        if dec.done:
            return None
        forced = int(req.forced_ids[len(dec.generated)]) if len(dec.generated) < len(req.forced_ids) else -1
        window = params.repetition_window
        if isinstance(dec, ChatDecoder):
            # as `_may_force` on the chat rules' logits: the token is allowed, or it is text and others are too
            if forced >= 0 and not (self.stage.chat_allowed[forced]
                                    or (self.stage.forcible[forced] and self.stage.chat_allowed.sum() > 1)):
                forced = -1
            u = float(sess.rng.random()) if forced < 0 and not params.greedy else 0.0  # `sample`'s one draw
            history = sess.chat_history[-window:] if params.repetition_penalty != 1.0 else []
            self.picks[row] = RowPick(CHAT, params, forced, history, u=(u, 0.0))
            return self.picks[row]
        if dec.must_end:
            dec.end_now()
            return None
        pick = RowPick(DUPLEX, params, forced, sess.history[-window:] if params.repetition_penalty != 1.0 else [],
                       req.length_penalty)
        if forced < 0 and not params.greedy:  # `stream_decode`'s two draws; the second given back if not needed
            first = float(sess.rng.random())
            pick.rewind = sess.rng.bit_generator.state
            pick.u = (first, float(sess.rng.random()))
        self.picks[row] = pick
        return pick

    def accept(self, row: int, token: int, drew_second: bool) -> int | None:
        dec, sess, pick = self.decoders[row], self.items[row][1], self.picks[row]
        if isinstance(dec, ChatDecoder):
            if pick.forced < 0:
                sess.chat_history.append(token)
            return dec.accept(token)
        if pick.forced >= 0 or drew_second:
            sess.history.append(token)  # a draw that went past <|chunk_eos|>, or a forced token, joins the history
        elif pick.rewind is not None:
            sess.rng.bit_generator.state = pick.rewind
        return dec.accept(token)

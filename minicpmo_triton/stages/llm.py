"""The LLM stage: per session a KV cache; per step a batched prefill of the chunk, then the duplex decode."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ..engine.exported import Engine
from ..engine.kv_batch import KvCache
from ..engine.lane import Handoff
from ..engine.protocol import CHAT, DREW_SECOND, DUPLEX, NOT_FINITE, LlmRow, PagedCache, Prefill
from ..errors import Code, StepError
from ..media.pcm import pcm_problem
from ..media.tokenizer import Tokenizer
from ..model_config import PresetConfig
from ..rules.chat_rules import ChatDecoder, chat_token_mask
from ..rules.duplex_rules import ChunkDecoder, forbidden_token_mask, stream_decode
from ..rules.duplex_window import PREVIOUS_MARKER, WINDOW_MODES, Slide, UnitLedger, WindowConfig
from ..rules.sampling import DrawnAhead, SamplingParams, apply_repetition_penalty, check_sampling, sample, seeded_rng
from ..stage_io import LlmRequest, LlmResult
from .audio_encoder import AudioStream, AudioStreamEncoder
from .base import SequenceStage, StageCall
from .kv import HostKv, KvRow, StageKv


def is_prefill_chunk(request: LlmRequest) -> bool:
    """A long prefill's leading chunk (prefill_chunks.py): its session's step, which decodes, comes later."""
    return not request.decode and len(request.input_ids) > 0


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


def rule_masks(preset: PresetConfig, tokenizer: Tokenizer) -> np.ndarray:
    """[DUPLEX / CHAT, vocab]: what each rule set's draws may never pick (the device keeps them for its rules)."""
    d = preset.llm
    return np.stack([forbidden_token_mask(d.vocab, preset.tokens, tokenizer.bad_ids(d.vocab)),
                     ~chat_token_mask(d.vocab, preset.tokens, tokenizer.is_text)])


def host_kv(engine: Engine, preset: PresetConfig) -> HostKv:
    """The exported graph's KV interface: host caches in and out each call, tokens chosen from host logits."""
    d = preset.llm

    def feeds(prefills: list[Prefill]) -> list[dict[str, np.ndarray]]:
        out: list[dict[str, np.ndarray]] = []
        for p in prefills:
            embeds = np.zeros((len(p.ids), d.hidden), np.float32)
            embeds[p.use] = _on_host(p.embeds).reshape(-1, d.hidden)
            out.append({"input_ids": p.ids.astype(np.int64), "embeds": embeds, "use_embeds": p.use})
        return out

    def step_feeds(rows: list[int], tokens: list[int]) -> dict[str, np.ndarray]:
        n = len(rows)
        return {"input_ids": np.array(tokens, np.int64)[:, None], "embeds": np.zeros((n, 1, d.hidden), np.float32),
                "use_embeds": np.zeros((n, 1), bool)}

    return HostKv(engine, lambda: KvCache.empty(d.layers, d.kv_heads, d.head_dim), feeds, step_feeds,
                  ("logits", "hidden"))


def _is_kv(engine: object) -> bool:
    return hasattr(engine, "open") and hasattr(engine, "release")


class LlmStage(SequenceStage[LlmRequest, LlmResult, LlmSession]):
    def __init__(self, kv: StageKv | Engine, preset: PresetConfig, tokenizer: Tokenizer, ttl_s: float,
                 encoder: AudioStreamEncoder | None = None, admit_tokens: int = 1024) -> None:
        """`kv`: where the sessions' caches live and how a batch runs (`stages.kv`); an exported graph (`Engine`)
        is run with host caches (`host_kv`)."""
        super().__init__(ttl_s)
        self.kv: StageKv = cast(StageKv, kv) if _is_kv(kv) else host_kv(cast(Engine, kv), preset)
        self.admit_tokens = admit_tokens  # the pool's room a new session needs to be admitted
        # `tts_in_llm`: the TTS in this process takes a speaking call's hidden rows on the device (`Speaker`)
        self.hidden_on_device = False
        self.encoder = encoder  # for requests that bring their step's audio (the duplex stream)
        self.preset = preset
        self.tokenizer = tokenizer
        d = preset.llm
        masks = rule_masks(preset, tokenizer)
        self.forbidden, self.chat_allowed = masks[DUPLEX], ~masks[CHAT]
        self.turn_close = [preset.tokens.im_end, *tokenizer.encode("\n")]
        # Any token but a control token may be teacher-forced: caller text holds newlines and accents that
        # `tiny`'s byte tokenizer never samples (its sampling mask is printable ASCII).
        self.forcible = np.ones(d.vocab, bool)
        self.forcible[sorted(set(vars(preset.tokens).values()))] = False
        self.chat_choice = int(self.chat_allowed.sum()) > 1
        # `context` window: the tokens a dropped unit's text leaves out (StreamDecoder's `_all_special_ids`)
        self.unsaid = tokenizer.special_ids()
        self.marker = tuple(tokenizer.encode(PREVIOUS_MARKER))
        self.window_slides = 0  # every session's, since load (minicpmo_llm_window_slides_total)

    def new_state(self, call: StageCall[LlmRequest]) -> LlmSession:
        return LlmSession(self.kv.open(self.admit_tokens), seeded_rng(call.request.seed, call.corr_id))

    def drop_state(self, state: LlmSession) -> None:
        self.kv.free(state.cache)
        if self.encoder is not None:
            self.encoder.release(state.audio)

    def run(self, calls: list[StageCall[LlmRequest]]) -> list[LlmResult | Exception]:
        results = super().run(calls)
        self.sweep_pool()
        return results

    def sweep_pool(self) -> None:
        """With no call in flight: a slide copies a session into a new pool entry, and the one it left (or the
        one an undo dropped) is held by no session any more: it is given back."""
        self.kv.sweep([s.cache for s in self.store.values()])

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
            self.encoder.reserve(state.audio, len(request.audio))  # the device encoder's pool: refused now too
        self.kv.reserve(state.cache, state.cache.length + need)  # a pool refuses now (pool_full), never mid-step

    def encode(self, items: list[tuple[LlmRequest, LlmSession]]) -> tuple[list[Any], float]:
        """Each row's embeddings: what it brought, then its audio's, encoded as the next chunk of the session's
        audio stream (its Whisper KV cache), all rows' chunks in one encoder batch (on the device engine, kept
        there: spliced into the LLM's input without a trip through the host)."""
        embeds, ms, handoff = self.launch_encode(items)
        handoff.wait()
        return embeds, ms

    def launch_encode(self, items: list[tuple[LlmRequest, LlmSession]]) -> tuple[list[Any], float, Handoff]:
        """`encode` on the encoder's lane (its own CUDA stream on a GPU), for a preparation thread: the embeddings,
        the host ms, and the hand-off the LLM's stream waits on before it reads them. Only the sessions' audio
        streams are touched (the LLM's pool and the rest of the session are the engine thread's)."""
        rows = [i for i, (req, _) in enumerate(items) if len(req.audio)]
        embeds: list[Any] = [req.embeds.reshape(-1, self.preset.llm.hidden) for req, _ in items]
        if not rows or self.encoder is None:
            return embeds, 0.0, Handoff()
        t0 = time.perf_counter()
        encoded, _ = self.encoder.launch([(items[i][0].audio, items[i][1].audio) for i in rows])
        with self.encoder.lane.work():  # joined where they were made
            for i, out in zip(rows, encoded, strict=True):
                embeds[i] = _joined(embeds[i], out)
        handoff = self.encoder.lane.handoff([embeds[i] for i in rows])
        return embeds, (time.perf_counter() - t0) * 1000, handoff

    def prepare(self, req: LlmRequest, sess: LlmSession, req_embeds: Any) -> tuple[Prefill, LlmRules]:
        """One row before its prefill: a rollback, the window's slide, what it feeds, its decode rules."""
        tk = self.preset.tokens
        if req.rollback_to >= 0:
            self._roll_back(sess, req.rollback_to - sess.units.dropped)
        self._slide(req, sess)
        ids = np.concatenate([np.asarray(sess.pending, np.int64), req.input_ids.astype(np.int64)])
        use = ids == tk.audio_placeholder
        if len(ids) == 0:
            ids, use = np.array([tk.unit], np.int64), np.zeros(1, bool)  # decode needs one fed token
        params = SamplingParams(req.temperature, req.top_k, req.top_p, req.repetition_penalty,
                                self.preset.duplex.repetition_window)
        return Prefill(ids, req_embeds, use), LlmRules(self, req, sess, self._decoder(req, sess), params)

    def compute(self, items: list[tuple[LlmRequest, LlmSession]]) -> list[LlmResult]:
        fill = [i for i, (r, _) in enumerate(items) if not r.decode]
        if self.kv.name == "onnx" and 0 < len(fill) < len(items):
            # Prefill-only rows (a long prompt's chunks) go as a forward of their own: in one padded batch each
            # decoding row would carry their long past through every step of its decode.
            rest = [i for i, (r, _) in enumerate(items) if r.decode]
            out = dict(zip(rest, self._compute([items[i] for i in rest]), strict=True))
            out.update(zip(fill, self._compute([items[i] for i in fill]), strict=True))
            return [out[i] for i in range(len(items))]
        return self._compute(items)

    def _compute(self, items: list[tuple[LlmRequest, LlmSession]]) -> list[LlmResult]:
        row_embeds, encode_ms = self.encode(items)
        rows = [self.prepare(req, sess, e) for (req, sess), e in zip(items, row_embeds, strict=True)]
        done = self.kv.run([KvRow(sess, sess.cache, pre, rules) for (_, sess), (pre, rules)
                            in zip(items, rows, strict=True)])
        return [self.result(rules, cache, len(pre), prefill_ms, decode_ms, encode_ms)
                for (pre, rules), (cache, prefill_ms, decode_ms) in zip(rows, done, strict=True)]

    def result(self, rules: LlmRules, cache: KvCache | PagedCache, n_prefill: int, prefill_ms: float,
               decode_ms: float, encode_ms: float, **loop: int) -> LlmResult:
        """One row's answer, the session moved on to its new cache. `loop`: the in-flight loop's counters."""
        req, sess, dec = rules.req, rules.sess, rules.dec
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
        hidden = rules.hidden_rows(self.preset.llm.hidden)
        return LlmResult(
            generated=np.asarray(dec.generated, np.int64),
            text_ids=np.asarray(dec.text_ids, np.int64),
            tts_hidden=hidden,
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

    def counted(self) -> dict[str, int]:
        return {"window_slides": self.window_slides}

    def may_force(self, token: int) -> bool:
        """A chat chunk's forced token is taken: its rules allow it, or it is plain text and they leave a choice
        (they do not force a terminator). As the host path reads it off the logits (`_may_force`)."""
        return bool(self.chat_allowed[token]) or (bool(self.forcible[token]) and self.chat_choice)

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
            self.window_slides += len(slides)
            # the closing tokens first, seeing the whole unit history, as `finalize_unit` feeds them before the
            # window slides (one more forward for this row, once per slide)
            sess.cache = self.kv.feed(sess.cache, self._ids(sess.pending))
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

    def _ids(self, ids: list[int]) -> Prefill:
        return Prefill(np.asarray(ids, np.int64), np.zeros((0, self.preset.llm.hidden), np.float32),
                       np.zeros(len(ids), bool))

    def _rewrite(self, cache: KvCache | PagedCache, slide: Slide) -> KvCache | PagedCache:
        """One window slide: [keep, keep + drop) cut, `insert` fed at `keep` over the kept head, the rest moved
        after it, re-rotated (`drop_tokens_from_cache` / `_rebuild_cache_with_previous`)."""
        return self.kv.slide(cache, slide.keep, slide.drop, self.preset.llm.rope_theta, self._ids(list(slide.insert)))

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


def _on_host(embeds: Any) -> np.ndarray:
    """Embeddings as a host array (the device encoder's stay on the device until a host engine needs them)."""
    return embeds.detach().float().cpu().numpy() if hasattr(embeds, "detach") else np.asarray(embeds, np.float32)


def _joined(brought: np.ndarray, encoded: Any) -> Any:
    """A row's embeddings: what it brought, then its audio's (a host array, or the device encoder's tensor)."""
    if isinstance(encoded, np.ndarray) or not len(brought):
        return np.concatenate([brought, encoded]) if isinstance(encoded, np.ndarray) else encoded
    import torch  # the device encoder's output: joined where it is

    return torch.cat([torch.as_tensor(brought).to(encoded.device, encoded.dtype), encoded])


class LlmRules:
    """One row's duplex or chat rules, for either path, over one decoder (`ChunkDecoder` / `ChatDecoder`) and the
    session's history and rng:
    - the host path picks each token from the logits it was sent (`choose`: `stream_decode`, or the chat rules and
      `sample`) and keeps the fed text tokens' hidden rows;
    - the device path tells the device the row's rules once (`row`: settings, repetition window, forced tokens,
      and the rng's uniforms for the whole chunk, drawn ahead) and reads each token the device chose (`confirm`:
      the history gains it, the decoder accepts it); `done` gives the rng back what it drew ahead and did not use
      (the device reports a duplex draw that went past its first uniform: `DREW_SECOND`)."""

    def __init__(self, stage: LlmStage, req: LlmRequest, sess: LlmSession, dec: ChunkDecoder | ChatDecoder,
                 params: SamplingParams) -> None:
        self.stage, self.req, self.sess, self.dec, self.params = stage, req, sess, dec, params
        self.hidden: list[np.ndarray] = []
        self.device_hidden: Any = None  # the device path's: np.ndarray, or a device tensor (`hidden_on_device`)
        self.ahead = DrawnAhead(sess.rng)

    @property
    def decodes(self) -> bool:
        return not self.dec.done

    @property
    def n_hidden(self) -> int:
        return len(self.dec.text_ids)

    @property
    def hidden_on_device(self) -> bool:
        """A call whose text goes on to the TTS in this process (`tts_in_llm`): its hidden rows stay where they are."""
        return self.req.speak and self.stage.hidden_on_device

    def hidden_rows(self, width: int) -> Any:
        """The text tokens' hidden rows [n, width]: float32 on the host, or the device copy (`hidden_on_device`)."""
        if self.device_hidden is not None:
            if not isinstance(self.device_hidden, np.ndarray):
                return self.device_hidden
            return self.device_hidden[: self.n_hidden].astype(np.float32)
        return np.stack(self.hidden).astype(np.float32) if self.hidden else np.zeros((0, width), np.float32)

    def _forced(self) -> int:
        """The token teacher-forced at this decision, or -1 (chat: one its rules refuse is drawn instead)."""
        k, forced = len(self.dec.generated), self.req.forced_ids
        if k >= len(forced):
            return -1
        token = int(forced[k])
        return -1 if isinstance(self.dec, ChatDecoder) and not self.stage.may_force(token) else token

    # ---- the host path ----
    def choose(self, out: dict[str, np.ndarray]) -> int | None:
        dec, sess, params, tk = self.dec, self.sess, self.params, self.stage.preset.tokens
        if len(self.hidden) < len(dec.text_ids):
            self.hidden.append(out["hidden"][0])
        if dec.done:
            return None
        if isinstance(dec, ChatDecoder):
            logits = dec.adjust(out["logits"])
            k, forced_ids = len(dec.generated), self.req.forced_ids
            if k < len(forced_ids) and self.stage._may_force(logits, int(forced_ids[k])):
                return dec.accept(int(forced_ids[k]))
            apply_repetition_penalty(logits, sess.chat_history, params.repetition_penalty, params.repetition_window)
            token = sample(logits, params, sess.rng)
            sess.chat_history.append(token)
            del sess.chat_history[:-params.repetition_window]
            return dec.accept(token)
        if dec.must_end:
            dec.end_now()
            return None
        forced = self._forced()
        if forced >= 0:  # teacher forcing: decided in place of a draw, recorded as one
            sess.history.append(forced)
            return dec.accept(forced)
        token = stream_decode(out["logits"], self.stage.forbidden, sess.history, params, self.req.length_penalty, tk,
                              sess.rng)
        self._bound_history()
        return dec.accept(token)

    def _bound_history(self) -> None:
        window = self.params.repetition_window
        if len(self.sess.history) > 2 * window:  # only the window is read: keep it bounded
            del self.sess.history[:-window]

    # ---- the device path ----
    @functools.cached_property
    def row(self) -> LlmRow:
        dec, sess, params = self.dec, self.sess, self.params
        chat = isinstance(dec, ChatDecoder)
        budget = dec.budget if isinstance(dec, ChatDecoder) else dec.max_new_tokens
        history = sess.chat_history if chat else sess.history
        forced = [int(t) for t in self.req.forced_ids[:budget]]
        if chat:
            forced = [t if self.stage.may_force(t) else -1 for t in forced]
        uniforms = self.ahead.draw(0 if params.greedy else (1 if chat else 2) * budget)
        return LlmRow(CHAT if chat else DUPLEX, params.temperature, params.top_k, params.top_p,
                      params.repetition_penalty, self.req.length_penalty, budget,
                      history[-params.repetition_window:] if params.repetition_penalty != 1.0 else [], forced,
                      isinstance(dec, ChunkDecoder) and dec.turn_ended, uniforms,
                      hidden_at_prefill=bool(dec.text_ids))

    def confirm(self, token: int, flags: int) -> bool:
        dec, sess = self.dec, self.sess
        forced = self._forced()
        if isinstance(dec, ChatDecoder):
            if forced < 0:
                self._drawn(flags, 1)
                sess.chat_history.append(token)
                del sess.chat_history[:-self.params.repetition_window]
            return dec.accept(token) is not None
        if dec.must_end:
            dec.end_now()
            return False
        if forced >= 0:
            sess.history.append(token)
        else:
            self._drawn(flags, 2 if flags & DREW_SECOND else 1)
            if flags & DREW_SECOND:  # a draw past <|chunk_eos|> joins the history
                sess.history.append(token)
            self._bound_history()
        return dec.accept(token) is not None

    def _drawn(self, flags: int, uniforms: int) -> None:
        if flags & NOT_FINITE:
            raise StepError(Code.NUMERIC_ERROR, "the model's logits are not finite for this row")
        if not self.params.greedy:
            self.ahead.used += uniforms

    def done(self) -> None:
        self.ahead.give_back()

    def take_hidden(self, hidden: Any) -> None:
        self.device_hidden = hidden

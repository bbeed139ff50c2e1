"""One duplex step across the stages: encode 1 s of audio, let the LLM listen or speak, voice what it says.

The entry Triton model runs this with stage calls over BLS; the benchmark's in-process baseline runs
the very same code with direct calls. Per session it tracks which stage sequences it has started,
so START goes with a stage's first call and END reaches each started stage exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from ..duplex_contract import ChatInput, ChatMessage, StepEvent, StepInput, StepMetrics, VoiceRefs
from ..errors import Code, StepError
from ..media.tokenizer import IncrementalDecoder, Tokenizer
from ..model_config import PresetConfig
from ..rules.duplex_options import DuplexOptions
from ..rules.duplex_window import WINDOW_MODES
from ..rules.image_prompt import CHAT, DUPLEX, ImageLayout, image_ids
from ..rules.voice_turn import VoiceTurn
from ..stage_io import (
    AudioEncoderRequest,
    AudioEncoderResult,
    LlmRequest,
    LlmResult,
    Token2WavRequest,
    Token2WavResult,
    TtsRequest,
    TtsResult,
    VisionEncoderRequest,
    VisionEncoderResult,
    VoicedSpeech,
    speech_request,
    spoke,
)
from ..stages.base import StageCall
from ..stages.state_store import SequenceStore
from ..stages.voice_prompt import VoiceLibrary
from .prefill_chunks import split_prefill
from .rendezvous import BatchWindow, Member, Rendezvous
from .stage_settings import STAGE_SETTINGS

STATEFUL_STAGES = ("llm", "tts", "token2wav")
MAX_CHUNK_SECONDS = 5
CHAT_CHUNK_TOKENS = 16  # a turn-based reply streams in chunks of this many tokens
CHARS_PER_SECOND = 14  # how much speech (25 tokens/s) the TTS makes for a chunk of turn-based text
VISION_BATCH_IMAGES = 4  # images per vision_encoder request (a duplex step's most)
PREFILL_CHUNK_TOKENS = int(STAGE_SETTINGS["prefill_chunk_tokens"].default)  # the most one LLM call prefills


Ready = Callable[[], Awaitable[None]]


class StageClient(Protocol):
    async def audio_encoder(self, request: AudioEncoderRequest) -> AudioEncoderResult: ...

    async def vision_encoder(self, request: VisionEncoderRequest) -> VisionEncoderResult: ...

    async def llm(self, call: StageCall[LlmRequest], ready: Ready | None = None) -> LlmResult:
        """`ready` is awaited once the call is built, just before it is sent (the batching door)."""
        ...

    async def tts(self, call: StageCall[TtsRequest]) -> TtsResult: ...

    async def speech(self, corr_id: int) -> TtsResult | VoicedSpeech:
        """The TTS's codes for the session's llm call that spoke (`LlmRequest.speak`, `stage_io.spoke`), or their
        audio where the llm model runs token2wav too (`token2wav_in_llm`): the rest of that call's stream. Called
        once for each such call, whatever the step does with them."""
        ...

    async def speak(self, call: StageCall[TtsRequest], voice: Token2WavRequest | None = None
                    ) -> TtsResult | VoicedSpeech:
        """A TTS chunk on the llm model's TTS (`tts_in_llm`), and `voice`, token2wav's call for its codes, where it
        runs there too (`token2wav_in_llm`): their sequences are the llm model's to start and end."""
        ...

    async def token2wav(self, call: StageCall[Token2WavRequest]) -> Token2WavResult: ...


@dataclass
class DuplexSession:
    options: DuplexOptions
    decoder: IncrementalDecoder
    started: set[str] = field(default_factory=set)
    chunk_index: int = 0
    turn: VoiceTurn = field(default_factory=VoiceTurn)  # the spoken turn, for the TTS and token2wav
    chat_history: list[tuple[str, str, bytes]] = field(default_factory=list)  # messages in the LLM's context
    voice: VoiceRefs = field(default_factory=VoiceRefs)
    voice_sent: np.ndarray | None = None  # the reference token2wav has for this session (None: the default)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cancels: int = 0  # bumped by a cancel; a step that sees it change stops making output
    kv_length: int = 0  # the LLM's cache after its last call (what a turn's new tokens join)


Emit = Callable[[StepEvent], Awaitable[None]]


class DuplexPipeline:
    def __init__(self, stages: StageClient, preset: PresetConfig, tokenizer: Tokenizer, ttl_s: float,
                 llm_gather_s: float = 0.0, batch_window: BatchWindow | None = None,
                 voices: VoiceLibrary | None = None, default_ref_audio: np.ndarray | None = None,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, tts_in_llm: bool = False,
                 token2wav_in_llm: bool = False) -> None:
        self.stages = stages
        # The llm model runs the TTS too: a duplex step's voice comes on its llm call's stream (`speech`), with no
        # tts call of its own; a turn-based reply's voice is a TTS call to the llm model (`speak`): the tts model is
        # never called, and holds no pool.
        self.tts_in_llm = tts_in_llm
        # ... and token2wav too: that call's stream (or TTS call's answer) is the chunk's audio, no token2wav call of
        # its own; token2wav's sequence is the llm model's, and the token2wav model is never called.
        self.token2wav_in_llm = token2wav_in_llm
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # MiniCPM-o's demo always embeds a voice reference in the duplex system prompt; this one when the
        # session sends none (encoded once, on first use)
        self.default_ref_audio = default_ref_audio
        self._default_ref: np.ndarray | None = None
        self.voices = voices or VoiceLibrary(None)
        self.preset = preset
        self.tokenizer = tokenizer
        self.sessions: SequenceStore[DuplexSession] = SequenceStore(ttl_s)
        # Concurrent steps meet before the LLM so the sequence batcher sees them together.
        self.llm_meet = Rendezvous(llm_gather_s, batch_window, lambda: len(self.sessions))

    def _call(self, state: DuplexSession, stage: str, corr_id: int, request: Any) -> StageCall[Any]:
        start = stage not in state.started
        state.started.add(stage)
        return StageCall(request, corr_id, start=start)

    async def _stage(self, state: DuplexSession, stage: str, corr_id: int, request: Any,
                     ready: Ready | None = None) -> Any:
        """A stateful stage's call. A refused first call is ENDed at once (the state its START made is freed, not
        left to the TTL) and not counted as a start: the next call starts the stage again (the LLM with its
        system prompt)."""
        call = self._call(state, stage, corr_id, request)
        try:
            if ready is not None:
                return await self.stages.llm(call, ready=ready)
            return await getattr(self.stages, stage)(call)
        except StepError:
            if call.start:
                await self._unstart(state, stage, corr_id)
            raise

    async def _unstart(self, state: DuplexSession, stage: str, corr_id: int) -> None:
        """A refused start: the state it made is ENDed now, and the next call starts the stage again."""
        state.started.discard(stage)
        with contextlib.suppress(Exception):  # the refusal is what the caller is told
            await self._end_stage(stage, corr_id)

    async def _end_stage(self, stage: str, corr_id: int) -> None:
        ends: dict[str, tuple[Callable[[StageCall[Any]], Awaitable[object]], object]] = {
            "llm": (self.stages.llm, LlmRequest(decode=False)), "tts": (self.stages.tts, TtsRequest(n_tokens=0)),
            "token2wav": (self.stages.token2wav, Token2WavRequest())}
        fn, request = ends[stage]
        if stage == "llm":
            await self.llm_meet.pass_through()  # an END rides in a batch that is going anyway
        await fn(StageCall(request, corr_id, end=True))

    async def _llm(self, state: DuplexSession, corr_id: int, request: LlmRequest, member: Member | None = None
                   ) -> LlmResult:
        """The LLM call, a long prefill split (prefill_chunks.py): its leading chunks go aside from the step's
        place at the door, each riding with the steps going anyway; the last call waits at the door, built.
        A refusal of any chunk of a first call frees the state the first one started, as `_stage` does."""
        *leading, last = split_prefill(request, self.prefill_chunk_tokens, self.preset.tokens.audio_placeholder)
        starting = "llm" not in state.started
        try:
            done: list[LlmResult] = []
            if leading:
                async with member.aside() if member is not None else contextlib.nullcontext():
                    for chunk in leading:
                        done.append(await self._stage(state, "llm", corr_id, chunk, self.llm_meet.pass_through))
            result = await self._stage(state, "llm", corr_id, last, member.arrive if member is not None else None)
            state.kv_length = result.kv_length
            if not done:
                return result
            # the call's prefill as one: all of its tokens, what was cached before its first chunk
            return replace(result, n_prefill=result.n_prefill + sum(r.n_prefill for r in done),
                           prefill_ms=result.prefill_ms + sum(r.prefill_ms for r in done),
                           cached_tokens=done[0].cached_tokens)
        except StepError:
            if starting and "llm" in state.started:
                await self._unstart(state, "llm", corr_id)
            raise

    def _named(self, voice: VoiceRefs) -> VoiceRefs:
        """A named voice is the TTS reference unless the session sent its own."""
        named = self.voices.get(voice.name) if voice.name and voice.tts_ref_audio is None else None
        return voice if named is None else replace(voice, tts_ref_audio=named)

    async def system_prefix(self, state: DuplexSession, prompt: str) -> tuple[list[int], np.ndarray]:
        """`<|im_start|>system\n{prompt}\n<|audio_start|>[the LLM's voice reference]<|audio_end|><|im_end|>`."""
        tk = self.preset.tokens
        ref = np.zeros((0, self.preset.llm.hidden), np.float32)
        if state.voice.ref_audio is not None:
            ref = (await self.stages.audio_encoder(AudioEncoderRequest(state.voice.ref_audio))).embeds
        elif self.default_ref_audio is not None:
            if self._default_ref is None:
                encoded = await self.stages.audio_encoder(AudioEncoderRequest(self.default_ref_audio))
                self._default_ref = encoded.embeds
            ref = self._default_ref
        ids = [tk.im_start, *self.tokenizer.encode(f"system\n{prompt}\n"), tk.audio_start,
               *([tk.audio_placeholder] * len(ref)), tk.audio_end, tk.im_end]
        return ids, ref

    async def step(self, corr_id: int, start: bool, end: bool, inp: StepInput | ChatInput, emit: Emit) -> None:
        t0 = time.perf_counter()
        if start:
            options = inp.options or DuplexOptions.from_config({}, self.preset.duplex)
            state = DuplexSession(options, self.tokenizer.decoder(), voice=self._named(inp.voice or VoiceRefs()))
            self.sessions.start(corr_id, state)
        state = self.sessions.get(corr_id)
        async with state.lock:  # a session's steps run in order, whatever the batcher hands us
            try:
                if isinstance(inp, ChatInput):
                    await self._chat(corr_id, state, inp, emit)
                elif inp.say or inp.answer_tokens:
                    await self._spoken_turn(corr_id, state, inp, emit, t0)
                elif len(inp.audio) or inp.context_text:
                    async with self.llm_meet.member() as member:
                        await self._step(corr_id, state, inp, self._timed(emit, t0, member), member)
            finally:
                if end:
                    await self.end(corr_id, state)

    def _timed(self, emit: Emit, t0: float, member: Member) -> Emit:
        """`emit` that tells the LLM's door what the step took to its first event, less its wait there."""
        first = True

        async def timed(event: StepEvent) -> None:
            nonlocal first
            if first:
                first = False
                self.llm_meet.recent.add(time.perf_counter() - t0 - member.waited_s)
            await emit(event)

        return timed

    def cancel(self, corr_id: int) -> bool:
        """Stop the session's step in flight at its next stage boundary (it runs beside it, not behind the lock)."""
        state = self.sessions.get_or_none(corr_id)
        if state is None:
            return False
        state.cancels += 1
        return True

    async def end(self, corr_id: int, state: DuplexSession) -> None:
        self.sessions.end(corr_id)
        failed: Exception | None = None
        for stage in STATEFUL_STAGES:
            if stage in state.started:
                try:
                    await self._end_stage(stage, corr_id)
                except Exception as exc:  # noqa: BLE001 (every later stage still gets its END; the first failure is told)
                    failed = failed or exc
        state.started.clear()
        if failed is not None:
            raise failed

    async def _spoken_turn(self, corr_id: int, state: DuplexSession, inp: StepInput, emit: Emit, t0: float) -> None:
        """A whole spoken turn now, one duplex unit per second of silence from the caller (MiniCPM-o's own
        form of speech: `<unit>[audio]<|speak|>text...<|chunk_eos|></unit>` ... `<|turn_eos|></unit>`).
        `say`: the text is teacher-forced (`<|speak|>` text `<|turn_eos|><|chunk_eos|>`), so the TTS conditions on its
        hidden states as on sampled text's. `answer_tokens`: `<|speak|>` is forced after the context, then
        the model samples its answer; at the budget the turn is ended (a forced listen)."""
        tk = self.preset.tokens
        # Every unit opens with <|speak|> (a chunk's first token is not voiced). `say` ends its last chunk itself:
        # after <|turn_eos|> the loop would go on to the model's own choice, and a chunk ended in <|listen|> is
        # not voiced.
        todo = [tk.speak, *self.tokenizer.encode(inp.say), tk.turn_eos, tk.chunk_eos] if inp.say else [tk.speak]
        budget = len(todo) if inp.say else inp.answer_tokens
        unit = replace(inp, audio=np.zeros(16_000, np.float32), respond=True, say="", answer_tokens=0)
        produced, said, cancels = 0, 2, state.cancels
        for _ in range(budget + 2):  # every unit decodes at least one token, or ends the turn
            # `say` ends with its text (its last forced tokens are <|turn_eos|><|chunk_eos|>), however many
            # tokens the units' own terminators took; a unit that said none of it ends the turn rather than loop
            ending = said <= 1 if inp.say else produced >= budget
            async with self.llm_meet.member() as member:
                llm = await self._step(corr_id, state, replace(unit, force_listen=ending),
                                       self._timed(emit, t0, member), member, forced=todo)
            if llm is None or llm.is_listen or llm.end_of_turn or state.cancels != cancels:
                return
            produced += len(llm.generated)
            said = _common_prefix(todo, [int(t) for t in llm.generated])
            todo = [tk.speak, *todo[said:]]
            # only the first unit carries the context, the rollback and the images
            unit = StepInput(audio=unit.audio, respond=True)

    async def _step(self, corr_id: int, state: DuplexSession, inp: StepInput, emit: Emit, member: Member,
                    forced: list[int] | None = None) -> LlmResult | None:
        """One duplex unit. `forced` (a spoken turn's): the tokens to teacher-force, and no listening rule."""
        t0 = time.perf_counter()
        opts, tk = state.options, self.preset.tokens
        metrics = StepMetrics(backend="triton")
        ids: list[int] = []
        prefix = np.zeros((0, self.preset.llm.hidden), np.float32)
        if "llm" not in state.started:
            async with member.aside():  # a voice prompt's encoding: the others at the door go on meanwhile
                ids, prefix = await self.system_prefix(state, opts.system_prompt)
        embeds = prefix
        n_text_in = len(ids) - len(prefix)
        if inp.context_text:
            ctx = self.tokenizer.encode(f"[{inp.context_kind}] {inp.context_text}\n")
            ids += ctx
            n_text_in += len(ctx)
        n_vision = n_audio = 0
        cancels = state.cancels
        if inp.rollback_to >= 0:
            state.turn.drop()
            replay_ids, replay = await self._replay_units(inp.replay_audio)
            ids += replay_ids
            embeds = np.concatenate([embeds, replay])
            n_text_in += len(replay_ids) - len(replay)
        if len(inp.audio):
            if len(inp.audio) > MAX_CHUNK_SECONDS * 16_000:
                raise StepError(Code.INVALID_AUDIO, f"an audio chunk may hold at most {MAX_CHUNK_SECONDS} s")
            ids.append(tk.unit)
            if inp.frames:
                t = time.perf_counter()
                vision_ids, vision, n_slices = await self._vision(inp.frames, inp.max_slice_nums, DUPLEX)
                metrics.cost_vision_ms, metrics.vision_slices, metrics.vision_tokens = _ms(t), n_slices, len(vision)
                ids += [i for image in vision_ids for i in image]
                embeds = np.concatenate([embeds, vision])
                n_vision = len(vision)
            # The LLM stage encodes the step's audio itself; its tokens follow everything before them.
            n_audio = self.preset.audio_tokens(len(inp.audio))
            ids += [tk.audio_placeholder] * n_audio
        listening = forced is None and len(inp.audio) > 0 and state.chunk_index < opts.force_listen_count
        # What a voiced chunk tells the TTS and token2wav: nothing changes the turn before the LLM's result says
        # whether the step spoke (a listen, a cancel return before voicing), so it is known now.
        turn_start, restart = state.turn.starts()
        voice = _voice_to_send(state, state.voice.tts, turn_start)
        in_llm = {"voice_turn_start": restart, **voice} if self.token2wav_in_llm else {}
        request = LlmRequest(**in_llm,
            input_ids=np.asarray(ids, np.int64), embeds=embeds, audio=inp.audio,
            decode=len(inp.audio) > 0 or inp.respond,
            force_listen=inp.force_listen or listening or (bool(inp.context_text) and not inp.respond),
            temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
            repetition_penalty=opts.repetition_penalty, length_penalty=opts.length_penalty,
            max_new_tokens=opts.max_new_speak_tokens_per_chunk, seed=opts.seed, rollback_to=inp.rollback_to,
            forced_ids=np.asarray(forced or [], np.int64),
            window_mode=WINDOW_MODES.index(opts.sliding_window_mode), window_high=opts.basic_window_high_tokens,
            window_low=opts.basic_window_low_tokens, window_units=opts.context_max_units,
            window_previous=opts.context_previous_max_tokens,
            speak=self.tts_in_llm, tts_turn_start=turn_start, tts_tokens=self.preset.duplex.tts_tokens_per_chunk,
            tts_temperature=opts.tts_temperature,
        )
        t = time.perf_counter()
        # The call waits at the door, built, for other sessions' steps to batch with.
        llm = await self._llm(state, corr_id, request, member)
        metrics.llm_wait_ms = wait_ms = round(member.waited_s * 1000, 2)
        if len(inp.audio):
            state.chunk_index += 1
        metrics = replace(metrics, cost_llm_ms=round(_ms(t) - wait_ms, 2),
                          cost_audio_encoder_ms=round(llm.encode_ms, 2), prefill_ms=round(llm.prefill_ms, 2),
                          generate_ms=round(llm.decode_ms, 2), n_tokens=len(llm.generated),
                          kv_cache_length=llm.kv_cache_length, kv_tokens_total=llm.kv_length + llm.kv_dropped)
        usage = {"input_text_tokens": n_text_in, "input_audio_tokens": len(embeds) - n_vision + n_audio,
                 "input_vision_tokens": n_vision, "output_text_tokens": len(llm.text_ids), "output_speech_tokens": 0}
        text = state.decoder.feed([int(i) for i in llm.text_ids])

        if state.cancels != cancels:  # cancelled (barge-in): no words, no voice; the usage still counts
            if spoke(request, llm):
                with contextlib.suppress(StepError):  # its stream read to its end; its voice (or refusal) dropped
                    await self.stages.speech(corr_id)
            state.turn.drop()
            await emit(StepEvent("listen", metrics=metrics, chunk_usage=usage))
            return None
        if llm.is_listen:  # the TTS keeps its turn: only a voiced <|turn_eos|> ends it (as MiniCPM-o's loop)
            state.turn.listened(llm.turn_closed)
            metrics.n_tts_tokens, metrics.wall_clock_ms = 0, _ms(t0)
            await emit(StepEvent("listen", metrics=metrics, chunk_usage=usage))
            return llm
        if text:  # the words go out now; their voice follows
            await emit(StepEvent("text", text=text, metrics=replace(metrics)))
        t = time.perf_counter()
        if spoke(request, llm):
            tts = await self.stages.speech(corr_id)  # made in the llm model's process meanwhile (voiced too)
        else:
            tts = await self._stage(state, "tts", corr_id, speech_request(request, llm))
        metrics.cost_tts_ms = _ms(t)
        t = time.perf_counter()
        wav, n_speech = await self._voiced(state, corr_id, tts, Token2WavRequest(
            turn_start=restart, finalize=llm.end_of_turn, **voice), state.voice.tts)
        metrics.cost_token2wav_ms = _ms(t)
        state.turn.voiced(llm.end_of_turn)
        usage["output_speech_tokens"] = n_speech
        metrics.n_tts_tokens, metrics.wall_clock_ms = n_speech, _ms(t0)
        # The step's usage rides on its last event, once the speech tokens are counted too.
        if llm.end_of_turn:
            if len(wav):
                await emit(StepEvent("audio", audio=wav, metrics=metrics))
            await emit(StepEvent("listen", end_of_turn=True, metrics=metrics, chunk_usage=usage))
        elif len(wav):
            await emit(StepEvent("audio", audio=wav, metrics=metrics, chunk_usage=usage))
        elif text:
            await emit(StepEvent("audio", metrics=metrics, chunk_usage=usage))  # no audio yet: usage still goes out
        return llm

    async def _replay_units(self, audio: np.ndarray) -> tuple[list[int], np.ndarray]:
        """Caller audio heard again after a rollback, one listened unit per second: <unit>[audio]<|listen|></unit>."""
        tk = self.preset.tokens
        ids: list[int] = []
        parts = [np.zeros((0, self.preset.llm.hidden), np.float32)]
        for second in range(len(audio) // 16_000):
            unit = audio[second * 16_000:(second + 1) * 16_000]
            emb = (await self.stages.audio_encoder(AudioEncoderRequest(unit))).embeds
            ids += [tk.unit, *([tk.audio_placeholder] * len(emb)), tk.listen, tk.unit_end]
            parts.append(emb)
        return ids, np.concatenate(parts)

    async def _vision(self, frames: list[bytes], max_slice_nums: list[int], layout: ImageLayout,
                      first_index: int = 0) -> tuple[list[list[int]], np.ndarray, int]:
        """Each image's token ids in `layout` (numbered from `first_index`), all their slices' embeddings
        and the number of slices."""
        slices = list(max_slice_nums) or [1] * len(frames)
        # At most VISION_BATCH_IMAGES a request: each is a bounded piece of the shared encoder's work, and other
        # sessions' frames are encoded between them.
        results = [await self.stages.vision_encoder(VisionEncoderRequest(
            images=np.array(frames[k:k + VISION_BATCH_IMAGES], dtype=np.object_),
            max_slice_nums=np.asarray(slices[k:k + VISION_BATCH_IMAGES], np.int64)))
            for k in range(0, len(frames), VISION_BATCH_IMAGES)]
        per_slice = results[0].embeds.shape[1]
        grids = [(int(rows), int(cols)) if rows else None for r in results for rows, cols in r.grids]
        ids = [image_ids(self.preset.tokens, self.tokenizer.encode, grid, per_slice, first_index + i, layout)
               for i, grid in enumerate(grids)]
        embeds = np.concatenate([r.embeds.reshape(-1, r.embeds.shape[-1]) for r in results])
        return ids, embeds, sum(int(r.slices.sum()) for r in results)

    async def _chat(self, corr_id: int, state: DuplexSession, chat: ChatInput, emit: Emit) -> None:
        t0 = time.perf_counter()
        tk, opts = self.preset.tokens, state.options
        messages = list(chat.messages)
        if not messages or (messages[-1].role == "assistant") != chat.say:
            raise StepError(Code.INVALID_CHAT, "a turn needs messages, the last of them the assistant's to say it, "
                            "else not the assistant's")
        # To say a text, the LLM is teacher-forced through `<|im_start|>assistant\n{text}<|im_end|>` (its
        # hidden states are the TTS's condition), in the chunks a generated reply streams in.
        forced = [*self.tokenizer.encode(messages.pop().text), tk.im_end] if chat.say else []
        max_new_tokens = len(forced) if chat.say else chat.max_new_tokens
        keys = [m.key() for m in messages]
        history = state.chat_history
        if history and keys[: len(history)] != history:  # the client changed the past: rebuild the context
            await self.stages.llm(StageCall(LlmRequest(decode=False), corr_id, end=True))
            state.started.discard("llm")
            history = state.chat_history = []
        enc = self.tokenizer.encode
        ids: list[int] = []
        embeds: list[np.ndarray] = []
        new = messages[len(history):]
        n_audio = n_vision = 0
        n_images = sum(len(m.images) for m in messages[: len(history)])  # the prompt's images number on
        if "llm" not in state.started:
            system = opts.system_prompt
            if new and new[0].role == "system":  # (a welcome line may have nothing before it)
                system, new = new[0].text, new[1:]
            prefix_ids, prefix = await self.system_prefix(state, system)
            ids += [*prefix_ids, *enc("\n")]
            embeds.append(prefix)
            n_audio += len(prefix)
        for m in new:
            ids += [tk.im_start, *enc(f"{m.role}\n")]
            parts: list[str | list[int]] = []  # the message's content: its images, its text, its audio
            if m.images:
                vision_ids, vision, _ = await self._vision(list(m.images), [m.max_slice_nums] * len(m.images),
                                                           CHAT, n_images)
                parts += vision_ids
                embeds.append(vision)
                n_vision += len(vision)
                n_images += len(m.images)
            if m.text:
                parts.append(m.text)
            if m.audio is not None and len(m.audio):
                emb = (await self.stages.audio_encoder(AudioEncoderRequest(m.audio))).embeds
                embeds.append(emb)
                n_audio += len(emb)
                parts.append([tk.audio_start, *([tk.audio_placeholder] * len(emb)), tk.audio_end])
            ids += [*_lines(parts, enc), tk.im_end, *enc("\n")]
        ids += [tk.im_start, *enc("assistant\n")]
        # A history past the context is refused here, counted, before its prefill (the LLM refuses it only at the
        # chunk that overflows, seconds of prefill later): what the LLM holds, the turn, its first chunk's tokens
        held = state.kv_length if "llm" in state.started else 0
        need = held + len(ids) + min(CHAT_CHUNK_TOKENS, max_new_tokens)
        if need > self.preset.duplex.context_tokens:
            raise StepError(Code.CONTEXT_FULL, f"context full: the turn needs {need} tokens with the {held} held, "
                                               f"past the context's {self.preset.duplex.context_tokens}")
        usage = {"input_text_tokens": len(ids) - n_audio - n_vision, "input_audio_tokens": n_audio,
                 "input_vision_tokens": n_vision, "output_text_tokens": 0, "output_speech_tokens": 0}
        metrics = StepMetrics(backend="triton")
        decoder = self.tokenizer.decoder()
        full_text, produced, first = "", 0, True
        speaking = False
        voice = chat.tts_ref_audio if chat.generate_audio and chat.tts_ref_audio is not None else state.voice.tts
        cancels = state.cancels
        while True:
            budget = min(CHAT_CHUNK_TOKENS, max_new_tokens - produced)
            request = LlmRequest(forced_ids=np.asarray(forced[produced:], np.int64),
                input_ids=np.asarray(ids if first else [], np.int64),
                embeds=np.concatenate(embeds) if first and embeds else np.zeros((0, self.preset.llm.hidden),
                                                                                   np.float32),
                chat=True, last_chunk=produced + budget >= max_new_tokens, max_new_tokens=budget,
                temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
                repetition_penalty=opts.repetition_penalty, seed=opts.seed)
            t = time.perf_counter()
            llm = await self._llm(state, corr_id, request)
            metrics.cost_llm_ms = round((metrics.cost_llm_ms or 0.0) + _ms(t), 2)
            if first:
                metrics = replace(metrics, prefill_ms=round(llm.prefill_ms, 2), n_prefill=llm.n_prefill,
                                  cached_tokens=llm.cached_tokens)
            produced += len(llm.generated)
            usage["output_text_tokens"] += len(llm.text_ids)
            text = decoder.feed([int(i) for i in llm.text_ids])
            full_text += text
            metrics.n_tokens, metrics.kv_cache_length = produced, llm.kv_length
            if text:
                await emit(StepEvent("text", text=text, metrics=replace(metrics)))
            if chat.generate_audio and (len(llm.text_ids) or (speaking and llm.end_of_turn)):
                wav, n_speech = await self._voice(corr_id, state, llm, not speaking, len(text), voice)
                speaking = True
                usage["output_speech_tokens"] += n_speech
                if len(wav):
                    await emit(StepEvent("audio", audio=wav, metrics=replace(metrics)))
            first = False
            if llm.end_of_turn or state.cancels != cancels:
                break
        reason = "turn_end" if llm.generated[-1:] == [tk.im_end] else "length"
        state.chat_history = keys + [ChatMessage("assistant", full_text).key()]
        metrics.wall_clock_ms = _ms(t0)
        await emit(StepEvent("done", text=full_text, metrics=metrics, chunk_usage=usage, reason=reason))

    async def _voice(self, corr_id: int, state: DuplexSession, llm: LlmResult, turn_start: bool,
                     n_chars: int, voice: np.ndarray | None) -> tuple[np.ndarray, int]:
        """Speech for one chunk of turn-based text: as many speech tokens as the text takes to say."""
        n_tokens = -(-max(n_chars, 1) * self.preset.duplex.tts_tokens_per_chunk // CHARS_PER_SECOND)
        request = TtsRequest(text_ids=llm.text_ids, tts_hidden=llm.tts_hidden, turn_start=turn_start,
                             turn_end=llm.end_of_turn, n_tokens=n_tokens if len(llm.text_ids) else 0,
                             temperature=state.options.tts_temperature, seed=state.options.seed)
        t2w = Token2WavRequest(turn_start=turn_start, finalize=llm.end_of_turn,
                               **_voice_to_send(state, voice, turn_start))
        if self.tts_in_llm:
            tts = await self.stages.speak(StageCall(request, corr_id), t2w if self.token2wav_in_llm else None)
        else:
            tts = await self._stage(state, "tts", corr_id, request)
        return await self._voiced(state, corr_id, tts, t2w, voice)

    async def _voiced(self, state: DuplexSession, corr_id: int, tts: TtsResult | VoicedSpeech,
                      t2w: Token2WavRequest, voice: np.ndarray | None) -> tuple[np.ndarray, int]:
        """A chunk's audio and its count of codes: the llm model's answer where it runs token2wav too, else the
        token2wav model's for the TTS's codes (`t2w`: its call, the codes left out). Once voiced, token2wav has
        `voice` for the session, if the call sent it."""
        if isinstance(tts, VoicedSpeech):
            wav, n_speech = tts.waveform, tts.n_speech_tokens
        else:
            result = await self._stage(state, "token2wav", corr_id, replace(t2w, speech_tokens=tts.speech_tokens))
            wav, n_speech = result.waveform, len(tts.speech_tokens)
        if len(t2w.voice) or t2w.default_voice:
            state.voice_sent = voice
        return wav, n_speech


def _voice_to_send(state: DuplexSession, voice: np.ndarray | None, turn_start: bool) -> dict[str, Any]:
    """token2wav's voice fields for a call: the reference goes with a turn's first call when it is not the one
    token2wav has for the session (once per session, again when a turn's voice changes), not with every call;
    a turn back on the default voice after one with its own says so (`_voiced` notes it sent, once voiced)."""
    if not turn_start or voice is state.voice_sent:
        return {}
    return {"default_voice": True} if voice is None else {"voice": voice}


def _lines(parts: list[str | list[int]], encode: Callable[[str], list[int]]) -> list[int]:
    """A message's content parts joined by line breaks, as the reference's chat joins them (`"\n".join`).
    The text between two runs of ids is encoded as one string, as the reference's tokenizer splits its
    prompt only at special tokens."""
    ids: list[int] = []
    text = ""
    for i, part in enumerate(parts):
        text += "\n" if i else ""
        if isinstance(part, str):
            text += part
            continue
        ids += [*(encode(text) if text else []), *part]
        text = ""
    return ids + (encode(text) if text else [])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)

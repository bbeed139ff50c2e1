"""Chunked prefill: a long LLM prefill (system prompt, voice prompt, chat history) goes as prefill-only calls of at
most N tokens, then the call that decodes; the session's outputs are those of the unchunked call."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from minicpmo_triton.duplex_contract import ChatInput, ChatMessage
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import DuplexPipeline, StepEvent, StepInput
from minicpmo_triton.serving.prefill_chunks import split_prefill
from minicpmo_triton.stage_io import LlmRequest
from minicpmo_triton.stages.base import StageCall, answer_order
from minicpmo_triton.stages.llm import is_prefill_chunk
from minicpmo_triton.stages.voice_prompt import default_ref_audio

from .conftest import MODEL_REPOSITORY, ensure_exported
from .helpers import GREEDY

PH = 7  # an audio placeholder id, for the pure tests
PROMPT = "You are a careful assistant who answers briefly and kindly. " * 6  # ~360 byte tokens with tiny's tokenizer


def test_a_split_feeds_the_same_tokens_and_embeddings_and_only_the_last_call_decodes() -> None:
    ids = np.array([1, 2, PH, PH, 3, 4, 5, PH, 6, 8, 9, PH, PH, PH], np.int64)  # the last 3: the step's audio
    embeds = np.arange(3 * 2, dtype=np.float32).reshape(3, 2)
    request = LlmRequest(input_ids=ids, embeds=embeds, audio=np.zeros(4800, np.float32), rollback_to=5,
                         forced_ids=np.array([4], np.int64))
    chunks = split_prefill(request, 4, PH)
    assert [len(c.input_ids) for c in chunks] == [4, 4, 2, 4]
    np.testing.assert_array_equal(np.concatenate([c.input_ids for c in chunks]), ids)
    np.testing.assert_array_equal(np.concatenate([c.embeds for c in chunks]), embeds)
    assert [c.decode for c in chunks] == [False, False, False, True]
    assert [c.rollback_to for c in chunks] == [5, -1, -1, -1]
    assert [len(c.audio) for c in chunks] == [0, 0, 0, 4800] and [len(c.forced_ids) for c in chunks] == [0, 0, 0, 1]
    for c in chunks:  # each call's placeholders are its embeddings (the last's also its audio's)
        assert int((c.input_ids == PH).sum()) == len(c.embeds) + (3 if len(c.audio) else 0)


def test_a_short_prefill_or_a_limit_of_zero_is_one_call() -> None:
    request = LlmRequest(input_ids=np.arange(10, dtype=np.int64))
    assert split_prefill(request, 10, PH) == [request]
    assert split_prefill(request, 0, PH) == [request]
    only_audio = LlmRequest(input_ids=np.full(20, PH, np.int64), audio=np.zeros(32_000, np.float32), rollback_to=3)
    assert split_prefill(only_audio, 4, PH) == [only_audio]  # the step's own audio is never split off


def test_a_batch_answers_the_steps_before_the_prefill_chunks_that_joined_it() -> None:
    """The `llm` model runs and answers a batch's calls in `answer_order`'s groups: a prefill chunk (nobody waits
    on it) after the steps beside it; a sequence with two calls in the batch keeps both first, in order."""
    request = LlmRequest(input_ids=np.arange(300, dtype=np.int64))
    chunk, *_ = split_prefill(request, 128, PH)
    step = LlmRequest(input_ids=np.arange(3, dtype=np.int64))
    end_only = LlmRequest(input_ids=np.zeros(0, np.int64), decode=False)
    assert [is_prefill_chunk(r) for r in (chunk, step, end_only)] == [True, False, False]
    calls = [StageCall(chunk, 1), StageCall(step, 2), StageCall(chunk, 3), StageCall(step, 3), StageCall(step, 4)]
    assert answer_order(calls, is_prefill_chunk) == [[1, 2, 3, 4], [0]]
    assert answer_order(calls[1:2], is_prefill_chunk) == [[0]] and answer_order(calls[:1], is_prefill_chunk) == [[0]]


class LlmRecorder:
    """The in-process stages, recording each LLM call's prefill length."""

    def __init__(self, stages: InProcessStages) -> None:
        self.stages = stages
        self.prefills: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stages, name)

    async def llm(self, call, ready=None):
        self.prefills.append(len(call.request.input_ids))
        return await self.stages.llm(call, ready)


@pytest.fixture(scope="module")
def stages() -> InProcessStages:
    ensure_exported()
    return InProcessStages(MODEL_REPOSITORY)


async def _session(stages: InProcessStages, chunk_tokens: int, inputs: list[StepInput | ChatInput],
                   corr_id: int) -> tuple[list[StepEvent], list[int]]:
    recorder = LlmRecorder(stages)
    pipeline = DuplexPipeline(recorder, stages.preset, stages.tokenizer, 600.0, prefill_chunk_tokens=chunk_tokens,
                              default_ref_audio=default_ref_audio(MODEL_REPOSITORY / "duplex" / "1"))
    events: list[StepEvent] = []

    async def emit(ev: StepEvent) -> None:
        events.append(ev)

    for i, inp in enumerate(inputs):
        await pipeline.step(corr_id, i == 0, i == len(inputs) - 1, inp, emit)
    return events, recorder.prefills


def _same(a: list[StepEvent], b: list[StepEvent]) -> None:
    assert [(e.kind, e.text, e.end_of_turn) for e in a] == [(e.kind, e.text, e.end_of_turn) for e in b]
    for x, y in zip(a, b, strict=True):
        assert (x.metrics.kv_cache_length if x.metrics else None) == (y.metrics.kv_cache_length if y.metrics else None)
        np.testing.assert_allclose(x.audio, y.audio, atol=1e-4)
        assert x.chunk_usage == y.chunk_usage
        assert (x.metrics.n_prefill, x.metrics.cached_tokens) == (y.metrics.n_prefill, y.metrics.cached_tokens)


async def test_a_chunked_duplex_session_says_what_the_unchunked_one_says(stages: InProcessStages) -> None:
    """The system prompt and the default voice prompt's embeddings (60) in calls of at most 32 tokens."""
    rng = np.random.default_rng(5)
    options = DuplexOptions.from_config({**GREEDY, "system_prompt": PROMPT, "force_listen_count": 0})
    steps: list[StepInput | ChatInput] = [StepInput(audio=(0.1 * rng.standard_normal(16_000)).astype(np.float32),
                                                    options=options if i == 0 else None) for i in range(4)]
    whole, whole_calls = await _session(stages, 0, steps, 61)
    chunked, chunked_calls = await _session(stages, 32, steps, 62)
    assert whole_calls[0] > 400 and len(whole_calls) == 5  # four steps and the END
    assert max(chunked_calls) <= 32 and len(chunked_calls) > len(whole_calls) + 10
    _same(whole, chunked)


async def test_a_chunked_step_slides_the_window_only_where_a_unit_closes(stages: InProcessStages) -> None:
    """Short units, then one whose prefill is long (an HD frame's slices), past the basic window's high watermark,
    in calls of at most 32 tokens: the window slides as a unit closes (MiniCPM-o's `finalize_unit`), never between
    two chunks of the next unit (which the reference does not know: it prefills a unit whole); the session says
    what the unchunked one says."""
    import base64

    from .test_vision_e2e import jpeg

    frame = base64.b64decode(jpeg(1280, 480))
    rng = np.random.default_rng(6)
    options = DuplexOptions.from_config({**GREEDY, "sliding_window_mode": "basic", "basic_window_high_tokens": 260,
                                         "basic_window_low_tokens": 220})
    steps: list[StepInput | ChatInput] = [
        StepInput(audio=(0.1 * rng.standard_normal(16_000)).astype(np.float32), frames=[frame] if i == 9 else [],
                  max_slice_nums=[4] if i == 9 else [], options=options if i == 0 else None) for i in range(11)]
    whole, _ = await _session(stages, 0, steps, 65)
    chunked, chunked_calls = await _session(stages, 32, steps, 66)
    assert max(chunked_calls) <= 32
    last = whole[-1].metrics
    assert last.kv_cache_length is not None and last.kv_tokens_total is not None
    assert last.kv_tokens_total > last.kv_cache_length + 100  # it slid
    _same(whole, chunked)


async def test_a_chunked_chat_history_answers_as_the_unchunked_one(stages: InProcessStages) -> None:
    history = [ChatMessage("user" if i % 2 == 0 else "assistant", f"Message number {i} of a long chat history.")
               for i in range(12)]
    turns: list[StepInput | ChatInput] = [
        ChatInput([*history, ChatMessage("user", "And now?")], max_new_tokens=20,
                  options=DuplexOptions.from_config(GREEDY))]
    whole, whole_calls = await _session(stages, 0, turns, 63)
    chunked, chunked_calls = await _session(stages, 64, turns, 64)
    assert whole_calls[0] > 500 and max(chunked_calls) <= 64
    _same(whole, chunked)


async def test_a_chat_history_past_the_context_is_refused_before_its_prefill(stages: InProcessStages) -> None:
    """Counted up front: no prefill chunk runs (the LLM used to take it chunk by chunk, ~3.7 s of prefill, until the
    chunk that overflowed)."""
    from minicpmo_triton.errors import StepError

    context = stages.preset.duplex.context_tokens
    history = [ChatMessage("user" if i % 2 == 0 else "assistant", "x" * 2048) for i in range(context // 2048 + 1)]
    turn = ChatInput([*history, ChatMessage("user", "And now?")], max_new_tokens=20,
                     options=DuplexOptions.from_config(GREEDY))
    recorder = LlmRecorder(stages)
    pipeline = DuplexPipeline(recorder, stages.preset, stages.tokenizer, 600.0, prefill_chunk_tokens=128)

    async def emit(ev: StepEvent) -> None:
        pass

    with pytest.raises(StepError) as info:
        await pipeline.step(65, True, True, turn, emit)
    assert info.value.code == "context_full"
    assert not any(recorder.prefills), recorder.prefills  # no call brought a token (an END may have gone)


class ShapeRecorder:
    """An engine that records each forward's (rows, new tokens, past length)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.forwards: list[tuple[int, int, int]] = []

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows, new = feeds["input_ids"].shape
        self.forwards.append((rows, new, feeds["past_key"].shape[3]))
        return self.engine.run(feeds)


def test_a_prefill_chunk_never_lends_its_long_past_to_a_decoding_row(stages: InProcessStages) -> None:
    """A chunk of a long prompt batched with another session's step: that step's forwards carry only its own past
    (in one batch it would be padded to the chunk's, through every decode step)."""
    from minicpmo_triton.stages.base import StageCall

    llm = stages.llm_stage
    ids = lambda n: np.full(n, ord("a"), np.int64)  # noqa: E731 (plain text tokens)
    [first] = llm.run([StageCall(LlmRequest(input_ids=ids(300), decode=False), 71, start=True)])
    assert not isinstance(first, Exception), first
    kv = llm.kv  # the host caches' batch runner (stages.kv.HostKv)
    recorder = ShapeRecorder(kv.engine)
    kv.engine = recorder
    try:
        results = llm.run([StageCall(LlmRequest(input_ids=ids(100), decode=False), 71),
                           StageCall(LlmRequest(input_ids=ids(20), max_new_tokens=4, temperature=0.0), 72, start=True)])
    finally:
        kv.engine = recorder.engine
    assert not any(isinstance(r, Exception) for r in results), results
    assert results[0].kv_length == 400 and results[1].kv_length > 20
    long_past = [f for f in recorder.forwards if f[2] >= 300]
    assert long_past == [(1, 100, 300)], recorder.forwards  # the chunk's own forward, alone
    llm.run([StageCall(LlmRequest(decode=False), 71, end=True), StageCall(LlmRequest(decode=False), 72, end=True)])

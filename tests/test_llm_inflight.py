"""The LLM stage's in-flight loop (`InflightLlm`) in this process, on the paged engine: each call answered as its
own row is done says exactly what the stage's synchronous batch says, and a row that fails mid-loop fails alone."""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import pytest
import torch

from minicpmo_triton.errors import StepError
from minicpmo_triton.stage_io import LlmResult
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.llm_inflight import InflightLlm

from .test_engine_llm import SESSIONS, assert_same, breaking, chunk, paged_engine, preset, stage, weights

__all__ = ["preset", "weights"]  # the fixtures, used by name


class Answers:
    """The loop's replies, in the order they were sent."""

    def __init__(self) -> None:
        self.q: queue.Queue[tuple[int, LlmResult | Exception]] = queue.Queue()

    def reply(self, corr: int) -> Any:
        return lambda result: self.q.put((corr, result))

    def take(self, n: int) -> list[tuple[int, LlmResult | Exception]]:
        return [self.q.get(timeout=120) for _ in range(n)]


def test_the_inflight_loop_answers_as_the_synchronous_batch_does(preset, weights) -> None:
    torch.manual_seed(0)
    sync, live = stage(preset, paged_engine(preset, weights)), stage(preset, paged_engine(preset, weights))
    loop, answers = InflightLlm(live, 5.0), Answers()
    try:
        for step in range(3):
            calls = [StageCall(chunk(preset, c, step, **s), c, start=step == 0) for c, s in SESSIONS.items()]
            expected = dict(zip(SESSIONS, sync.run(calls), strict=True))
            for call in calls:
                loop.submit(call, answers.reply(call.corr_id))
            got = dict(answers.take(len(calls)))
            for corr in SESSIONS:
                assert_same(got[corr], expected[corr])
    finally:
        loop.close()


def test_a_row_that_fails_in_the_loop_fails_alone_and_leaves_its_session_as_it_was(preset, weights) -> None:
    """A rollback past the kept system prompt is refused in the row's preparation, inside the loop (`_roll_back`):
    that call's answer is the error, the other row's is what it is alone, and the failed session goes on."""
    live, alone = stage(preset, paged_engine(preset, weights)), stage(preset, paged_engine(preset, weights))
    loop, answers = InflightLlm(live, 5.0), Answers()
    greedy = {"temperature": 0.0, "max_new_tokens": 8}
    try:
        prompted = chunk(preset, 1, 0, **greedy)
        prompted.input_ids = np.concatenate([np.frombuffer(b"You are kind.", np.uint8), prompted.input_ids])
        loop.submit(StageCall(prompted, 1, start=True), answers.reply(1))  # the prompt is kept: 13 tokens
        loop.submit(StageCall(chunk(preset, 2, 0, **greedy), 2, start=True), answers.reply(2))
        first = dict(answers.take(2))
        assert not any(isinstance(r, Exception) for r in first.values()), first
        loop.submit(StageCall(chunk(preset, 1, 1, rollback_to=5, **greedy), 1), answers.reply(1))
        loop.submit(StageCall(chunk(preset, 2, 1, **greedy), 2), answers.reply(2))
        got = dict(answers.take(2))
        assert isinstance(got[1], StepError) and got[1].code == "invalid_input", got[1]
        expected = alone.run([StageCall(chunk(preset, 2, s, **greedy), 2, start=s == 0) for s in (0,)])
        expected += alone.run([StageCall(chunk(preset, 2, 1, **greedy), 2)])
        assert_same(got[2], expected[1])
        loop.submit(StageCall(chunk(preset, 1, 1, **greedy), 1, end=True), answers.reply(1))
        (corr, res), = answers.take(1)
        assert not isinstance(res, Exception) and res.cached_tokens == first[1].kv_length, res  # as if never sent
        assert 1 not in live.store, "END released the session"
    finally:
        loop.close()


def test_end_gives_the_sessions_blocks_back(preset, weights) -> None:
    live = stage(preset, paged_engine(preset, weights))
    pool = live.kv.pool  # type: ignore[attr-defined]
    free = pool.free_blocks
    loop, answers = InflightLlm(live, 5.0), Answers()
    try:
        loop.submit(StageCall(chunk(preset, 7, 0, temperature=0.0), 7, start=True), answers.reply(7))
        answers.take(1)
        assert pool.free_blocks < free
        loop.submit(StageCall(chunk(preset, 7, 1, temperature=0.0), 7, end=True), answers.reply(7))
        answers.take(1)
        assert pool.free_blocks == free and not live.store.values()
    finally:
        loop.close()


def test_rows_of_one_batch_answer_in_the_order_they_finish(preset, weights) -> None:
    live = stage(preset, paged_engine(preset, weights))
    loop, answers = InflightLlm(live, 5.0), Answers()
    text = np.frombuffer(b"a long forced answer, " * 4, np.uint8).astype(np.int64)
    try:
        loop.submit(StageCall(chunk(preset, 1, 0, chat=True, forced_ids=text, max_new_tokens=len(text),
                                    temperature=0.0), 1, start=True), answers.reply(1))
        loop.submit(StageCall(chunk(preset, 2, 0, decode=False), 2, start=True), answers.reply(2))
        (first, short), (second, long) = answers.take(2)
        assert (first, second) == (2, 1)
        assert short.done_iteration < long.done_iteration, (short, long)
    finally:
        loop.close()


def test_a_forward_that_fails_runs_each_unfinished_row_alone(preset, weights) -> None:
    """A forward that raises has no row to blame: the rows still in the loop are undone and run alone, so the
    clean ones answer what the synchronous batch (which isolates the same way) answers, and the broken one its
    error; the next step of every session, the broken one's included, is the same on both paths."""
    tk = preset.tokens

    def breaking_stage() -> Any:
        return stage(preset, breaking(paged_engine(preset, weights), tk.audio_start))

    def calls(step: int) -> list[StageCall]:
        out = [StageCall(chunk(preset, c, step, **s), c, start=step == 0) for c, s in SESSIONS.items()]
        if step == 1:  # session 2's chunk breaks any forward it is in
            req = out[1].request
            req.input_ids = np.concatenate([[tk.audio_start], req.input_ids])
        return out

    class Counted(InflightLlm):
        alone = 0  # rows the loop ran alone after a forward failed

        def _run_alone(self, rows: list[Any]) -> None:
            self.alone += len(rows)
            super()._run_alone(rows)

    sync, live = breaking_stage(), breaking_stage()
    loop, answers = Counted(live, 5.0), Answers()
    try:
        for step in range(3):
            expected = dict(zip(SESSIONS, sync.run(calls(step)), strict=True))
            for call in calls(step):
                loop.submit(call, answers.reply(call.corr_id))
            got = dict(answers.take(len(SESSIONS)))
            for corr in SESSIONS:
                if step == 1 and corr == 2:
                    assert isinstance(got[corr], RuntimeError) and isinstance(expected[corr], RuntimeError)
                else:
                    assert_same(got[corr], expected[corr])
        assert loop.alone >= 1, "the failed forward's rows were run alone"
    finally:
        loop.close()


def test_a_sessions_calls_queued_together_run_one_after_another(preset, weights) -> None:
    """Three steps of every session queued at once (a client that does not wait for its answers): each session's
    next call waits for its row in flight, so every answer is the one the steps give one batch at a time."""
    sync, live = stage(preset, paged_engine(preset, weights)), stage(preset, paged_engine(preset, weights))
    steps = [[StageCall(chunk(preset, c, step, **s), c, start=step == 0) for c, s in SESSIONS.items()]
             for step in range(3)]
    expected = [dict(zip(SESSIONS, sync.run(calls), strict=True)) for calls in steps]
    loop = InflightLlm(live, 5.0)
    try:
        got = queued_together(loop, steps)
        for corr in SESSIONS:
            for step in range(3):
                assert_same(got[corr][step], expected[step][corr])
    finally:
        loop.close()


def queued_together(loop: InflightLlm, steps: list[list[StageCall]]) -> dict[int, list[Any]]:
    """Every step's calls submitted at once; each session's answers, in the order they came."""
    answers = Answers()
    for calls in steps:
        for call in calls:
            loop.submit(call, answers.reply(call.corr_id))
    got: dict[int, list[Any]] = {}
    for corr, res in answers.take(sum(map(len, steps))):
        got.setdefault(corr, []).append(res)
    return got


@pytest.mark.engines  # a .ci/run step of its own: the default run stays as it was
def test_a_speaking_calls_hidden_rows_stay_on_the_device_for_the_tts_in_this_process(preset, weights) -> None:
    """`tts_in_llm`: a call that speaks keeps its text tokens' hidden rows where they are (a tensor of the engine's
    device, copied out of its row's buffer in stream order) and is answered in the iteration its row ends; they are
    the rows the host copy brings back, and a call not asked to speak still gets them on the host."""
    host, device = stage(preset, paged_engine(preset, weights)), stage(preset, paged_engine(preset, weights))
    device.hidden_on_device = True
    loops, answers = {"host": InflightLlm(host, 5.0), "device": InflightLlm(device, 5.0)}, Answers()
    forced = SESSIONS[5]
    try:
        got: dict[str, LlmResult | Exception] = {}
        for name, loop in loops.items():
            loop.submit(StageCall(chunk(preset, 5, 0, speak=True, **forced), 5, start=True), answers.reply(5))
            (_, got[name]), = answers.take(1)
        on_host, on_device = got["host"], got["device"]
        assert isinstance(on_host, LlmResult) and isinstance(on_device, LlmResult), got
        assert isinstance(on_host.tts_hidden, np.ndarray) and isinstance(on_device.tts_hidden, torch.Tensor)
        assert len(on_device.text_ids) > 0 and on_device.tts_hidden.shape == on_host.tts_hidden.shape
        assert_same(on_device, on_host)  # the text, the cache; the hidden rows within 1e-4
        loops["device"].submit(StageCall(chunk(preset, 5, 1, **forced), 5), answers.reply(5))
        (_, plain), = answers.take(1)
        assert isinstance(plain, LlmResult) and isinstance(plain.tts_hidden, np.ndarray), "not asked to speak"
    finally:
        for loop in loops.values():
            loop.close()

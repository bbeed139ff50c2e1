"""Admission off the LLM's engine thread (`InflightLlm`, stages/preparer.py, engine/lane.py): the entered rows'
encoding runs on the preparation thread while the rows decoding go on; a session's calls are still prepared one
after another, in order; a preparation that fails fails its call alone, with its code, and leaves nothing held."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from minicpmo_triton.engine.lane import Handoff, Lane
from minicpmo_triton.errors import Code, StepError
from minicpmo_triton.stage_io import LlmResult
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.llm_inflight import InflightLlm

from .test_engine_llm import SESSIONS, assert_same, chunk, paged_engine, preset, stage, weights
from .test_llm_inflight import Answers, queued_together

__all__ = ["preset", "weights"]  # the fixtures, used by name

pytestmark = pytest.mark.engines  # a .ci/run step of its own: the default run stays as it was

LONG = np.frombuffer(b"a long forced answer that keeps its row decoding, " * 3, np.uint8).astype(np.int64)


def _held_encoder(st: Any, held: set[int], gate: threading.Event | None = None,
                  error: StepError | None = None) -> list[str]:
    """The stage's encoder, wrapped: a batch holding one of the `held` audio arrays (by id) waits for `gate`, or
    raises `error`. Returns the names of the threads it ran on."""
    encoder, threads = st.encoder, []
    launch = encoder.launch

    def wrapped(items: list[Any]) -> Any:
        threads.append(threading.current_thread().name)
        if any(id(audio) in held for audio, _ in items):
            if gate is not None:
                assert gate.wait(60), "the gate was never opened"
            if error is not None:
                raise error
        return launch(items)

    encoder.launch = wrapped
    return threads


def test_rows_decoding_are_answered_while_a_new_rows_encoding_waits(preset, weights) -> None:
    """A row decodes (a long teacher-forced answer); a new session's encoding is held on the preparation thread;
    the decoding row runs to its end and is answered meanwhile, then the held row is admitted and answered as the
    synchronous batch answers it. (With `off_thread=False`, the engine thread encoding as before, the decoding row
    waits for the held encoding: this fails.)"""
    live, sync = stage(preset, paged_engine(preset, weights)), stage(preset, paged_engine(preset, weights))
    gate = threading.Event()
    held_call = StageCall(chunk(preset, 9, 0, temperature=0.0, max_new_tokens=5), 9, start=True)
    threads = _held_encoder(live, {id(held_call.request.audio)}, gate)
    loop, answers = InflightLlm(live, 5.0), Answers()
    try:
        long_call = StageCall(chunk(preset, 1, 0, chat=True, forced_ids=LONG, max_new_tokens=len(LONG),
                                    temperature=0.0), 1, start=True)
        loop.submit(long_call, answers.reply(1))
        deadline = time.monotonic() + 60
        while loop.core.iterations < 3 and time.monotonic() < deadline:  # it decodes
            time.sleep(0.01)
        loop.submit(held_call, answers.reply(9))
        (corr, first), = answers.take(1)
        assert corr == 1 and isinstance(first, LlmResult) and len(first.generated) == len(LONG), first
        assert not gate.is_set()
        gate.set()
        (corr, held), = answers.take(1)
        assert corr == 9
        assert_same(held, sync.run([StageCall(chunk(preset, 9, 0, temperature=0.0, max_new_tokens=5), 9,
                                              start=True)])[0])
        assert set(threads) == {"llm-engine-prep"}, threads
    finally:
        gate.set()
        loop.close()


def test_a_sessions_calls_are_prepared_one_after_another_in_order(preset, weights) -> None:
    """Three steps of every session queued at once: each session's next call is handed to the preparation thread
    only after its previous one was answered (its session has one owner at a time), and every answer is what
    the steps give one batch at a time. The engine's stream waits for each row's hand-off before the iteration
    its prefill joins."""
    sync, live = stage(preset, paged_engine(preset, weights)), stage(preset, paged_engine(preset, weights))
    steps = [[StageCall(chunk(preset, c, step, **s), c, start=step == 0) for c, s in SESSIONS.items()]
             for step in range(3)]
    expected = [dict(zip(SESSIONS, sync.run(calls), strict=True)) for calls in steps]
    step_of = {id(call.request): step for step, calls in enumerate(steps) for call in steps[step]}
    log: list[tuple[str, int, int]] = []
    waited: dict[tuple[int, int], int] = {}

    class Watched(InflightLlm):
        def _work(self, rows: list[Any]) -> list[Exception | None]:
            log.extend(("work", r.queued.call.corr_id, step_of[id(r.req)]) for r in rows)
            time.sleep(0.02)  # the engine thread goes on meanwhile: a session's next call must still wait
            errors = super()._work(rows)
            for r in rows:
                r.handoff = Logged(self, (r.queued.call.corr_id, step_of[id(r.req)]))
            return errors

        def _answer(self, q: Any, result: Any) -> None:
            log.append(("answer", q.call.corr_id, step_of[id(q.call.request)]))
            super()._answer(q, result)

    class Logged(Handoff):
        def __init__(self, loop: InflightLlm, key: tuple[int, int]) -> None:
            super().__init__()
            self.loop, self.key = loop, key

        def wait(self) -> None:
            waited[self.key] = self.loop.core.iterations

    loop = Watched(live, 5.0)
    try:
        got = queued_together(loop, steps)
        for corr in SESSIONS:
            mine = [(what, step) for what, c, step in log if c == corr]
            assert mine == [(what, step) for step in range(3) for what in ("work", "answer")], mine
            for step in range(3):
                assert_same(got[corr][step], expected[step][corr])
                assert waited[(corr, step)] <= got[corr][step].join_iteration, "waited before its first iteration"
    finally:
        loop.close()


def test_a_failing_preparation_fails_its_call_alone_and_holds_nothing(preset, weights) -> None:
    """Session 2's second step fails in its encoding (a coded error): its call is answered with it, session 1's
    row in the same batch answers what it answers alone; session 2's next step is the step as if never sent; after
    END the pool has every block back, the store is empty and no session is left in preparation."""
    sync, live = stage(preset, paged_engine(preset, weights)), stage(preset, paged_engine(preset, weights))
    pool = live.kv.pool  # type: ignore[attr-defined]
    free = pool.free_blocks
    greedy = {1: {"temperature": 0.0, "max_new_tokens": 6}, 2: {"temperature": 0.0, "max_new_tokens": 9}}

    def calls(step: int, end: bool = False) -> list[StageCall]:
        return [StageCall(chunk(preset, c, step, **s), c, start=step == 0, end=end) for c, s in greedy.items()]

    expected = [dict(zip(greedy, sync.run(calls(step)), strict=True)) for step in range(3)]
    broken = calls(1)
    _held_encoder(live, {id(broken[1].request.audio)}, error=StepError(Code.BAD_AUDIO, "llm: the encoder broke"))
    loop, answers = InflightLlm(live, 5.0), Answers()
    try:
        for batch in (calls(0), broken):
            for call in batch:
                loop.submit(call, answers.reply(call.corr_id))
            got = dict(answers.take(2))
        assert isinstance(got[2], StepError) and got[2].code is Code.BAD_AUDIO, got[2]
        assert_same(got[1], expected[1][1])
        retry = calls(1)[1]
        loop.submit(retry, answers.reply(2))
        (_, again), = answers.take(1)
        assert_same(again, expected[1][2])  # the failed step left no trace: its audio stream, its cache, its rng
        for call in calls(2, end=True):
            loop.submit(call, answers.reply(call.corr_id))
        last = dict(answers.take(2))
        for corr in greedy:
            assert_same(last[corr], expected[2][corr])
        assert pool.free_blocks == free and not live.store.values() and not loop._preparing
    finally:
        loop.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA stream of its own needs a GPU")
def test_the_lanes_work_is_waited_for_on_the_device_not_on_the_host() -> None:
    """Work on the lane's stream (held back by a long kernel) is read on the current stream after the hand-off's
    wait: the value is the lane's, and the host did not wait for it at the hand-off."""
    lane = Lane(torch.device("cuda"))
    with lane.work():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the lane's stream
        made = torch.full((1024,), 7.0, device="cuda")
    handoff = lane.handoff([made])
    t0 = time.perf_counter()
    handoff.wait()
    assert time.perf_counter() - t0 < 0.05, "the host waited"
    assert torch.cuda.current_stream() != lane.stream
    assert float((made * 2).sum()) == 7.0 * 2 * 1024

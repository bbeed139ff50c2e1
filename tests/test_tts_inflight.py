"""The TTS stage's in-flight loop (`InflightTts`) in this process, on the TTS's engine core: each chunk answered as
its row finishes, the same codes as the stage's synchronous batch (greedy and sampled, same seeds), END freeing a
session's blocks mid-turn, and a row whose logits break failing alone."""

from __future__ import annotations

from typing import Any

import torch

from minicpmo_triton.errors import Code, StepError
from minicpmo_triton.stage_io import TtsRequest, TtsResult
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.tts import TtsStage
from minicpmo_triton.stages.tts_inflight import InflightTts

from .test_engine_tts import SESSIONS, TURNS, paged, preset, request, weights
from .test_llm_inflight import Answers

__all__ = ["preset", "weights"]  # the fixtures, used by name


def assert_same(got: Any, expected: Any) -> None:
    assert isinstance(got, TtsResult) and isinstance(expected, TtsResult), (got, expected)
    assert got.speech_tokens.tolist() == expected.speech_tokens.tolist()
    assert got.kv_length == expected.kv_length


def chunk_calls(preset, chunk: int, sessions: dict[int, dict[str, Any]] = SESSIONS) -> list[StageCall[TtsRequest]]:
    return [StageCall(request(preset, c, chunk, **s, **TURNS[chunk]), c, start=chunk == 0) for c, s in sessions.items()]


def test_the_inflight_loop_speaks_as_the_synchronous_batch_does(preset, weights) -> None:
    """Four turns' chunks of four sessions (ragged: 3 to 25 codes, one sampled): each chunk queued at once, answered
    as its row finishes, the same codes as the synchronous batch; the short rows leave before the long ones."""
    sync, live = TtsStage(paged(preset, weights), preset, 600.0), TtsStage(paged(preset, weights), preset, 600.0)
    loop, answers = InflightTts(live, 5.0), Answers()
    try:
        for chunk in range(len(TURNS)):
            calls = chunk_calls(preset, chunk)
            expected = dict(zip(SESSIONS, sync.run(calls), strict=True))
            for call in calls:
                loop.submit(call, answers.reply(call.corr_id))
            order = answers.take(len(calls))
            for corr, got in order:
                assert_same(got, expected[corr])
            assert order[0][0] == 3, "the 3-code chunk is answered first"
    finally:
        loop.close()


def test_end_mid_turn_gives_the_sessions_blocks_back(preset, weights) -> None:
    live = TtsStage(paged(preset, weights), preset, 600.0)
    pool = live.kv.pool  # type: ignore[attr-defined]
    loop, answers = InflightTts(live, 5.0), Answers()
    try:
        loop.submit(StageCall(request(preset, 5, 0, 4, n_tokens=25, turn_start=True), 5, start=True), answers.reply(5))
        loop.submit(StageCall(request(preset, 5, 1, 4, n_tokens=25), 5), answers.reply(5))
        answers.take(2)
        assert pool.free_blocks < pool.num_blocks and live.store.get(5).cache.length > 0  # mid-turn
        loop.submit(StageCall(request(preset, 5, 2, 4, n_tokens=25), 5, end=True), answers.reply(5))
        ((_, res),) = answers.take(1)
        assert isinstance(res, TtsResult) and len(res.speech_tokens) == 25
        assert pool.free_blocks == pool.num_blocks and not pool.tables and 5 not in live.store
    finally:
        loop.close()


def test_a_row_whose_logits_break_fails_alone_and_its_session_goes_on(preset, weights) -> None:
    """Session 2's logits turn NaN in its chunk's third forward (on the device): its call is answered with
    `numeric_error` and its session left as before the call; the other rows speak what they speak alone, and
    session 2's next call is what it would have been."""
    eng = paged(preset, weights)
    live = TtsStage(eng, preset, 600.0)
    head = eng.core.runner.head
    choose, broken = head.choose, {"at": -1}

    def breaking(raw: torch.Tensor, rows: Any, state: Any, was_live: torch.Tensor, *args: Any) -> None:
        seqs = (state.seq[rows] if isinstance(rows, slice) else state.seq.index_select(0, rows)).tolist()
        seq = live.store.get(2).cache.seq
        mine = [i for i, q in enumerate(seqs) if q == seq and bool(was_live[i])]
        if mine:
            if broken["at"] == 0:
                raw = raw.clone()
                raw[mine[0]] = float("nan")
            broken["at"] -= 1
        choose(raw, rows, state, was_live, *args)

    head.choose = breaking  # type: ignore[method-assign]
    alone = {c: TtsStage(paged(preset, weights), preset, 600.0) for c in SESSIONS}
    loop, answers = InflightTts(live, 5.0), Answers()
    try:
        for chunk in (0, 1):
            calls = chunk_calls(preset, chunk)
            expected = {c.corr_id: alone[c.corr_id].run([c])[0] for c in calls}
            broken["at"] = 2 if chunk == 1 else -1
            for call in calls:
                loop.submit(call, answers.reply(call.corr_id))
            got = dict(answers.take(len(calls)))
            for corr in SESSIONS:
                if chunk == 1 and corr == 2:
                    assert isinstance(got[2], StepError) and got[2].code == Code.NUMERIC_ERROR, got[2]
                else:
                    assert_same(got[corr], expected[corr])
        loop.submit(chunk_calls(preset, 1, {2: SESSIONS[2]})[0], answers.reply(2))
        ((_, res),) = answers.take(1)
        assert_same(res, expected[2])  # as if the failed call had never been sent
    finally:
        loop.close()


def test_a_sessions_chunks_queued_together_run_one_after_another(preset, weights) -> None:
    """Every chunk of every session queued at once: a session's next chunk waits for its row in flight, so the
    answers are the synchronous batches'."""
    sync, live = TtsStage(paged(preset, weights), preset, 600.0), TtsStage(paged(preset, weights), preset, 600.0)
    steps = [chunk_calls(preset, chunk) for chunk in range(len(TURNS))]
    expected = [dict(zip(SESSIONS, sync.run(calls), strict=True)) for calls in steps]
    loop, answers = InflightTts(live, 5.0), Answers()
    try:
        for calls in steps:
            for call in calls:
                loop.submit(call, answers.reply(call.corr_id))
        got: dict[int, list[Any]] = {}
        for corr, res in answers.take(len(TURNS) * len(SESSIONS)):
            got.setdefault(corr, []).append(res)
        for corr in SESSIONS:
            for chunk in range(len(TURNS)):
                assert_same(got[corr][chunk], expected[chunk][corr])
    finally:
        loop.close()

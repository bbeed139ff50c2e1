"""A new voice's prompt is prepared off the batch: the other calls of its batch are answered while it is being
computed, and its own call's audio is what the stage gives it when it computes the prompt in its step."""

from __future__ import annotations

import asyncio
import queue
import threading

import numpy as np
import pytest

from gateway.codes import ClientCode
from minicpmo_triton.errors import CLOSE_REASONS, RETRYABLE, Code, StepError
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.stage_io import Token2WavRequest, Token2WavResult
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.token2wav import Token2WavStage
from minicpmo_triton.stages.voice_prep import VoicePreparer
from minicpmo_triton.stages.voice_prompt import VoiceFeatures

from .conftest import MODEL_REPOSITORY, ensure_exported

GUARD_S = 120  # only against a hang: the order of the answers is what is checked, not their time


def _stage() -> Token2WavStage:
    ensure_exported()
    folder = MODEL_REPOSITORY / "token2wav" / "1"
    return Token2WavStage.load(folder, load_stage_config(folder), 600)


def _calls(voice: np.ndarray) -> list[StageCall[Token2WavRequest]]:
    tokens = np.random.default_rng(0).integers(0, 6000, 30)
    return [StageCall(Token2WavRequest(speech_tokens=tokens, turn_start=True), 1, start=True),  # the default voice
            StageCall(Token2WavRequest(speech_tokens=tokens, turn_start=True, voice=voice), 2, start=True)]


class _Held:
    """A featurizer that waits for `release` before it computes: the preparation of a new voice is under way."""

    def __init__(self, featurize) -> None:
        self.featurize, self.started, self.release = featurize, threading.Event(), threading.Event()

    def __call__(self, audio: np.ndarray) -> VoiceFeatures:
        self.started.set()
        assert self.release.wait(GUARD_S)
        return self.featurize(audio)


@pytest.fixture(scope="module")
def voice() -> np.ndarray:
    return 0.1 * np.random.default_rng(1).standard_normal(2 * 16_000).astype(np.float32)


def test_a_batch_is_answered_while_a_new_voice_is_prepared_and_that_voice_sounds_as_computed_in_its_step(
        voice) -> None:
    stage = _stage()
    stage.prompts.get(b"default", None)  # the default voice's prompt, at hand (the server's first session's)
    held = _Held(stage.prompts.featurize)
    stage.prompts.featurize = held
    prep = VoicePreparer(stage)
    answered: queue.Queue[tuple[int, Token2WavResult | Exception]] = queue.Queue()
    calls = _calls(voice)
    try:
        prep.serve(calls, [lambda r, c=c: answered.put((c.corr_id, r)) for c in calls])
        first, result = answered.get(timeout=GUARD_S)
        assert first == 1 and held.started.is_set() and not held.release.is_set()  # the setup still runs
        assert answered.empty()
        held.release.set()
        second, voiced = answered.get(timeout=GUARD_S)
    finally:
        held.release.set()
        prep.close()
    assert second == 2 and isinstance(result, Token2WavResult) and isinstance(voiced, Token2WavResult)
    # each call run alone by the stage, the prompt computed in its step (as before): the same audio, bit for bit
    before = _stage()
    for call, got in zip(calls, (result, voiced), strict=True):
        np.testing.assert_array_equal(got.waveform, before.run([call])[0].waveform)
    # and the two as one batch, as before (rows batched differ from rows alone by float rounding only)
    batched = _stage().run(calls)
    for got, was in zip((result, voiced), batched, strict=True):
        np.testing.assert_allclose(got.waveform, was.waveform, rtol=0, atol=1e-6)
    # the default, reused by session 1; the new voice prepared ahead: computed for session 2, not reused
    assert (stage.prompts.computed, stage.prompts.reused) == (2, 1)


def test_two_sessions_with_one_new_voice_share_one_preparation(voice) -> None:
    stage = _stage()
    prep = VoicePreparer(stage)
    answered: queue.Queue[Token2WavResult | Exception] = queue.Queue()
    calls = [StageCall(Token2WavRequest(speech_tokens=np.arange(10), turn_start=True, voice=voice), c, start=True)
             for c in (1, 2)]
    try:
        prep.serve(calls, [answered.put] * 2)
        results = [answered.get(timeout=GUARD_S) for _ in calls]
    finally:
        prep.close()
    assert all(isinstance(r, Token2WavResult) for r in results)
    assert (stage.prompts.computed, stage.prompts.reused) == (1, 1)


def test_a_failed_preparation_fails_its_call_alone_and_its_end_ends_the_sequence(voice) -> None:
    stage = _stage()

    def broken(audio: np.ndarray) -> VoiceFeatures:
        raise RuntimeError("featurizer down")

    stage.prompts.featurize = broken
    prep = VoicePreparer(stage)
    stage.run([StageCall(Token2WavRequest(speech_tokens=np.arange(5), turn_start=True), 3, start=True)])
    answered: queue.Queue[Token2WavResult | Exception] = queue.Queue()
    call = StageCall(Token2WavRequest(speech_tokens=np.arange(5), turn_start=True, voice=voice), 3, end=True)
    try:
        prep.serve([call], [answered.put])
        result = answered.get(timeout=GUARD_S)
    finally:
        prep.close()
    assert isinstance(result, RuntimeError) and 3 not in stage.store


def test_past_the_queue_bound_a_new_voice_is_refused_at_once_and_the_others_go_on(voice) -> None:
    """One preparation queued (max_queued=1) and held: another new reference is refused `queue_full` (retryable,
    and the gateway tells the caller so) at once, while the held one's sharer and a known voice are not refused."""
    stage = _stage()
    stage.prompts.get(b"default", None)
    held = _Held(stage.prompts.featurize)
    stage.prompts.featurize = held
    prep = VoicePreparer(stage, max_queued=1)
    other = 0.1 * np.random.default_rng(2).standard_normal(2 * 16_000).astype(np.float32)
    tokens = np.arange(10)
    answered: queue.Queue[tuple[int, Token2WavResult | Exception]] = queue.Queue()

    def serve(corr_id: int, **request) -> None:
        call = StageCall(Token2WavRequest(speech_tokens=tokens, turn_start=True, **request), corr_id, start=True,
                         end=corr_id == 2)
        prep.serve([call], [lambda r: answered.put((corr_id, r))])

    try:
        serve(1, voice=voice)  # queued, held
        assert held.started.wait(GUARD_S)
        serve(2, voice=other)  # a second new voice: refused, now
        refused_id, refused = answered.get(timeout=GUARD_S)
        serve(3, voice=voice)  # the same reference as 1: shares its preparation, not refused
        serve(4)  # the default voice: answered now
        assert answered.get(timeout=GUARD_S)[0] == 4 and answered.empty()
        held.release.set()
        rest = dict(answered.get(timeout=GUARD_S) for _ in range(2))
    finally:
        held.release.set()
        prep.close()
    assert refused_id == 2 and isinstance(refused, StepError) and refused.code == Code.QUEUE_FULL, refused
    assert 2 not in stage.store  # its END still ended it
    assert Code.QUEUE_FULL in RETRYABLE and ClientCode(CLOSE_REASONS[Code.QUEUE_FULL]) == ClientCode.QUEUE_FULL
    assert all(isinstance(r, Token2WavResult) for r in rest.values()) and set(rest) == {1, 3}
    assert stage.prompts.computed == 2  # the default's and the one shared new voice's; never the refused one


async def test_in_process_a_new_voice_is_prepared_off_the_event_loop(voice) -> None:
    """The in-process stages (the tests' and benchmarks' reference) use the same preparer: while one session's new
    voice is being prepared, another session's token2wav call is answered, and the first then is too."""
    ensure_exported()
    stages = InProcessStages(MODEL_REPOSITORY)
    stage = stages.t2w_stage
    stage.prompts.get(b"default", None)
    held = _Held(stage.prompts.featurize)
    stage.prompts.featurize = held
    voiced, plain = _calls(voice)[1], _calls(voice)[0]
    try:
        first = asyncio.ensure_future(stages.token2wav(voiced))
        assert await asyncio.to_thread(held.started.wait, GUARD_S)
        result = await asyncio.wait_for(stages.token2wav(plain), GUARD_S)  # not behind the preparation
        assert not first.done() and not held.release.is_set()
        held.release.set()
        voiced_result = await asyncio.wait_for(first, GUARD_S)
    finally:
        held.release.set()
        stages.voices.close()
    assert isinstance(result, Token2WavResult) and isinstance(voiced_result, Token2WavResult)
    np.testing.assert_array_equal(voiced_result.waveform, _stage().run([voiced])[0].waveform)

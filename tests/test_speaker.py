"""`stages.speaker.Speaker` (tts_in_llm): an llm call that spoke is answered twice, its result and then the TTS's
codes, and the TTS's sequence follows the LLM's (START with the first spoken chunk, a refused start ENDed at once and
started again by the next, END with the LLM's END, after which the call's final answer goes). The TTS's engine loop,
outside what is tested, is a fake that records the calls and answers them when told."""

from __future__ import annotations

from typing import Any

import numpy as np

from minicpmo_triton.errors import Code, StepError
from minicpmo_triton.stage_io import LlmRequest, LlmResult, SpeechRefused, TtsRequest, TtsResult
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.speaker import Speaker


class FakeTtsLoop:
    def __init__(self) -> None:
        self.queued: list[tuple[StageCall[TtsRequest], Any]] = []

    def submit(self, call: StageCall[TtsRequest], reply: Any) -> None:
        self.queued.append((call, reply))

    def answer(self, result: Any = None) -> StageCall[TtsRequest]:
        call, reply = self.queued.pop(0)
        reply(TtsResult(speech_tokens=np.arange(3)) if result is None else result)
        return call

    def close(self) -> None:
        pass


SPEAK = LlmRequest(speak=True, tts_turn_start=True, tts_tokens=25, tts_temperature=0.0, seed=7)
SPOKE = LlmResult(text_ids=np.array([5, 6]), tts_hidden=np.ones((2, 4), np.float32), is_listen=False,
                  end_of_turn=True)


def answered(speaker: Speaker, call: StageCall[LlmRequest], result: Any) -> list[tuple[Any, bool]]:
    sent: list[tuple[Any, bool]] = []
    speaker.reply(call, lambda r, final: sent.append((r, final)))(result)
    return sent


def test_a_call_that_spoke_is_answered_with_its_text_then_its_codes() -> None:
    tts = FakeTtsLoop()
    speaker = Speaker(tts)  # type: ignore[arg-type]
    sent = answered(speaker, StageCall(SPEAK, 1, start=True), SPOKE)
    assert len(sent) == 1 and not sent[0][1], "the text goes out before the codes"
    assert sent[0][0].text_ids.tolist() == [5, 6] and sent[0][0].tts_hidden.size == 0, "its hidden rows stay here"
    call = tts.answer()
    assert call.start and not call.end and call.corr_id == 1
    req = call.request
    assert req.text_ids.tolist() == [5, 6] and req.tts_hidden is SPOKE.tts_hidden, "the hidden rows as they are"
    assert (req.turn_start, req.turn_end, req.n_tokens, req.temperature, req.seed) == (True, True, 25, 0.0, 7)
    assert sent[1][1] and sent[1][0].speech_tokens.tolist() == [0, 1, 2]
    answered(speaker, StageCall(SPEAK, 1), SPOKE)
    assert not tts.answer().start, "the session's TTS is started once"


def test_a_listen_or_a_call_not_asked_to_speak_is_one_answer() -> None:
    tts = FakeTtsLoop()
    speaker = Speaker(tts)  # type: ignore[arg-type]
    listened = LlmResult(is_listen=True)
    assert answered(speaker, StageCall(SPEAK, 1, start=True), listened) == [(listened, True)]
    assert answered(speaker, StageCall(LlmRequest(), 1), SPOKE) == [(SPOKE, True)]
    refused = StepError(Code.POOL_FULL, "full")
    assert answered(speaker, StageCall(SPEAK, 1), refused) == [(refused, True)]
    assert not tts.queued


def test_a_refused_start_is_ended_and_the_next_spoken_chunk_starts_again() -> None:
    tts = FakeTtsLoop()
    speaker = Speaker(tts)  # type: ignore[arg-type]
    sent = answered(speaker, StageCall(SPEAK, 1, start=True), SPOKE)
    refused = StepError(Code.POOL_FULL, "the TTS pool is full")
    tts.answer(refused)
    told, final = sent[-1]
    assert final and isinstance(told, SpeechRefused), "a refusal after the text rides as a plain response"
    error = told.error()
    assert error is not None and error.code == "pool_full", error
    end = tts.answer(TtsResult())
    assert end.end and not end.start and end.request.n_tokens == 0, "the state its START made is freed now"
    answered(speaker, StageCall(SPEAK, 1), SPOKE)
    assert tts.answer().start


def test_the_llms_end_ends_the_tts_and_is_answered_after_it() -> None:
    tts = FakeTtsLoop()
    speaker = Speaker(tts)  # type: ignore[arg-type]
    answered(speaker, StageCall(SPEAK, 1, start=True), SPOKE)
    tts.answer()
    ended = LlmResult()
    sent = answered(speaker, StageCall(LlmRequest(decode=False), 1, end=True), ended)
    assert sent == [], "the END's answer waits for the TTS's"
    end = tts.answer(TtsResult())
    assert end.end and end.corr_id == 1
    assert sent == [(ended, True)]
    # a session that never spoke: its END is the LLM's alone
    assert answered(speaker, StageCall(LlmRequest(decode=False), 2, end=True), ended) == [(ended, True)]
    assert not tts.queued
    # a new sequence on the same id starts its TTS again
    answered(speaker, StageCall(SPEAK, 1, start=True), SPOKE)
    assert tts.answer().start


def test_a_tts_call_of_its_own_is_on_the_sessions_tts_sequence() -> None:
    """A turn-based reply's voice (`Speaker.voice`): the same TTS sequence a spoken duplex chunk starts, started once,
    a refused start ENDed at once and told as the error itself (its one response), ENDed with the LLM's END."""
    tts = FakeTtsLoop()
    speaker = Speaker(tts)  # type: ignore[arg-type]
    sent: list[tuple[Any, bool]] = []
    chunk = TtsRequest(text_ids=np.array([5]), tts_hidden=np.ones((1, 4), np.float32), turn_start=True, n_tokens=4)
    speaker.voice(StageCall(chunk, 1), lambda r, final: sent.append((r, final)))
    refused = StepError(Code.POOL_FULL, "the TTS pool is full")
    call = tts.answer(refused)
    assert call.start and not call.end and call.request is chunk
    assert sent == [(refused, True)], "a call of its own is refused with the error itself"
    assert tts.answer(TtsResult()).end, "the state its START made is freed now"
    speaker.voice(StageCall(chunk, 1), lambda r, final: sent.append((r, final)))
    assert tts.answer().start and sent[-1][1] and sent[-1][0].speech_tokens.tolist() == [0, 1, 2]
    speaker.voice(StageCall(chunk, 1), lambda r, final: sent.append((r, final)))
    assert not tts.answer().start, "started once"
    answered(speaker, StageCall(SPEAK, 1), SPOKE)
    assert not tts.answer().start, "a spoken duplex chunk joins the same sequence"
    ended = LlmResult()
    answered(speaker, StageCall(LlmRequest(decode=False), 1, end=True), ended)
    assert tts.answer(TtsResult()).end

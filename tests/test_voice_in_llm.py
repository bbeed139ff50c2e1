"""`token2wav_in_llm` without a server: the Speaker hands the TTS's codes to token2wav in the process (a refused start
ENDed and started again by the next chunk; the LLM's END ends the TTS, then token2wav, then answers), and the duplex
pipeline drops a cancelled step's voice (read, not emitted) and sends token2wav's fields in the llm call. The engine
loops and the stages, outside what is tested, are fakes that record their calls."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from minicpmo_triton.duplex_contract import StepEvent, StepInput, VoiceRefs
from minicpmo_triton.errors import Code, StepError
from minicpmo_triton.media.tokenizer import load_tokenizer
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.serving.pipeline import DuplexPipeline
from minicpmo_triton.stage_io import LlmResult, SpeechRefused, Token2WavResult, VoicedSpeech
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.speaker import Speaker

from .conftest import MODEL_REPOSITORY, ensure_exported
from .helpers import GREEDY
from .test_speaker import SPEAK, SPOKE, FakeTtsLoop, answered


class FakeToken2Wav(FakeTtsLoop):
    def answer(self, result: Any = None) -> StageCall[Any]:
        call, reply = self.queued.pop(0)
        reply(Token2WavResult(np.full(4, 0.5, np.float32)) if result is None else result)
        return call


VOICE = np.full(16_000, 0.1, np.float32)


def test_the_codes_go_on_to_token2wav_and_its_audio_is_the_second_answer() -> None:
    tts, t2w = FakeTtsLoop(), FakeToken2Wav()
    speaker = Speaker(tts, t2w)  # type: ignore[arg-type]
    request = SPEAK.__class__(**{**SPEAK.__dict__, "voice_turn_start": True, "voice": VOICE})
    sent = answered(speaker, StageCall(request, 1, start=True), SPOKE)
    tts.answer()
    assert len(sent) == 1, "no answer before token2wav's"
    call = t2w.answer()
    assert call.start and not call.end and call.request.speech_tokens.tolist() == [0, 1, 2]
    assert call.request.turn_start and call.request.finalize and call.request.voice is VOICE, "the LLM call's fields"
    audio, final = sent[1]
    assert final and isinstance(audio, VoicedSpeech) and audio.n_speech_tokens == 3 and len(audio.waveform) == 4
    answered(speaker, StageCall(SPEAK, 1), SPOKE)
    tts.answer()
    assert not t2w.answer().start, "the session's token2wav is started once"


def test_a_refused_token2wav_start_is_ended_and_the_next_chunk_starts_it_again() -> None:
    tts, t2w = FakeTtsLoop(), FakeToken2Wav()
    speaker = Speaker(tts, t2w)  # type: ignore[arg-type]
    sent = answered(speaker, StageCall(SPEAK, 1, start=True), SPOKE)
    tts.answer()
    t2w.answer(StepError(Code.QUEUE_FULL, "busy"))
    refusal = sent[1][0]
    assert isinstance(refusal, SpeechRefused) and refusal.error().code == Code.QUEUE_FULL  # type: ignore[union-attr]
    assert t2w.answer().end, "the state its START made is ENDed at once"
    answered(speaker, StageCall(SPEAK, 1), SPOKE)
    tts.answer()
    assert t2w.answer().start, "the next chunk starts it again"


def test_the_llms_end_ends_the_tts_then_token2wav_before_its_answer() -> None:
    tts, t2w = FakeTtsLoop(), FakeToken2Wav()
    speaker = Speaker(tts, t2w)  # type: ignore[arg-type]
    answered(speaker, StageCall(SPEAK, 1, start=True), SPOKE)
    tts.answer()
    t2w.answer()
    ended = LlmResult()
    sent = answered(speaker, StageCall(SPEAK.__class__(decode=False), 1, end=True), ended)
    assert tts.answer().end and not sent, "the TTS's END first"
    assert t2w.answer().end and sent == [(ended, True)], "then token2wav's, then the answer"


class SpeakingStages:
    """The stages of a duplex model over an llm model that runs the TTS and token2wav: every llm call speaks; `cancel`
    cancels the session while its first speaking call is in flight."""

    def __init__(self, pipeline: list[DuplexPipeline]) -> None:
        self.pipeline = pipeline
        self.llm_calls: list[Any] = []
        self.speech_reads = 0
        self.token2wav_calls = 0

    async def llm(self, call: StageCall[Any], ready: Any = None) -> LlmResult:
        self.llm_calls.append(call.request)
        if not call.request.decode:
            return LlmResult()
        if len(self.llm_calls) == 1:
            self.pipeline[0].cancel(call.corr_id)  # a barge-in while the step is at the LLM
        return LlmResult(generated=np.array([100, 101]), text_ids=np.array([100, 101]), is_listen=False)

    async def speech(self, corr_id: int) -> VoicedSpeech:
        self.speech_reads += 1
        return VoicedSpeech(np.ones(24_000, np.float32), 25)

    async def token2wav(self, call: StageCall[Any]) -> Token2WavResult:
        self.token2wav_calls += 1
        return Token2WavResult()

    async def tts(self, call: StageCall[Any]) -> None:
        raise AssertionError("the tts model is never called")


@pytest.mark.asyncio
async def test_a_cancelled_steps_voice_is_read_and_dropped_and_its_reference_sent_again() -> None:
    ensure_exported()
    preset = load_stage_config(MODEL_REPOSITORY / "llm" / "1")
    holder: list[DuplexPipeline] = []
    stages = SpeakingStages(holder)
    pipeline = DuplexPipeline(stages, preset, load_tokenizer(preset, MODEL_REPOSITORY / "duplex" / "1"),  # type: ignore[arg-type]
                              600.0, tts_in_llm=True, token2wav_in_llm=True)
    holder.append(pipeline)
    events: list[StepEvent] = []

    async def emit(event: StepEvent) -> None:
        events.append(event)

    options = DuplexOptions.from_config({**GREEDY, "force_listen_count": 0})
    audio = np.zeros(16_000, np.float32)
    await pipeline.step(5, True, False, StepInput(audio=audio, options=options, voice=VoiceRefs(tts_ref_audio=VOICE)),
                        emit)
    assert stages.speech_reads == 1, "the cancelled step's voice is read to its end"
    assert [e.kind for e in events] == ["listen"], "and dropped: no words, no audio"
    await pipeline.step(5, False, False, StepInput(audio=audio), emit)
    await pipeline.step(5, False, True, StepInput(audio=audio), emit)
    assert [len(e.audio) for e in events if e.kind == "audio"] == [24_000, 24_000]
    assert [e.chunk_usage["output_speech_tokens"] for e in events[1:] if e.chunk_usage] == [25, 25]
    speaking = [r for r in stages.llm_calls if r.decode]
    # the reference rides with each turn's first call until a call is voiced: the cancel's turn is dropped
    assert [len(r.voice) for r in speaking] == [16_000, 16_000, 0]
    assert [r.voice_turn_start for r in speaking] == [True, True, False]
    assert stages.token2wav_calls == 0, "the token2wav model is never called"

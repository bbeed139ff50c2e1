"""All four stages in this process, called directly: the benchmark's baseline and the tests' reference.

token2wav's calls go through the same `VoicePreparer` as the Triton model's: a new voice's prompt is prepared on
its worker, off the event loop (other sessions' steps go on meanwhile), within the same `voice_prep_queue` bound.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from .. import stage_io as io
from ..engine.exported import load_engine
from ..errors import Code, StepError
from ..media.tokenizer import load_tokenizer
from ..model_config import PresetConfig, load_stage_config
from ..stages.audio_encoder import AudioEncoderStage, AudioStreamEncoder
from ..stages.base import SequenceStage, StageCall
from ..stages.llm import LlmStage
from ..stages.token2wav import Token2WavStage
from ..stages.tts import TtsStage, with_tts_sampling
from ..stages.vision_encoder import VisionEncoderStage
from ..stages.voice_prep import VoicePreparer
from ..stages.voice_prompt import default_ref_audio
from .pipeline import DuplexPipeline, Ready
from .stage_settings import stage_setting


def _raise(result: Any) -> Any:
    if isinstance(result, Exception):
        raise result
    return result


def _one(stage: SequenceStage[Any, Any, Any], call: StageCall[Any]) -> Any:
    return _raise(stage.run([call])[0])


class InProcessStages:
    def __init__(self, repository: Path, threads: int = 1, ttl_s: float = 600.0) -> None:
        repository = self.repository = Path(repository)
        self.preset: PresetConfig = load_stage_config(repository / "llm" / "1")
        self.tokenizer = load_tokenizer(self.preset, repository / "duplex" / "1")
        v = lambda name: repository / name / "1"  # noqa: E731 (a one-line helper)
        self.encoder = AudioEncoderStage(load_engine(v("audio_encoder"), threads), self.preset.samples_per_audio_token)
        self.vision = VisionEncoderStage(load_engine(v("vision_encoder"), threads), self.preset.vision)
        self.stream_encoder = AudioStreamEncoder(load_engine(v("audio_encoder"), threads, "stream"), self.preset.audio,
                                                 self.preset.samples_per_audio_token)
        self.llm_stage = LlmStage(load_engine(v("llm"), threads), self.preset, self.tokenizer, ttl_s,
                                  self.stream_encoder)
        tts_preset = with_tts_sampling(self.preset, int(stage_setting("tts_top_k", {})),
                                       float(stage_setting("tts_top_p", {})))
        self.tts_stage = TtsStage(load_engine(v("tts"), threads), tts_preset, ttl_s)
        self.t2w_stage = Token2WavStage.load(v("token2wav"), self.preset, ttl_s, threads)
        self.voices = VoicePreparer(self.t2w_stage, int(stage_setting("voice_prep_queue", {})))

    async def audio_encoder(self, request: io.AudioEncoderRequest) -> io.AudioEncoderResult:
        return _raise(self.encoder.run([request])[0])

    async def vision_encoder(self, request: io.VisionEncoderRequest) -> io.VisionEncoderResult:
        return _raise(self.vision.run([request])[0])

    async def llm(self, call: StageCall[io.LlmRequest], ready: Ready | None = None) -> io.LlmResult:
        if ready is not None:
            await ready()
        return _one(self.llm_stage, call)

    async def tts(self, call: StageCall[io.TtsRequest]) -> io.TtsResult:
        return _one(self.tts_stage, call)

    async def speech(self, corr_id: int) -> io.TtsResult | io.VoicedSpeech:
        """Never asked for: this process's LLM is the ONNX one, which runs no TTS (`tts_in_llm`)."""
        raise StepError(Code.STAGE_ERROR, "the in-process llm runs no TTS")

    async def speak(self, call: StageCall[io.TtsRequest], voice: io.Token2WavRequest | None = None
                    ) -> io.TtsResult | io.VoicedSpeech:
        """Never asked for, as `speech`."""
        raise StepError(Code.STAGE_ERROR, "the in-process llm runs no TTS")

    async def token2wav(self, call: StageCall[io.Token2WavRequest]) -> io.Token2WavResult:
        """Answered at once, or (a new voice) once its prompt is prepared on the preparer's worker."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[io.Token2WavResult | Exception] = loop.create_future()

        def settle(result: io.Token2WavResult | Exception) -> None:
            if not answer.done():
                answer.set_result(result)

        def answered(result: io.Token2WavResult | Exception) -> None:  # on this loop, or the preparer's worker
            loop.call_soon_threadsafe(settle, result)

        self.voices.serve([call], [answered])
        return _raise(await answer)

    def pipeline(self, ttl_s: float = 600.0) -> DuplexPipeline:
        return DuplexPipeline(self, self.preset, self.tokenizer, ttl_s,
                              default_ref_audio=default_ref_audio(self.repository / "duplex" / "1"))

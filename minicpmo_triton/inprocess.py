"""All four stages in this process, called directly: the benchmark's baseline and the tests' reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import stage_io as io
from .engines import load_engine
from .model_config import PresetConfig, load_stage_config
from .pipeline import DuplexPipeline, Ready
from .stages.audio_encoder import AudioEncoderStage, AudioStreamEncoder
from .stages.base import SequenceStage, StageCall
from .stages.llm import LlmStage
from .stages.token2wav import Token2WavStage
from .stages.tts import TtsStage
from .stages.vision_encoder import VisionEncoderStage
from .tokenizer import load_tokenizer
from .voice_prompt import default_ref_audio


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
        self.tts_stage = TtsStage(load_engine(v("tts"), threads), self.preset, ttl_s)
        self.t2w_stage = Token2WavStage.load(v("token2wav"), self.preset, ttl_s, threads)

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

    async def token2wav(self, call: StageCall[io.Token2WavRequest]) -> io.Token2WavResult:
        return _one(self.t2w_stage, call)

    def pipeline(self, ttl_s: float = 600.0) -> DuplexPipeline:
        return DuplexPipeline(self, self.preset, self.tokenizer, ttl_s,
                              default_ref_audio=default_ref_audio(self.repository / "duplex" / "1"))

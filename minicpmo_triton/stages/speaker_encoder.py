"""Speaker encoder: stateless; a voice reference -> its 192-d embedding (once per session, not hot)."""

from __future__ import annotations

import numpy as np

from ..engines import Engine
from ..errors import StepError
from ..pcm import pcm_problem
from ..stage_io import SpeakerEncoderRequest, SpeakerEncoderResult

MIN_SAMPLES = 1600


class SpeakerEncoderStage:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _one(self, request: SpeakerEncoderRequest) -> SpeakerEncoderResult:
        audio = np.asarray(request.audio, np.float32).reshape(-1)
        if len(audio) < MIN_SAMPLES:
            raise ValueError(f"speaker_encoder: a voice reference needs {MIN_SAMPLES} samples")
        if problem := pcm_problem(audio):
            raise StepError("bad_audio", f"speaker_encoder: {problem}")
        return SpeakerEncoderResult(self.engine.run({"audio": audio[None]})["embedding"][0])

    def run(self, requests: list[SpeakerEncoderRequest]) -> list[SpeakerEncoderResult | Exception]:
        results: list[SpeakerEncoderResult | Exception] = []
        for r in requests:  # one forward each: a reference's length is its own
            try:
                results.append(self._one(r))
            except Exception as exc:  # noqa: BLE001 (a bad reference fails its own request only)
                results.append(exc)
        return results

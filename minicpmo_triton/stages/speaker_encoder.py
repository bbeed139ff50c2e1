"""Speaker encoder: stateless; a voice reference -> its 192-d embedding (once per session, not hot)."""

from __future__ import annotations

import numpy as np

from ..engines import Engine
from ..stage_io import SpeakerEncoderRequest, SpeakerEncoderResult

MIN_SAMPLES = 1600


class SpeakerEncoderStage:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def run(self, requests: list[SpeakerEncoderRequest]) -> list[SpeakerEncoderResult | Exception]:
        results: list[SpeakerEncoderResult | Exception] = []
        for r in requests:
            audio = np.asarray(r.audio, np.float32).reshape(-1)
            if len(audio) < MIN_SAMPLES:
                results.append(ValueError(f"speaker_encoder: a voice reference needs {MIN_SAMPLES} samples"))
                continue
            results.append(SpeakerEncoderResult(self.engine.run({"audio": audio[None]})["embedding"][0]))
        return results

"""Audio encoder: stateless, batches chunks of equal length into one forward."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..engines import Engine
from ..errors import StepError
from ..pcm import pcm_problem
from ..stage_io import AudioEncoderRequest, AudioEncoderResult
from .base import isolated


class AudioEncoderStage:
    def __init__(self, engine: Engine, samples_per_token: int) -> None:
        self.engine = engine
        self.samples_per_token = samples_per_token

    def pad(self, audio: np.ndarray) -> np.ndarray:
        audio = np.asarray(audio, np.float32).reshape(-1)
        return np.pad(audio, (0, -len(audio) % self.samples_per_token))

    def _encode(self, chunks: list[np.ndarray]) -> list[AudioEncoderResult]:
        return [AudioEncoderResult(embeds=e) for e in self.engine.run({"audio": np.stack(chunks)})["embeds"]]

    def run(self, requests: list[AudioEncoderRequest]) -> list[AudioEncoderResult | Exception]:
        results: list[AudioEncoderResult | Exception] = [AudioEncoderResult() for _ in requests]
        groups: dict[int, list[int]] = defaultdict(list)
        padded = []
        for i, r in enumerate(requests):
            padded.append(self.pad(r.audio))
            if len(padded[-1]) == 0:
                results[i] = ValueError("audio_encoder got an empty chunk")
            elif problem := pcm_problem(padded[-1]):
                results[i] = StepError("bad_audio", f"audio_encoder: {problem}")
            else:
                groups[len(padded[-1])].append(i)
        for rows in groups.values():  # padding would change the mel normalisation: batch equal lengths
            for i, out in zip(rows, isolated(self._encode, [padded[i] for i in rows]), strict=True):
                results[i] = out
        return results

"""Server VAD: Silero's ONNX model (shipped in the `silero-vad` package) under onnxruntime, no torch.

`SpeechSegmenter` is pure: speech probabilities in, `speech_started` / `speech_stopped` out, with
OpenAI's `threshold`, `prefix_padding_ms` and `silence_duration_ms`. `SileroVad` turns 16 kHz audio
into those probabilities, 32 ms (512 samples) at a time, keeping its recurrent state per session.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

RATE = 16_000
WINDOW = 512  # samples per probability at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous window the model sees first
WINDOW_MS = WINDOW * 1000 // RATE


class VadUnavailable(RuntimeError):
    pass


def silero_model_path() -> Path:
    """The ONNX file inside the installed `silero-vad` package, found without importing it (it imports torch)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise VadUnavailable("server VAD needs the silero-vad package (pip install --no-deps silero-vad)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    if not path.exists():
        raise VadUnavailable(f"silero-vad is installed but {path} is missing")
    return path


_session = None


def _shared_session():  # -> onnxruntime.InferenceSession (imported late)
    """One model for the whole gateway; the per-stream state lives in SileroVad."""
    global _session
    if _session is None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        _session = ort.InferenceSession(str(silero_model_path()), opts, providers=["CPUExecutionProvider"])
    return _session


class SileroVad:
    """Speech probability per 32 ms window of one audio stream."""

    def __init__(self) -> None:
        self._model = _shared_session()
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros(CONTEXT, np.float32)
        self._rest = np.zeros(0, np.float32)

    def probabilities(self, audio: np.ndarray) -> list[float]:
        audio = np.concatenate([self._rest, np.asarray(audio, np.float32)])
        n = len(audio) // WINDOW
        self._rest = audio[n * WINDOW:]
        out = []
        sr = np.array(RATE, np.int64)
        for i in range(n):
            window = audio[i * WINDOW:(i + 1) * WINDOW]
            x = np.concatenate([self._context, window])[None, :]
            prob, self._state = self._model.run(None, {"input": x, "state": self._state, "sr": sr})
            self._context = window[-CONTEXT:]
            out.append(float(prob.reshape(-1)[0]))
        return out


@dataclass
class VadEvent:
    kind: Literal["speech_started", "speech_stopped"]
    audio_ms: int  # audio_start_ms (prefix padding included) or audio_end_ms, from the stream's start


@dataclass
class SpeechSegmenter:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    window_ms: int = WINDOW_MS
    position_ms: int = 0  # audio seen so far
    in_speech: bool = False
    _silence_ms: int = 0

    def feed(self, probabilities: list[float]) -> list[VadEvent]:
        events = []
        for p in probabilities:
            start_ms = self.position_ms
            self.position_ms += self.window_ms
            if not self.in_speech:
                if p >= self.threshold:
                    self.in_speech = True
                    self._silence_ms = 0
                    events.append(VadEvent("speech_started", max(0, start_ms - self.prefix_padding_ms)))
                continue
            # Hysteresis as Silero recommends: speech ends only below threshold - 0.15.
            if p < self.threshold - 0.15:
                self._silence_ms += self.window_ms
                if self._silence_ms >= self.silence_duration_ms:
                    self.in_speech = False
                    events.append(VadEvent("speech_stopped", self.position_ms - self._silence_ms))
            else:
                self._silence_ms = 0
        return events

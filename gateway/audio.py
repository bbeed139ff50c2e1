"""Audio on the wire (base64 raw float32 PCM) and from files (any rate, resampled)."""

from __future__ import annotations

import binascii
from pathlib import Path

import numpy as np
import pybase64  # SIMD base64: the stdlib's took 0.35 ms of each 1 s append's path

from minicpmo_triton.media.pcm import pcm_problem

INPUT_RATE = 16_000
OUTPUT_RATE = 24_000


class AudioDecodeError(ValueError):
    pass


def _samples(data: str, dtype: str, what: str, max_samples: int) -> np.ndarray:
    """Strict: valid base64, a whole number of samples, bounded length."""
    try:
        raw = pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioDecodeError(f"audio is not valid base64: {exc}") from exc
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise AudioDecodeError(f"audio is {len(raw)} bytes: not a whole number of {what} samples")
    if len(raw) // size > max_samples:
        raise AudioDecodeError(f"audio has {len(raw) // size} samples; at most {max_samples} per message")
    return np.frombuffer(raw, dtype=dtype)


def decode_f32_base64(data: str, max_samples: int) -> np.ndarray:
    """Strict: valid base64, a whole number of float32 samples, finite values within +-MAX_SAMPLE_ABS,
    bounded length."""
    audio = _samples(data, "<f4", "float32", max_samples)
    if problem := pcm_problem(audio):
        raise AudioDecodeError(problem)
    return audio.astype(np.float32)


def encode_f32_base64(audio: np.ndarray) -> str:
    return pybase64.b64encode_as_string(np.ascontiguousarray(audio, dtype="<f4").tobytes())


def resample(audio: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    if rate_in == rate_out:
        return audio.astype(np.float32)
    import soxr

    return soxr.resample(audio, rate_in, rate_out).astype(np.float32)


def read_wav(path: Path, rate: int = INPUT_RATE) -> np.ndarray:
    """Mono float32 at `rate`, whatever the file's rate and channels."""
    import soundfile as sf

    audio, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    return resample(audio.mean(axis=1), file_rate, rate)


def write_wav(path: Path, audio: np.ndarray, rate: int = OUTPUT_RATE) -> None:
    import soundfile as sf

    sf.write(str(path), np.asarray(audio, np.float32), rate, subtype="FLOAT")


def decode_pcm16_base64(data: str, max_samples: int) -> np.ndarray:
    """Strict 16-bit little-endian PCM (OpenAI's `audio/pcm`) to float32 in [-1, 1]."""
    return _samples(data, "<i2", "16-bit", max_samples).astype(np.float32) / 32768.0


def encode_pcm16_base64(audio: np.ndarray) -> str:
    pcm = np.clip(np.round(np.asarray(audio, np.float32) * 32768.0), -32768, 32767).astype("<i2")
    return pybase64.b64encode_as_string(pcm.tobytes())


class StreamResampler:
    """One stream's resampler, chunk after chunk with no seams between them (soxr keeps its filter state)."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        self.rate_in, self.rate_out = rate_in, rate_out
        self._stream = None
        if rate_in != rate_out:
            import soxr

            self._stream = soxr.ResampleStream(rate_in, rate_out, 1, dtype="float32")

    def __call__(self, audio: np.ndarray) -> np.ndarray:
        audio = np.asarray(audio, np.float32)
        return audio if self._stream is None else self._stream.resample_chunk(audio)

"""WAV files with the standard library (16-bit, 8-bit or 32-bit integer PCM, any rate and channels) and a
small linear resampler: enough for a client, with no audio packages to install."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

_DTYPES = {1: ("u1", 128.0, 128.0), 2: ("<i2", 0.0, 32768.0), 4: ("<i4", 0.0, 2147483648.0)}


def resample(audio: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Linear interpolation: fine for speech going into a 16 kHz model, not for hi-fi."""
    if rate_in == rate_out or not len(audio):
        return np.asarray(audio, np.float32)
    n = int(round(len(audio) * rate_out / rate_in))
    return np.interp(np.arange(n) * (rate_in / rate_out), np.arange(len(audio)), audio).astype(np.float32)


def read_wav(path: Path | str, rate: int) -> np.ndarray:
    """Mono float32 at `rate`."""
    with wave.open(str(path), "rb") as f:
        width, channels, file_rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
        if width not in _DTYPES:
            raise ValueError(f"{path}: {8 * width}-bit WAV is not supported (use 8, 16 or 32-bit PCM)")
        raw = f.readframes(f.getnframes())
    dtype, offset, scale = _DTYPES[width]
    audio = (np.frombuffer(raw, dtype).astype(np.float32) - offset) / scale
    return resample(audio.reshape(-1, channels).mean(axis=1), file_rate, rate)


def write_wav(path: Path | str, audio: np.ndarray, rate: int) -> None:
    """16-bit PCM mono."""
    pcm = np.clip(np.round(np.asarray(audio, np.float32) * 32768.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())

"""Microphone and speaker through `sounddevice` (optional: `pip install sounddevice`, which needs PortAudio).
Where it or a sound device is missing, `DeviceUnavailable` says what to do instead."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np


class DeviceUnavailable(RuntimeError):
    pass


def require(kind: str) -> Any:
    """The sounddevice module, once an `input` or `output` device is known to exist."""
    try:
        import sounddevice
    except (ImportError, OSError) as exc:  # OSError: the package is there but PortAudio is not
        raise DeviceUnavailable(f"no {kind}: the `sounddevice` package (and PortAudio) is needed "
                                f"({exc}); install it with `pip install sounddevice`") from exc
    try:
        sounddevice.query_devices(kind=kind)
    except Exception as exc:  # PortAudio reports a missing device in several ways
        raise DeviceUnavailable(f"no {kind} device on this machine ({exc})") from exc
    return sounddevice


async def microphone(rate: int, chunk_ms: int = 100) -> AsyncIterator[np.ndarray]:
    """The default microphone, float32 mono at `rate`, `chunk_ms` at a time, as it is captured."""
    sd = require("input")
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[np.ndarray] = asyncio.Queue()

    def captured(data: np.ndarray, frames: int, time: Any, status: Any) -> None:
        loop.call_soon_threadsafe(chunks.put_nowait, data[:, 0].copy())

    with sd.InputStream(samplerate=rate, channels=1, dtype="float32", blocksize=rate * chunk_ms // 1000,
                        callback=captured):
        while True:
            yield await chunks.get()


class Speaker:
    """The default output device, fed reply audio as it comes; `flush()` silences it at once (a barge-in)."""

    def __init__(self, rate: int) -> None:
        sd = require("output")
        self._lock = threading.Lock()
        self._pending: list[np.ndarray] = []
        self._stream = sd.OutputStream(samplerate=rate, channels=1, dtype="float32", callback=self._play)
        self._stream.start()

    def _play(self, out: np.ndarray, frames: int, time: Any, status: Any) -> None:
        filled = 0
        with self._lock:
            while self._pending and filled < frames:
                head = self._pending[0]
                n = min(len(head), frames - filled)
                out[filled:filled + n, 0] = head[:n]
                filled += n
                if n == len(head):
                    self._pending.pop(0)
                else:
                    self._pending[0] = head[n:]
        out[filled:, 0] = 0.0

    def play(self, pcm: np.ndarray) -> None:
        with self._lock:
            self._pending.append(pcm)

    def flush(self) -> None:
        with self._lock:
            self._pending.clear()

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()

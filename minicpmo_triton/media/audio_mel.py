"""Whisper's log-mel in numpy, and the duplex stream's mel as MiniCPM-o 4.5's reference cuts it per chunk.

The reference (OpenBMB/MiniCPM-o-Demo MiniCPMO45/processing_minicpmo.py `StreamingMelProcessorExact`, driven by
modeling_minicpmo_unified.py `DuplexCapability.streaming_prefill` with chunk 1000 ms, first chunk 1035 ms,
CNN redundancy 20 ms, sliding window 30 s / 10 s) keeps the session's audio (at most ~30 s), recomputes its
mel on every chunk and emits the chunk's frames plus 2 frames of context on each side. Below 5 s of audio
the log-mel is not clamped (its -10 floor is the log10 clamp's own); from 5 s on it is Whisper's max - 8
over the kept audio. `MelStream` does the same arithmetic for chunks of any whole number of LLM tokens, but
computes each frame once: it keeps the per-frame maxima of the frames that no longer change, for the floor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model_config import SAMPLE_RATE_IN

N_FFT = 400
HOP = 160
CONTEXT_FRAMES = 2  # mel frames of context on each side of a chunk (the reference's 20 ms CNN redundancy)
LEAD_SAMPLES = 560  # the first chunk is 1035 ms: 35 ms of zeros ahead of the first second
FIXED_FLOOR_SAMPLES = 5 * SAMPLE_RATE_IN  # below this much kept audio, no dynamic clamp
DYNAMIC_RANGE = 8.0  # log10 units below the peak (Whisper's clamp)
LOG_FLOOR = -10.0
SLIDE_TRIGGER = 30 * SAMPLE_RATE_IN  # kept audio that triggers dropping SLIDE_STRIDE from the left
SLIDE_STRIDE = 10 * SAMPLE_RATE_IN
SLIDE_KEEP = 1 * SAMPLE_RATE_IN


def mel_filterbank(n_mels: int, n_fft: int = N_FFT, sr: int = SAMPLE_RATE_IN) -> np.ndarray:
    """Slaney-style triangular filters, as Whisper's feature extractor uses: [n_mels, n_fft/2 + 1]."""

    def hz_to_mel(f: np.ndarray | float) -> np.ndarray:
        f = np.asarray(f, dtype=np.float64)
        lin = f / (200.0 / 3)
        log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
        return np.where(f >= 1000.0, log, lin)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        lin = m * (200.0 / 3)
        log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
        return np.where(m >= 15.0, log, lin)

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mels = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2))
    lower = (freqs[None, :] - mels[:-2, None]) / (mels[1:-1, None] - mels[:-2, None])
    upper = (mels[2:, None] - freqs[None, :]) / (mels[2:, None] - mels[1:-1, None])
    fb = np.maximum(0.0, np.minimum(lower, upper))
    fb *= (2.0 / (mels[2:] - mels[:-2]))[:, None]
    return fb.astype(np.float32)


def log_mel(audio: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """log10 power mel of 16 kHz audio, not yet clamped or scaled: [n_mels, len(audio) // 160].

    Whisper's framing: centred frames (reflect padding), periodic Hann window, the last frame dropped."""
    return log_mel_frames(audio, filters, 0, len(audio) // HOP)


def frame_samples(audio: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The samples the windows of frames lo..hi-1 cover (float64), reflected at the audio's own edges as Whisper's
    centred framing does: (hi - lo - 1) * HOP + N_FFT of them."""
    n, half = len(audio), N_FFT // 2
    first, last = lo * HOP - half, (hi - 1) * HOP + half
    x = np.asarray(audio[max(0, first): min(n, last)], np.float64)
    return np.pad(x, (max(0, -first), max(0, last - n)), mode="reflect")  # only at the audio's own edges


def log_mel_frames(audio: np.ndarray, filters: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Frames lo..hi-1 of `log_mel(audio)`, computing only those: [n_mels, hi - lo]."""
    x = frame_samples(audio, lo, hi)
    frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)
    power = np.abs(np.fft.rfft(frames * window, axis=1)) ** 2  # [hi - lo, n_fft/2 + 1]
    return np.log10(np.maximum(filters.astype(np.float64) @ power.T, 1e-10))


def scale(log_spec: np.ndarray, floor: float) -> np.ndarray:
    return ((np.maximum(log_spec, floor) + 4.0) / 4.0).astype(np.float32)


@dataclass
class MelChunk:
    mel: Any  # [n_mels, CONTEXT_FRAMES? + core + CONTEXT_FRAMES]: np.ndarray (or a device tensor: engine/mel.py)
    first: bool  # the stream's first chunk has no left context


@dataclass(frozen=True)
class MelPlan:
    """What a chunk's mel is made of, once the stream's audio is moved on (`MelStream.advance`): kept's frames
    lo..total-1 to compute; the new stable ones (stable_from..stable) join the maxima; the chunk is start..end."""

    lo: int
    total: int
    stable_from: int
    stable: int
    start: int
    end: int
    dropped: int  # frames a slide dropped: kept's first two frames' maxima are computed again (their reflection)
    fixed_floor: bool  # under 5 s kept: the floor is LOG_FLOOR
    first: bool


@dataclass
class MelStream:
    """One session's audio for the streaming mel: `pending` is what arrived but is not yet cut into a chunk
    (the reference's DuplexCapability.audio_buffer), `kept` what the mel is computed over."""

    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    kept: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    base_frame: int = 0  # global index of kept's first frame
    emitted: int = 0  # global index of the next core frame
    chunks: int = 0
    # log-mel maximum of each of kept's frames whose window lies inside the kept audio (frames 0 and 1 reflect
    # its left edge: recomputed when the window slides); the last frames, not final yet, are recomputed per chunk
    maxima: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def nbytes(self) -> int:
        return int(self.pending.nbytes + self.kept.nbytes + self.maxima.nbytes)

    def push(self, audio: np.ndarray, filters: np.ndarray) -> MelChunk:
        """The mel of the next chunk: len(audio) // 160 core frames (a multiple of 10) and their context."""
        plan = self.advance(audio)
        if plan.dropped:
            # a new array, never a write into the old one: a stage's undo keeps the old arrays (stages/base.py)
            edge = log_mel_frames(self.kept, filters, 0, 2).max(axis=0)
            self.maxima = np.concatenate([edge, self.maxima[plan.dropped + 2:]])
        spec = log_mel_frames(self.kept, filters, plan.lo, plan.total)  # kept's frames lo.. (the whole mel's)
        self.maxima = np.concatenate([self.maxima, spec[:, plan.stable_from - plan.lo: plan.stable - plan.lo]
                                      .max(axis=0)])
        if plan.fixed_floor:
            floor = LOG_FLOOR
        else:
            floor = max(float(self.maxima.max()),
                        float(spec[:, plan.stable - plan.lo:].max(initial=-np.inf))) - DYNAMIC_RANGE
        return MelChunk(scale(spec[:, plan.start - plan.lo: plan.end - plan.lo], floor), plan.first)

    def advance(self, audio: np.ndarray) -> MelPlan:
        """The stream's audio moved on by a chunk of len(audio) // 160 core frames: what its mel needs (the
        maxima are the caller's to update, with the frames it computes)."""
        core = len(audio) // HOP
        self.pending = np.concatenate([self.pending, np.asarray(audio, np.float32)])
        first = self.chunks == 0
        if first:  # 1035 ms for a 1 s chunk, zero-padded at the front; the hop-aligned 1030 ms is consumed
            self.pending = np.concatenate([np.zeros(LEAD_SAMPLES, np.float32), self.pending])
        take = core * HOP + (LEAD_SAMPLES // HOP * HOP if first else 0)
        self.kept = np.concatenate([self.kept, self.pending[:take]])
        self.pending = self.pending[take:]
        dropped = self._slide()
        total = len(self.kept) // HOP
        stable = min(total, (len(self.kept) - N_FFT // 2) // HOP + 1)  # frames with their whole window
        start = max(0, self.emitted - CONTEXT_FRAMES) - self.base_frame
        end = self.emitted + core + CONTEXT_FRAMES - self.base_frame
        assert end <= stable, "a chunk's mel needs its right context"
        known = len(self.maxima) - dropped if dropped else len(self.maxima)  # after the slide's shift
        lo = min(known, start)
        self.emitted += core
        self.chunks += 1
        return MelPlan(lo, total, known, stable, start, end, dropped, len(self.kept) < FIXED_FLOOR_SAMPLES, first)

    def _slide(self) -> int:
        """Past 30 s, drop 10 s from the left (keeping at least 1 s), hop-aligned, as the reference does.
        Returns the frames dropped."""
        n = len(self.kept)
        if n < SLIDE_TRIGGER:
            return 0
        drop = min(SLIDE_STRIDE, n - min(SLIDE_KEEP, n - SLIDE_STRIDE)) // HOP * HOP
        self.kept = self.kept[drop:]
        self.base_frame += drop // HOP
        return drop // HOP

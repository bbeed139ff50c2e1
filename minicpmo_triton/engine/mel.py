"""The duplex stream's log-mel on the device, batched across the rows admitted together: `audio_mel.MelStream`'s
arithmetic (Whisper's centred frames, periodic Hann window, power spectrum, Slaney filterbank, log10, the floor from
the kept audio's per-frame maxima), in float64 as the host's, with `torch.fft.rfft` over the frames of every row at
once. The stream's bookkeeping of its audio stays on the host (`MelStream.advance`: slices and concatenations);
each row's samples go up in the pool's one staging copy; its per-frame maxima live on the device (a new tensor each
chunk, never written in place: a stage's undo keeps the old one); the chunk's mel never comes down: the streaming
Whisper reads it where it is. tests/test_engine_whisper.py holds it to `MelStream.push` over a stream's slides.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from ..media.audio_mel import DYNAMIC_RANGE, HOP, LOG_FLOOR, N_FFT, MelChunk, MelPlan, MelStream, frame_samples
from .staging import DeviceWrites


class DeviceMel:
    def __init__(self, filters: np.ndarray, writes: DeviceWrites, lock: Any = None) -> None:
        """`lock`: the pool's bookkeeping lock, held while the samples are staged and copied (others queue writes
        into the same staging)."""
        self.writes, self.staging = writes, writes.staging
        self.lock = lock if lock is not None else threading.RLock()
        self.device = self.staging.device
        self.filters = torch.as_tensor(np.asarray(filters, np.float64), device=self.device)  # [n_mels, N_FFT/2 + 1]
        n = torch.arange(N_FFT, dtype=torch.float64, device=self.device)
        self.window = 0.5 - 0.5 * torch.cos(2 * math.pi * n / N_FFT)

    def spectra(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of samples [B, (F - 1) * HOP + N_FFT] -> their frames' log10 mel [B, n_mels, F] (`log_mel_frames`)."""
        frames = x.unfold(1, N_FFT, HOP) * self.window  # [B, F, N_FFT]
        power = torch.fft.rfft(frames, dim=-1).abs() ** 2  # [B, F, N_FFT/2 + 1]
        return torch.log10(torch.clamp(self.filters @ power.transpose(1, 2), min=1e-10))

    def push(self, items: list[tuple[MelStream, np.ndarray]]) -> list[MelChunk]:
        """Each stream's next chunk (`MelStream.push`, its mel on the device)."""
        plans = [stream.advance(audio) for stream, audio in items]
        wanted: list[tuple[int, str, np.ndarray]] = []  # (row, what, samples)
        for r, ((stream, _), plan) in enumerate(zip(items, plans, strict=True)):
            if plan.dropped:
                wanted.append((r, "edge", frame_samples(stream.kept, 0, 2)))
            wanted.append((r, "spec", frame_samples(stream.kept, plan.lo, plan.total)))
        groups: dict[int, list[int]] = defaultdict(list)  # samples -> positions in `wanted`
        for i, (_, _, x) in enumerate(wanted):
            groups[len(x)].append(i)
        # the samples are the stream's float32 audio (padding reflects it): float32 up, float64 on the device, exact
        with self.lock:
            staged = {n: self.staging.put(np.stack([wanted[i][2] for i in idx]).astype(np.float32))
                      for n, idx in groups.items()}
            self.writes.flush()  # with whatever else the pool queued: one copy
        out: dict[tuple[int, str], torch.Tensor] = {}
        for n, idx in groups.items():
            spec = self.spectra(self.staging.view(staged[n]).to(torch.float64))
            for j, i in enumerate(idx):
                out[(wanted[i][0], wanted[i][1])] = spec[j]
        return [self._settle(stream, plan, out[(r, "spec")], out.get((r, "edge")))
                for r, ((stream, _), plan) in enumerate(zip(items, plans, strict=True))]

    def _settle(self, stream: MelStream, plan: MelPlan, spec: torch.Tensor, edge: torch.Tensor | None) -> MelChunk:
        """`MelStream.push`'s maxima, floor and scale, on the device."""
        maxima: Any = stream.maxima
        if not isinstance(maxima, torch.Tensor):
            maxima = torch.as_tensor(np.asarray(maxima, np.float64), device=self.device)
        if edge is not None:
            maxima = torch.cat([edge.amax(0), maxima[plan.dropped + 2:]])
        new = spec[:, plan.stable_from - plan.lo: plan.stable - plan.lo]
        if new.shape[1]:
            maxima = torch.cat([maxima, new.amax(0)])
        stream.maxima = maxima
        if plan.fixed_floor:
            floor = spec.new_full((), LOG_FLOOR)
        else:
            tail = spec[:, plan.stable - plan.lo:]
            top = maxima.max() if not tail.shape[1] else torch.maximum(maxima.max(), tail.max())
            floor = top - DYNAMIC_RANGE
        mel = spec[:, plan.start - plan.lo: plan.end - plan.lo]
        return MelChunk(((torch.maximum(mel, floor) + 4.0) / 4.0).to(torch.float32), plan.first)

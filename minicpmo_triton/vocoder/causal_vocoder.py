"""minicpmo-utils 1.0.7's streaming vocoder: its causal HiFT (CosyVoice3's CausalHiFTGenerator) driven by its
`BoundedVocoder`, run in torch inside the token2wav stage, one state per session.

Its stream is data-dependent (mel fed in 16-frame blocks, a float64 F0 predictor and a float64 harmonic phase
carried across calls, bounded mel / source histories, an 8-frame delay flushed at the turn's end): no ONNX graph
is exported for it; the official classes run as they are (stepaudio2/causal_vocoder/bounded_vocoder.py). One
`BoundedVocoder` (the model and its sine table) serves every session: a session's state is its own cache dict,
swapped in for its call as the package's `Token2wav._stream_vocode` does (stepaudio2/token2wav.py:206-218).
The export copies the checkpoint's config.yaml and hift.pt into `FOLDER` beside the token2wav graphs.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import Code, StepError
from .official_stepaudio2 import load_tagged_yaml, stepaudio2_module

if TYPE_CHECKING:
    import torch

FOLDER = "causal_vocoder"  # in model_repository/token2wav/1: the checkpoint's config.yaml and hift.pt
FILES = ("config.yaml", "hift.pt")
# config.yaml's class tags (CosyVoice3's) -> minicpmo-utils' modules (its token2wav.py:31-39)
TAGS = {
    "cosyvoice.hifigan.generator.CausalHiFTGenerator": "stepaudio2.causal_vocoder.generator:CausalHiFTGenerator",
    "cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor":
        "stepaudio2.causal_vocoder.f0_predictor:CausalConvRNNF0Predictor",
    # only its settings are read (checked below); the package's own function needs librosa, absent here
    "matcha.utils.audio.mel_spectrogram": "minicpmo_triton.vocoder.causal_vocoder:mel_spectrogram_settings",
}
# the mel the flow produces, which the vocoder must have been trained on (token2wav.py:66-70)
MEL_SETTINGS = {"n_fft": 1920, "num_mels": 80, "sampling_rate": 24000, "hop_size": 480, "win_size": 1920,
                "fmin": 0, "fmax": 8000, "center": False}
DELAY_FRAMES = 8  # F0 right context + conv_pre right context + the ISTFT's trim frame (token2wav.py:122-126)
LEAD_SAMPLES = 3840  # a turn's first audio is led by this much silence (token2wav.py:213-217)


def mel_spectrogram_settings(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("config.yaml's feat_extractor is read for its settings only")


def load_causal_hift(folder: Path) -> torch.nn.Module:
    """config.yaml's `hift` (CausalHiFTGenerator) with hift.pt's weights, checked as the package's
    `load_causal_vocoder` checks them (token2wav.py:62-79)."""
    import torch

    generator = stepaudio2_module("causal_vocoder.generator")
    config = load_tagged_yaml((folder / FILES[0]).read_text(encoding="utf-8"), TAGS, {"hifigan": None})
    feat = config.get("feat_extractor")
    if feat is None or any(feat.keywords.get(k) != v for k, v in MEL_SETTINGS.items()):
        raise ValueError(f"{folder / FILES[0]}: the vocoder's mel settings must be Step-Audio2's {MEL_SETTINGS}")
    model = config["hift"]
    if not isinstance(model, generator.CausalHiFTGenerator):
        raise TypeError(f"{folder / FILES[0]}: `hift` is not CosyVoice3's CausalHiFTGenerator")
    hop = int(np.prod(model.upsample_rates) * model.istft_params["hop_len"])
    if model.sampling_rate != 24000 or hop != 480:
        raise ValueError(f"{folder / FILES[0]}: the vocoder must give 24 kHz audio, 480 samples per mel frame")
    model.load_state_dict(torch.load(folder / FILES[1], map_location="cpu", weights_only=True), strict=True)
    return model.float().eval()


@dataclass(eq=False)
class VocoderState:
    """One session's turn through the vocoder: BoundedVocoder's cache (mel / source histories, float64 phase,
    offsets) and whether its first audio is still to come."""

    cache: dict[str, torch.Tensor]
    first_chunk: bool = True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.cache.values())


class CausalVocoder:
    def __init__(self, model: torch.nn.Module) -> None:
        bounded = stepaudio2_module("causal_vocoder.bounded_vocoder")
        self.bounded = bounded.BoundedVocoder(model)
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()  # one session's cache in the shared BoundedVocoder at a time
        if self.bounded.delay != DELAY_FRAMES:
            raise ValueError(f"the causal vocoder's delay is {self.bounded.delay} frames; 1.0.7 streams with "
                             f"{DELAY_FRAMES}")

    @classmethod
    def load(cls, folder: Path, device: str | None = None) -> CausalVocoder:
        """On `device`; by default on CUDA where torch sees one, as the package runs it (its sine table stays on the
        CPU there too)."""
        import torch

        from .hift import fold_weight_norm

        model = fold_weight_norm(load_causal_hift(folder))  # its weight-normed convs' weights, computed once
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(model.to(device))

    @property
    def model(self) -> torch.nn.Module:
        return self.bounded.model

    def new_state(self) -> VocoderState:
        with self._lock:
            self.bounded.reset()  # a fresh cache dict, now the session's
            return VocoderState(self.bounded.cache)

    def stream(self, state: VocoderState, mel: np.ndarray | torch.Tensor, last: bool) -> np.ndarray:
        """A chunk's fresh mel [80, T] (T may be 0 on the turn's end; host or device) -> its audio; `last` flushes
        the delay."""
        import torch

        with self._lock, torch.inference_mode():
            self.bounded.cache = state.cache
            fresh = mel if isinstance(mel, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(mel, np.float32))
            speech = self.bounded.stream(fresh[None].to(self.device, torch.float32), finalize=last)
        wav, state.first_chunk = turn_audio(speech[0].cpu().numpy().astype(np.float32), state.first_chunk, last)
        return wav


def turn_audio(wav: np.ndarray, first: bool, last: bool) -> tuple[np.ndarray, bool]:
    """A chunk's audio as the package gives it to a turn: non-finite refused, the turn's first led by 3840
    samples of silence (token2wav.py:213-217); and whether the turn's first audio is still to come."""
    if not np.isfinite(wav).all():
        raise StepError(Code.INTERNAL_ERROR, "token2wav: the causal vocoder returned non-finite audio")
    if len(wav) and first:
        return (wav if last else np.concatenate([np.zeros(LEAD_SAMPLES, np.float32), wav])), False
    return wav, first


# BoundedVocoder's cache entries holding where a stream is (mel_offset, source_offset, source_end in frames;
# speech_offset in samples)
OFFSETS = ("mel_offset", "source_offset", "source_end", "speech_offset")


@dataclass(eq=False)
class CausalTurn:
    """One turn's place in the causal vocoder's stream on the device path; its histories are in its slot."""

    mel: int = 0  # mel frames of history held
    source: int = 0  # source samples of history held
    offsets: tuple[int, ...] = (0, 0, 0, 0)  # OFFSETS
    finalized: bool = False
    first_chunk: bool = True

    def shape(self, hop: int) -> tuple[object, ...]:
        """What makes every slice of BoundedVocoder._process the same for two turns: their histories' lengths and
        their offsets relative to each one's own mel offset. Once a turn's mel offset is past 0, none of the
        `max(0, ...)` there clamps (the offsets only grow); at 0 they might, so the offsets themselves must agree."""
        mel_offset = self.offsets[0]
        relative = (self.offsets[1] - mel_offset, self.offsets[2] - mel_offset, self.offsets[3] - mel_offset * hop)
        return self.mel, self.source, self.finalized, relative if mel_offset else self.offsets


def _shifted_vocoder(model: torch.nn.Module) -> Any:
    """The package's BoundedVocoder over a batch of turns whose streams have one shape (`CausalTurn.shape`): the
    cache's offsets are the first turn's, and turn r is that stream shifted by `shifts[r]` frames, which only the
    excitation's noise (read from the sine table at the stream's position) sees: `_source` below is the package's
    (bounded_vocoder.py:92-111) with that one read per turn."""
    import torch

    bounded = stepaudio2_module("causal_vocoder.bounded_vocoder")

    class Shifted(bounded.BoundedVocoder):  # type: ignore[name-defined]
        shifts: torch.Tensor  # [B] frames

        def _source(self, f0: torch.Tensor, frame_offset: int) -> torch.Tensor:
            oscillator = self.model.m_source.l_sin_gen
            self._observe(cumsum_frames=f0.shape[-1])
            harmonics = torch.arange(1, self.model.nb_harmonics + 2, device=f0.device, dtype=f0.dtype)
            increments = (f0[:, :, None] * harmonics / self.model.sampling_rate).remainder(1)
            cycles = increments.double().cumsum(dim=1) * self.hop + self.cache["phase"]
            self.cache["phase"] = cycles[:, -1:].remainder(1).clone()
            sine = (cycles.remainder(1) * (2 * math.pi)).sin().to(f0).repeat_interleave(self.hop, dim=1)
            voiced = (f0[:, :, None] > oscillator.voiced_threshold).to(f0).repeat_interleave(self.hop, dim=1)
            noise_amplitude = voiced * oscillator.noise_std + (1 - voiced) * oscillator.sine_amp / 3
            table = oscillator.sine_waves
            starts = (frame_offset + self.shifts.to(table.device)) * self.hop  # each turn's own position
            positions = (starts[:, None] + torch.arange(sine.shape[1], device=table.device)).remainder(table.shape[1])
            noise = table[0][positions].to(f0)  # [B, samples, harmonics + 1]
            excitation = sine * oscillator.sine_amp * voiced + noise_amplitude * noise
            return self.model.m_source.l_tanh(self.model.m_source.l_linear(excitation)).transpose(1, 2)

    return Shifted(model)


class CausalSlots:
    """1.0.7's causal vocoder for many turns at once (the device path): each turn's histories (mel, source, the
    float64 phase) in its slot, and the package's BoundedVocoder run once per group of turns whose streams have
    the same shape, on their chunks' mel together."""

    def __init__(self, vocoder: CausalVocoder, slots: int) -> None:
        import torch

        self.vocoder = vocoder
        self.bounded = _shifted_vocoder(vocoder.model)
        self.hop = self.bounded.hop
        self.device = vocoder.device
        limits = self.bounded.limits
        model: Any = vocoder.model
        self.mel = torch.zeros(0, model.conv_pre.in_channels, limits["mel_buffer_frames"], device=self.device)
        self.source = torch.zeros(0, 1, limits["source_buffer_frames"] * self.hop, device=self.device)
        self.phase = torch.zeros(0, 1, model.nb_harmonics + 1, dtype=torch.float64, device=self.device)
        self.grow(slots)

    def grow(self, slots: int) -> None:
        import torch

        for name in ("mel", "source", "phase"):
            old = getattr(self, name)
            new = torch.zeros((slots, *old.shape[1:]), dtype=old.dtype, device=self.device)
            new[:old.shape[0]] = old
            setattr(self, name, new)

    @property
    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.mel, self.source, self.phase))

    def stream(self, rows: list[tuple[int, CausalTurn, torch.Tensor, bool]]) -> list[np.ndarray]:
        """Rows of (slot, its turn, the chunk's fresh mel [80, T] (T may be 0 at the turn's end), last) -> each
        one's audio, as `CausalVocoder.stream` gives it to one turn at a time."""
        import torch

        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(rows)
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (_, turn, mel, last) in enumerate(rows):
            groups.setdefault((turn.shape(self.hop), mel.shape[1], last), []).append(i)
        with torch.inference_mode():
            for key, idx in groups.items():
                last = bool(key[2])
                speech = self._group([rows[i][0] for i in idx], [rows[i][1] for i in idx],
                                     torch.stack([rows[i][2] for i in idx]).float(), last)
                wavs = speech.cpu().numpy().astype(np.float32)
                for row, i in enumerate(idx):
                    turn = rows[i][1]
                    out[i], turn.first_chunk = turn_audio(wavs[row], turn.first_chunk, last)
        return out

    def reset(self, slot: int) -> None:
        """A turn starts in `slot`: its phase from 0 (its histories' lengths are its `CausalTurn`'s, 0)."""
        self.phase[slot] = 0

    def _group(self, slots: list[int], turns: list[CausalTurn], mel: torch.Tensor, last: bool) -> torch.Tensor:
        import torch

        base = turns[0]
        index = torch.as_tensor(slots, device=self.device)
        b = self.bounded
        b.shifts = torch.as_tensor([t.offsets[0] - base.offsets[0] for t in turns])
        b.cache = {"mel": self.mel[index][:, :, :base.mel], "source": self.source[index][:, :, :base.source],
                   "phase": self.phase[index], "finalized": torch.tensor([int(base.finalized)]),
                   **{k: torch.tensor([v]) for k, v in zip(OFFSETS, base.offsets, strict=True)}}
        speech = b.stream(mel.to(self.device), finalize=last)
        cache = b.cache
        mel_len, source_len = cache["mel"].shape[-1], cache["source"].shape[-1]
        self.mel[index, :, :mel_len] = cache["mel"]
        self.source[index, :, :source_len] = cache["source"]
        self.phase[index] = cache["phase"]
        offsets = [int(cache[k].item()) for k in OFFSETS]
        for turn, shift in zip(turns, b.shifts.tolist(), strict=True):
            turn.mel, turn.source, turn.finalized = mel_len, source_len, bool(cache["finalized"].item())
            turn.offsets = (offsets[0] + shift, offsets[1] + shift, offsets[2] + shift, offsets[3] + shift * self.hop)
        return speech

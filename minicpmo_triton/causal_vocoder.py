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

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import Code, StepError
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
    "matcha.utils.audio.mel_spectrogram": "minicpmo_triton.causal_vocoder:mel_spectrogram_settings",
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
    config = load_tagged_yaml((folder / FILES[0]).read_text(), TAGS, {"hifigan": None})
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

        model = load_causal_hift(folder)
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
        wav = speech[0].cpu().numpy().astype(np.float32)
        if not np.isfinite(wav).all():
            raise StepError(Code.INTERNAL_ERROR, "token2wav: the causal vocoder returned non-finite audio")
        if len(wav) and state.first_chunk:
            state.first_chunk = False
            if not last:
                wav = np.concatenate([np.zeros(LEAD_SAMPLES, np.float32), wav])
        return wav

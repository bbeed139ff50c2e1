"""The voice prompt's features in numpy against independent references.

- Kaldi fbank vs kaldi-native-fbank (k2-fsa's C++ port of Kaldi's compute-fbank-feats);
- the Slaney mel filterbank vs the librosa filterbanks s3tokenizer ships (`assets/mel_filters.npz`,
  written by `librosa.filters.mel`);
- the S3 tokenizer's log-mel and the 24 kHz prompt mel vs the official torch functions of minicpmo-utils
  (s3tokenizer `log_mel_spectrogram`, flashcosyvoice `mel_spectrogram`), run with torchaudio / librosa stubbed
  out of their imports (neither function calls them; librosa's filterbank is the one checked above).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from minicpmo_triton.stages import voice_prompt as vp


def _speech_like(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / rate) / k for k in range(1, 12))
    return (0.3 * voiced * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(len(t))).astype(
        np.float32)


def test_kaldi_fbank_matches_kaldi_native_fbank() -> None:
    import kaldi_native_fbank as knf  # pyproject's dev extra: installed wherever the suite runs
    audio = _speech_like(1.37)
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0
    opts.frame_opts.samp_freq = 16000
    opts.frame_opts.snip_edges = True
    opts.frame_opts.window_type = "povey"
    opts.mel_opts.num_bins = 80
    opts.mel_opts.low_freq = 20
    opts.mel_opts.high_freq = 0  # torchaudio's default: the Nyquist frequency
    opts.use_energy = False
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16000, audio.tolist())
    fbank.input_finished()
    ref = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])
    ours = vp.kaldi_fbank(audio)
    assert ours.shape == ref.shape == (1 + (len(audio) - 400) // 160, 80)
    diff = float(np.abs(ours - ref).max())
    print(f"kaldi fbank vs kaldi-native-fbank: max abs diff {diff:.3g}")
    assert diff < 1e-3


def _s3tokenizer_folder() -> Path:
    """s3tokenizer's package folder (minicpmo-utils, which scripts/setup.sh installs), found without importing it:
    its __init__ imports torchaudio, which no build for this torch provides."""
    spec = importlib.util.find_spec("s3tokenizer")
    assert spec is not None and spec.submodule_search_locations, "minicpmo-utils (s3tokenizer) is not installed"
    return Path(list(spec.submodule_search_locations)[0])


@pytest.mark.parametrize("n_mels", [80, 128])
def test_slaney_filters_match_librosa(n_mels: int) -> None:
    with np.load(_s3tokenizer_folder() / "assets" / "mel_filters.npz") as f:
        ref = f[f"mel_{n_mels}"]
    ours = vp.slaney_mel_filters(16000, 400, n_mels)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-7)


@pytest.fixture
def no_torchaudio(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stubs for the imports the official feature functions do not use; librosa's mel is ours (checked above)."""
    librosa = types.ModuleType("librosa")
    filters = types.ModuleType("librosa.filters")
    filters.mel = lambda sr, n_fft, n_mels, fmin=0.0, fmax=None: vp.slaney_mel_filters(sr, n_fft, n_mels, fmin, fmax)
    librosa.filters = filters
    for name, module in {"torchaudio": types.ModuleType("torchaudio"), "librosa": librosa,
                         "librosa.filters": filters}.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_whisper_log_mel_matches_s3tokenizer(no_torchaudio: None) -> None:
    _s3tokenizer_folder()
    utils = importlib.import_module("s3tokenizer.utils")
    audio = _speech_like(2.03)
    ref = utils.log_mel_spectrogram(torch.from_numpy(audio)).numpy()
    ours = vp.whisper_log_mel(audio)
    assert ours.shape == ref.shape == (128, len(audio) // 160)
    diff = float(np.abs(ours - ref).max())
    print(f"s3 log-mel vs s3tokenizer: max abs diff {diff:.3g}")
    assert diff < 1e-4


def test_prompt_mel_matches_flashcosyvoice(no_torchaudio: None) -> None:
    from export.modules.stepaudio2 import stepaudio2_module

    sys.modules.pop("stepaudio2.flashcosyvoice.utils.audio", None)  # imported afresh against the stubs
    audio_mod = stepaudio2_module("flashcosyvoice.utils.audio")
    audio = vp.resample(_speech_like(1.5), 16000, 24000)
    ref = audio_mod.mel_spectrogram(torch.from_numpy(audio)[None]).transpose(1, 2)[0].numpy()
    ours = vp.prompt_mel(audio)
    assert ours.shape == ref.shape == (len(audio) // 480, 80)
    diff = float(np.abs(ours - ref).max())
    print(f"prompt mel vs flashcosyvoice: max abs diff {diff:.3g}")
    assert diff < 1e-3


def test_tiny_voice_graphs_have_the_real_signatures() -> None:
    """tiny's campplus.onnx / speech_tokenizer_v2_25hz.onnx: the real graphs' input and output names, dtypes, ranks."""
    import onnxruntime as ort

    from .conftest import MODEL_REPOSITORY, ensure_exported

    ensure_exported()
    folder = MODEL_REPOSITORY / "token2wav" / "1"

    def signature(name: str) -> tuple[list, list]:
        s = ort.InferenceSession(str(folder / name), providers=["CPUExecutionProvider"])
        io = lambda args: [(a.name, a.type, len(a.shape)) for a in args]  # noqa: E731 (a one-line helper)
        return io(s.get_inputs()), io(s.get_outputs())

    assert signature("campplus.onnx") == ([("input", "tensor(float)", 3)], [("output", "tensor(float)", 2)])
    assert signature("speech_tokenizer_v2_25hz.onnx") == (
        [("feats", "tensor(float)", 3), ("feats_length", "tensor(int32)", 1)], [("indices", "tensor(int64)", 2)])


def test_a_reference_becomes_tokens_a_mel_of_two_frames_each_and_a_campplus_vector() -> None:
    from .conftest import MODEL_REPOSITORY, ensure_exported

    ensure_exported()
    featurize = vp.VoiceFeaturizer.load(MODEL_REPOSITORY / "token2wav" / "1")
    audio = _speech_like(2.3)
    f = featurize(audio)
    assert len(f.tokens) == -(-(len(audio) // 160) // 4)  # 25 Hz: two stride-2 convolutions over 100 frames/s
    assert f.tokens.dtype == np.int64 and f.tokens.min() >= 0 and f.tokens.max() < 6561
    assert f.mel.shape == (2 * len(f.tokens), 80) and f.embedding.shape == (192,)
    again = featurize(audio.copy())
    np.testing.assert_array_equal(again.tokens, f.tokens)
    np.testing.assert_array_equal(again.embedding, f.embedding)

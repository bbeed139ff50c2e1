"""A voice reference (16 kHz float32 audio) -> token2wav's voice prompt, in numpy + ONNX Runtime.

As Step-Audio2's `Token2wav._prepare_prompt` does (minicpmo-utils `stepaudio2/token2wav.py`):
- S3 tokens: a Whisper-style 128-bin log-mel at 16 kHz (s3tokenizer `log_mel_spectrogram`) + its length through
  `speech_tokenizer_v2_25hz.onnx` -> 25 tokens/s;
- the prompt mel: the audio at 24 kHz -> an 80-bin log-mel (flashcosyvoice `mel_spectrogram`: n_fft 1920, hop 480,
  fmax 8000, reflect-padded, no centring) -> padded (edge frames repeated) or cut to 2 frames per token;
- the CAM++ vector: an 80-bin Kaldi fbank at 16 kHz (dither 0), mean-normalised over time, through
  `campplus.onnx` -> [192].
torchaudio and librosa are not needed: the Kaldi fbank and the Slaney mel filterbank are written out here.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine.exported import Engine, load_engine
from ..errors import Code, StepError
from ..media.pcm import pcm_problem

SAMPLE_RATE = 16000
PROMPT_RATE = 24000
CAMPPLUS = "campplus"  # campplus.onnx
S3_TOKENIZER = "speech_tokenizer_v2_25hz"  # speech_tokenizer_v2_25hz.onnx
UP_RATE = 2  # mel frames per S3 token
VOICES_DIR_ENV = "MINICPMO_VOICES_DIR"  # named voices: <folder>/<name>.wav
VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
MIN_VOICE_S = 0.5  # a reference shorter than this is refused (the gateway's bound too)
MAX_S3_FRAMES = 3000  # the tokenizer's window: 30 s of 10 ms frames (longer references are cut)


@dataclass(frozen=True, eq=False)
class VoiceFeatures:
    tokens: np.ndarray  # [T] int64: S3 tokens at 25 Hz
    mel: np.ndarray  # [2T, 80] float32: the 24 kHz log-mel, 50 frames/s
    embedding: np.ndarray  # [192] float32: CAM++


# ---- Kaldi fbank (torchaudio.compliance.kaldi.fbank with its defaults, use_energy False) ----
def _kaldi_mel(f: np.ndarray | float) -> np.ndarray:
    return 1127.0 * np.log(1.0 + f / 700.0)


def kaldi_mel_banks(n_mels: int, n_fft: int, sample_rate: int, low: float = 20.0, high: float = 0.0) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1]: triangles equally spaced on Kaldi's mel scale (the Nyquist bin gets none)."""
    high = high if high > 0 else high + sample_rate / 2
    mel_low, mel_high = _kaldi_mel(low), _kaldi_mel(high)
    delta = (mel_high - mel_low) / (n_mels + 1)
    left = mel_low + np.arange(n_mels)[:, None] * delta
    center, right = left + delta, left + 2 * delta
    mel = _kaldi_mel(sample_rate / n_fft * np.arange(n_fft // 2))[None, :]
    banks = np.maximum(0.0, np.minimum((mel - left) / (center - left), (right - mel) / (right - center)))
    return np.pad(banks, ((0, 0), (0, 1)))


def kaldi_fbank(audio: np.ndarray, n_mels: int = 80, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """[frames, n_mels] log mel energies: 25 ms povey-windowed frames every 10 ms (snip edges), DC removed,
    pre-emphasis 0.97, power spectrum over the next power of two, log with float32 epsilon."""
    x = np.asarray(audio, np.float64).reshape(-1)
    size, shift = sample_rate * 25 // 1000, sample_rate * 10 // 1000
    n_frames = 1 + (len(x) - size) // shift
    if n_frames < 1:
        return np.zeros((0, n_mels), np.float32)
    frames = np.lib.stride_tricks.sliding_window_view(x, size)[::shift][:n_frames].copy()
    frames -= frames.mean(axis=1, keepdims=True)
    frames -= 0.97 * np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames *= (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(size) / (size - 1))) ** 0.85  # povey
    n_fft = 1 << (size - 1).bit_length()
    power = np.abs(np.fft.rfft(frames, n_fft)) ** 2
    energies = power @ kaldi_mel_banks(n_mels, n_fft, sample_rate).T
    return np.log(np.maximum(energies, np.finfo(np.float32).eps)).astype(np.float32)


# ---- librosa's Slaney mel filterbank (librosa.filters.mel, htk False, norm "slaney") ----
def _slaney_hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    f = np.asarray(f, np.float64)
    log_step = np.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / log_step, f * 3.0 / 200.0)


def _slaney_mel_to_hz(m: np.ndarray) -> np.ndarray:
    log_step = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(log_step * (m - 15.0)), m * 200.0 / 3.0)


def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                       fmax: float | None = None) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] float32, area-normalised triangles on the Slaney mel scale."""
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0, sample_rate / 2, 1 + n_fft // 2)
    mel_f = _slaney_mel_to_hz(np.linspace(_slaney_hz_to_mel(fmin), _slaney_hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:n_mels] / fdiff[:n_mels, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)) * (2.0 / (mel_f[2:] - mel_f[:n_mels]))[:, None]
    return weights.astype(np.float32)


def _stft_power(frames: np.ndarray, window: np.ndarray) -> np.ndarray:
    return np.abs(np.fft.rfft(frames * window, axis=-1)) ** 2


def _hann(n: int) -> np.ndarray:  # periodic, as torch.hann_window
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)


def whisper_log_mel(audio: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """[n_mels, N // 160]: s3tokenizer's log-mel (n_fft 400, hop 160, centred and reflect-padded, the last
    frame dropped, log10 clamped to 8 below the peak, scaled to about [-1, 1])."""
    x = np.pad(np.asarray(audio, np.float64).reshape(-1), 200, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, 400)[::160][:-1]
    mel = slaney_mel_filters(SAMPLE_RATE, 400, n_mels).astype(np.float64) @ _stft_power(frames, _hann(400)).T
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def prompt_mel(audio24k: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """[frames, n_mels]: flashcosyvoice's mel_spectrogram (n_fft = win 1920, hop 480, fmin 0, fmax 8000,
    reflect-padded by 720 a side, not centred, magnitude, natural log clamped at 1e-5)."""
    n_fft, hop = 1920, 480
    x = np.pad(np.asarray(audio24k, np.float64).reshape(-1), (n_fft - hop) // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop]
    magnitude = np.sqrt(_stft_power(frames, _hann(n_fft)) + 1e-9)
    mel = magnitude @ slaney_mel_filters(PROMPT_RATE, n_fft, n_mels, 0.0, 8000.0).T.astype(np.float64)
    return np.log(np.maximum(mel, 1e-5)).astype(np.float32)


DEFAULT_REF_AUDIO = "default_ref_audio.wav"  # in the duplex model's version folder (export/assets/README.md)


def default_ref_audio(version_dir: Path) -> np.ndarray | None:
    """The duplex system prompt's voice reference when a session sends none, 16 kHz; None if not exported."""
    path = Path(version_dir) / DEFAULT_REF_AUDIO
    return read_wav(path) if path.exists() else None


def read_wav(path: Path) -> np.ndarray:
    """A WAV file as 16 kHz mono float32 (channels averaged, resampled)."""
    import soundfile

    audio, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    return resample(audio, rate, SAMPLE_RATE) if rate != SAMPLE_RATE else audio


def resample(audio: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    import soxr

    return np.asarray(soxr.resample(np.asarray(audio, np.float32), rate_in, rate_out), np.float32)


class VoiceFeaturizer:
    """The S3 tokenizer and CAM++ (ONNX) around the features above: one reference -> its VoiceFeatures."""

    def __init__(self, s3: Engine, campplus: Engine) -> None:
        self.s3, self.campplus = s3, campplus

    @classmethod
    def load(cls, folder: Path, threads: int = 1) -> VoiceFeaturizer:
        return cls(load_engine(folder, threads, S3_TOKENIZER), load_engine(folder, threads, CAMPPLUS))

    def __call__(self, audio: np.ndarray) -> VoiceFeatures:
        audio = np.asarray(audio, np.float32).reshape(-1)
        mels = whisper_log_mel(audio)[:, :MAX_S3_FRAMES]
        feats, lens = self.s3.input_names[:2]  # fed by position, as the reference does
        out = self.s3.run({feats: mels[None], lens: np.array([mels.shape[1]], np.int32)})
        tokens = np.asarray(next(iter(out.values()))).reshape(-1).astype(np.int64)
        fbank = kaldi_fbank(audio)
        fbank -= fbank.mean(axis=0, keepdims=True)
        embedding = next(iter(self.campplus.run({self.campplus.input_names[0]: fbank[None]}).values())).reshape(-1)
        mel = prompt_mel(resample(audio, SAMPLE_RATE, PROMPT_RATE))
        n = UP_RATE * len(tokens)  # edge-padded (F.pad replicate) or cut to 2 frames per token
        mel = np.pad(mel, ((0, n - len(mel)), (0, 0)), mode="edge") if len(mel) < n else mel[:n]
        return VoiceFeatures(tokens, mel, embedding.astype(np.float32))



def _usable(name: str, path: Path) -> np.ndarray:
    try:
        audio = read_wav(path)
    except Exception as exc:
        raise StepError(Code.INVALID_VOICE, f"the voice {name!r} cannot be read ({type(exc).__name__})") from exc
    if len(audio) < MIN_VOICE_S * SAMPLE_RATE or (problem := pcm_problem(audio)):
        raise StepError(Code.INVALID_VOICE, f"the voice {name!r} is not a usable reference: "
                        f"{problem or f'under {MIN_VOICE_S} s'}")
    return audio


class VoiceLibrary:
    """Named voices: `<folder>/<name>.wav` (any rate, mono or not), read once as 16 kHz references.

    A name that is not a file there (an OpenAI client's "alloy") gets None: the session keeps its default voice.
    """

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._voices: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> np.ndarray | None:
        """The voice's 16 kHz reference; None when there is no such file. A file that is not a usable reference
        (unreadable, under MIN_VOICE_S, not clean PCM) is `invalid_voice` for the session that names it."""
        if self.folder is None or not VOICE_NAME.fullmatch(name):  # a name, never a path
            return None
        with self._lock:
            if name not in self._voices:
                path = self.folder / f"{name}.wav"
                if not path.is_file():
                    return None
                self._voices[name] = _usable(name, path)
            return self._voices[name]

    def names(self) -> list[str]:
        return [] if self.folder is None else sorted(p.stem for p in self.folder.glob("*.wav"))

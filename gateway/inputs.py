"""Caller input that more than one dialect takes in the same shape (pure code): a second of audio with its
video frames (`/backend`'s `input.append`, MiniCPM-o's `input_audio_buffer.append`), images, voice references.

Accepts the field aliases the reference server accepts (`audio` / `audio_base64` / `audio_data`,
`frames` / `video_frames` / `frame_base64_list`, `voice.*`).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import numpy as np

from minicpmo_triton.media.pcm import pcm_problem

from .audio import INPUT_RATE, AudioDecodeError, decode_f32_base64, decode_pcm16_base64, read_wav, resample
from .codes import ClientCode
from .limits import Limits, identifier, image_pixels
from .wire import ProtocolError

MAX_APPEND_SECONDS = 5
MAX_FRAMES = 4  # images seen with one second of audio
MAX_IMAGE_BYTES = 8 << 20
VOICE_SECONDS = (0.5, 30.0)  # a voice reference's allowed duration
VOICE_FORMATS = {"f32": decode_f32_base64, "pcm16": decode_pcm16_base64}
VOICE_RATES = (16_000, 24_000)
VOICE_NAMES = ("default",)  # the voices a session may name


@dataclass(frozen=True)
class InputAppend:
    input_id: str | None
    audio: np.ndarray
    frames: list[bytes] = field(default_factory=list)  # encoded images, base64-decoded
    max_slice_nums: list[int] = field(default_factory=list)
    force_listen: bool = False


def as_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, f"{what} must be a JSON object")
    return value


def first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def voice_ref(name: str, data: Any, close_code: int | None, fmt: str = "f32", rate: int = INPUT_RATE) -> np.ndarray:
    """One voice reference (base64 `fmt` audio at `rate`), within VOICE_SECONDS, else `invalid_voice`;
    returned as 16 kHz float32."""
    if fmt not in VOICE_FORMATS or rate not in VOICE_RATES:
        raise ProtocolError(ClientCode.INVALID_VOICE, f"{name}: format must be one of {', '.join(VOICE_FORMATS)} at "
                            f"{' or '.join(map(str, VOICE_RATES))} Hz", close_code=close_code)
    if not isinstance(data, str):
        raise ProtocolError(ClientCode.INVALID_VOICE, f"{name} must be base64 {fmt} {rate // 1000} kHz audio",
                            close_code=close_code)
    try:
        audio = VOICE_FORMATS[fmt](data, int(VOICE_SECONDS[1] * rate))
    except AudioDecodeError as exc:
        raise ProtocolError(ClientCode.INVALID_VOICE, f"{name}: {exc}", close_code=close_code) from exc
    check_reference(name, audio, rate, close_code)
    return resample(audio, rate, INPUT_RATE)


def check_reference(name: str, audio: np.ndarray, rate: int, close_code: int | None) -> None:
    """A reference's length within VOICE_SECONDS and its samples clean PCM, else `invalid_voice`."""
    if not VOICE_SECONDS[0] * rate <= len(audio) <= VOICE_SECONDS[1] * rate:
        raise ProtocolError(ClientCode.INVALID_VOICE, f"{name} must be {VOICE_SECONDS[0]} to {VOICE_SECONDS[1]:.0f} s",
                            close_code=close_code)
    if problem := pcm_problem(audio):
        raise ProtocolError(ClientCode.INVALID_VOICE, f"{name}: {problem}", close_code=close_code)


class VoiceCheck(TypedDict):
    """`POST /v1/voices/check`'s answer."""

    ok: bool
    voice: NotRequired[str]  # a named voice's name
    duration_s: float | None  # the reference's (None: a built-in voice)
    sample_rate: int | None


def check_voice(body: Any, voices_dir: Path | None = None) -> VoiceCheck:
    """`POST /v1/voices/check`: `{voice: name}` (a built-in voice, or `<name>.wav` in the model server's voice
    folder, read and judged as a reference) or `{audio, format, sample_rate}` judged as a session's voice
    reference would be; the answer's body, else `invalid_voice` (or `invalid_payload`)."""
    body = as_object(body, "the request body")
    if body.get("voice") is not None:
        name = identifier(body["voice"], "voice", ClientCode.INVALID_VOICE)
        if name in VOICE_NAMES:
            return {"ok": True, "voice": name, "duration_s": None, "sample_rate": None}
        path = voices_dir / f"{name}.wav" if voices_dir is not None else None
        if path is None or not path.is_file():
            known = [*VOICE_NAMES, *(sorted(p.stem for p in voices_dir.glob("*.wav")) if voices_dir else [])]
            raise ProtocolError(ClientCode.INVALID_VOICE, f"no voice named {name!r}; known: {', '.join(known)}")
        try:
            audio = read_wav(path)
        except Exception as exc:
            raise ProtocolError(ClientCode.INVALID_VOICE,
                                f"the voice {name!r} cannot be read ({type(exc).__name__})") from exc
        check_reference(name, audio, INPUT_RATE, None)
        return {"ok": True, "voice": name, "duration_s": round(len(audio) / INPUT_RATE, 3), "sample_rate": INPUT_RATE}
    rate, fmt = body.get("sample_rate", INPUT_RATE), body.get("format", "f32")
    if not isinstance(rate, int) or isinstance(rate, bool):
        raise ProtocolError(ClientCode.INVALID_VOICE, "sample_rate must be 16000 or 24000")
    audio = voice_ref("audio", body.get("audio"), None, str(fmt), rate)
    return {"ok": True, "duration_s": round(len(audio) / INPUT_RATE, 3), "sample_rate": rate}


def _audio_field(payload: dict[str, Any]) -> str | None:
    for key in ("audio_base64", "audio_data"):
        if isinstance(payload.get(key), str) and payload[key]:
            return payload[key]
    audio = payload.get("audio")
    if isinstance(audio, dict):
        audio = first(audio.get("data"), audio.get("base64"), audio.get("audio_base64"))
    return audio if isinstance(audio, str) and audio else None


def image_bytes(data: str) -> bytes:
    """An image's bytes: valid base64, within MAX_IMAGE_BYTES, of a format the server decodes."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(ClientCode.BAD_IMAGE, f"an image is not valid base64: {exc}") from exc
    if not raw or len(raw) > MAX_IMAGE_BYTES:
        raise ProtocolError(ClientCode.BAD_IMAGE, f"an image must be 1 byte to {MAX_IMAGE_BYTES // (1 << 20)} MiB")
    image_pixels(raw)  # its header only: the format allow-list
    return raw


def _frames(payload: dict[str, Any], limits: Limits) -> list[bytes]:
    frames = first(payload.get("frame_base64_list"), payload.get("video_frames"), payload.get("frames")) or []
    if not isinstance(frames, list):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "frames must be a list")
    out = []
    for frame in frames:
        data = first(frame.get("data"), frame.get("base64")) if isinstance(frame, dict) else frame
        if not isinstance(data, str) or not data:
            raise ProtocolError(ClientCode.INVALID_PAYLOAD, "each frame must be a base64 JPEG string or {data}")
        out.append(image_bytes(data))
    if len(out) > MAX_FRAMES:
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, f"at most {MAX_FRAMES} frames per input")
    limits.images(out, "frames", MAX_FRAMES)
    return out


def slices(value: Any, n_frames: int) -> list[int]:
    if value is None:
        return [1] * n_frames
    values = value if isinstance(value, list) else [value] * max(n_frames, 1)
    if isinstance(value, list) and n_frames and len(values) != n_frames:
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "max_slice_nums as a list needs one entry per frame")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 9 for v in values):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "max_slice_nums must be an integer 1..9 or a list of them")
    return values


def parse_append(payload: dict[str, Any], limits: Limits | None = None) -> InputAppend:
    """One second (at most MAX_APPEND_SECONDS) of base64 float32 16 kHz audio, with its frames (the hints object
    may carry `force_listen` and `max_slice_nums`, read here)."""
    hints = payload.get("hints") or {}
    if not isinstance(hints, dict):
        raise ProtocolError(ClientCode.INVALID_PAYLOAD, "hints must be an object")
    encoded = _audio_field(payload)
    audio = None
    if encoded is not None:
        try:
            audio = decode_f32_base64(encoded, MAX_APPEND_SECONDS * INPUT_RATE)
        except AudioDecodeError as exc:
            raise ProtocolError(ClientCode.BAD_AUDIO, str(exc)) from exc
    frames = _frames(payload, limits or Limits.default())
    if audio is None or len(audio) == 0:
        raise ProtocolError(ClientCode.MISSING_FIELD, "full_duplex input.append requires audio (base64 float32 16 kHz)")
    force = first(payload.get("force_listen"), hints.get("force_listen"), False)
    input_id = payload.get("input_id")
    return InputAppend(
        input_id=str(input_id) if input_id is not None else None,
        audio=audio,
        frames=frames,
        max_slice_nums=slices(first(payload.get("max_slice_nums"), hints.get("max_slice_nums")), len(frames)),
        force_listen=bool(force),
    )

"""What each stage takes and gives, as dataclasses whose fields are the Triton tensor names.

One codec turns them into tensors and back, for the Triton model (server side), the BLS caller
(client side) and the in-process pipeline alike. Scalars travel as shape-[1] tensors; the leading
batch dimension of a request is added and removed by the callers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .errors import StepError, from_wire, to_wire
from .model_config import DuplexDefaults

T = TypeVar("T")
_D = DuplexDefaults()  # what a request that leaves an input out gets

_SCALAR_DTYPES = {bool: np.bool_, int: np.int64, float: np.float32}
# The stages whose config says `model_transaction_policy { decoupled: true }`: answered through a response
# sender, so a caller uses a stream (BLS: `exec(decoupled=True)`; gRPC: `stream_infer`), not a unary call.
DECOUPLED_STAGES = frozenset({"llm", "tts", "token2wav"})
# A request parameter that makes a request to a stateful stage a liveness probe (the gateway's health watch): its
# model answers it at once with an empty final response, before any stage work or admission (its stub is alive;
# a full KV pool would refuse a new sequence `pool_full`, which says nothing of a dead stub).
PROBE = "minicpmo_probe"
# A request parameter that makes a request to the llm model a TTS call (a `TtsRequest`'s tensors, no sequence flags of
# its own): where the llm model runs the TTS (`tts_in_llm`), every use of the TTS goes to it, a turn-based reply's
# voice too, so a GPU holds one TTS pool.
SPEECH_CALL = "minicpmo_speech"


def tensor(dtype: type, ndim: int) -> Any:
    return field(default_factory=lambda: np.zeros((0,) * ndim, dtype), metadata={"dtype": dtype, "ndim": ndim})


def _scalar_type(f: dataclasses.Field) -> type | None:
    return {"bool": bool, "int": int, "float": float}.get(str(f.type))


def encode(obj: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        scalar = _scalar_type(f)
        if scalar is not None:
            out[f.name] = np.array([value], dtype=_SCALAR_DTYPES[scalar])
        else:
            out[f.name] = np.ascontiguousarray(value, dtype=f.metadata["dtype"])
    return out


def decode(cls: type[T], get: Callable[[str], np.ndarray | None]) -> T:
    """Build `cls` from tensors; a missing optional tensor keeps the field's default."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        arr = get(f.name)
        if arr is None:
            continue
        scalar = _scalar_type(f)
        values[f.name] = scalar(arr.reshape(-1)[0]) if scalar is not None else arr
    return cls(**values)


def triton_dtype(f: dataclasses.Field) -> str:
    scalar = _scalar_type(f)
    dtype = _SCALAR_DTYPES[scalar] if scalar is not None else f.metadata["dtype"]
    return {np.bool_: "TYPE_BOOL", np.int64: "TYPE_INT64", np.float32: "TYPE_FP32", np.object_: "TYPE_STRING"}[dtype]


def triton_dims(f: dataclasses.Field) -> list[int]:
    return [1] if _scalar_type(f) is not None else [-1] * f.metadata["ndim"]


# ---- audio_encoder ----
@dataclass
class AudioEncoderRequest:
    audio: np.ndarray = tensor(np.float32, 1)  # 16 kHz mono, any length (the stage pads and cuts it)


@dataclass
class AudioEncoderResult:
    embeds: np.ndarray = tensor(np.float32, 2)  # [10 per second, llm hidden]


# ---- vision_encoder ----
@dataclass
class VisionEncoderRequest:
    images: np.ndarray = tensor(np.object_, 1)  # encoded images (JPEG, PNG) as bytes
    max_slice_nums: np.ndarray = tensor(np.int64, 1)  # one per image, 1..9


@dataclass
class VisionEncoderResult:
    embeds: np.ndarray = tensor(np.float32, 3)  # [slices of all images, 64, llm hidden]
    grids: np.ndarray = tensor(np.int64, 2)  # [images, 2] HD slices per image (rows, cols); (0, 0): the overview alone

    @property
    def slices(self) -> np.ndarray:
        """Slices per image, the overview included."""
        return (1 + self.grids.prod(axis=1)).astype(np.int64) if len(self.grids) else np.zeros(0, np.int64)


# ---- llm ----
@dataclass
class LlmRequest:
    input_ids: np.ndarray = tensor(np.int64, 1)  # prefill; `audio_placeholder` where embeds go
    embeds: np.ndarray = tensor(np.float32, 2)
    # The step's own audio (16 kHz): the stage encodes it, batched with the other rows, and its
    # embeddings fill the placeholders after `embeds` (one hop less per step than a separate encoder).
    audio: np.ndarray = tensor(np.float32, 1)
    decode: bool = True  # False: prefill only (a system prompt, a context)
    force_listen: bool = False
    temperature: float = _D.temperature
    top_k: int = _D.top_k
    top_p: float = _D.top_p
    repetition_penalty: float = _D.repetition_penalty
    length_penalty: float = _D.length_penalty
    max_new_tokens: int = _D.max_new_speak_tokens_per_chunk
    seed: int = 0
    chat: bool = False  # turn-based: text until <|im_end|> (else the duplex rules)
    last_chunk: bool = False  # chat: the turn's token budget ends with this call
    rollback_to: int = -1  # >= 0: first cut the KV cache to this length and end the spoken turn there
    # Teacher forcing: these tokens are decoded in place of sampled ones, under the same rules (a rule that
    # ends the chunk, its token budget, still wins); their hidden states are collected as a sampled text's.
    forced_ids: np.ndarray = tensor(np.int64, 1)
    # The sliding window (duplex_window.py): an index in WINDOW_MODES (0 off, 1 basic, 2 context), basic's
    # watermarks, context's units held and previous tokens kept
    window_mode: int = 0
    window_high: int = _D.window_high_tokens
    window_low: int = _D.window_low_tokens
    window_units: int = _D.window_max_units
    window_previous: int = _D.window_previous_tokens
    # `tts_in_llm` (the llm model runs the TTS core too): a speaking result's text goes on to the TTS in this
    # process, as the tts model's call would (text_ids, tts_hidden, turn_end = end_of_turn, seed), and its codes
    # come as a second response (a TtsResult) on the call's stream. The TTS's START is the llm model's own (its
    # session's first spoken chunk), its END the LLM's.
    speak: bool = False
    tts_turn_start: bool = False
    tts_tokens: int = _D.tts_tokens_per_chunk
    tts_temperature: float = _D.tts_temperature
    # `token2wav_in_llm` (the llm model runs token2wav too): the codes go on to token2wav in this process, and the
    # second response is their audio (`VoicedSpeech`). What only the duplex model knows rides here (as a
    # Token2WavRequest's fields): token2wav's turn start (a restart), the voice reference or the default voice again;
    # `finalize` is the LLM's end of turn. token2wav's START is the llm model's own, its END the LLM's.
    voice_turn_start: bool = False
    voice: np.ndarray = tensor(np.float32, 1)
    default_voice: bool = False


@dataclass
class LlmResult:
    generated: np.ndarray = tensor(np.int64, 1)
    text_ids: np.ndarray = tensor(np.int64, 1)
    tts_hidden: np.ndarray = tensor(np.float32, 2)  # hidden states of text_ids, for the TTS
    is_listen: bool = True
    end_of_turn: bool = False  # a spoken chunk that ended its turn (a listen: False, as the reference's result)
    turn_closed: bool = False  # a forced listen closed the turn the model had open: token2wav restarts
    turn_start: bool = False
    kv_length: int = 0
    n_prefill: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    encode_ms: float = 0.0  # the request's audio through the audio encoder
    cached_tokens: int = 0  # context reused from earlier steps / turns (the KV length before this call)
    kv_dropped: int = 0  # tokens the sliding window has dropped from this session so far
    window_events: int = 0  # times it slid
    # The paged engine's in-flight loop: its iteration count when this row joined the loop, and when it left it
    # (0 on the ONNX path). A row that joined while another decoded has join_iteration within that one's span.
    join_iteration: int = 0
    done_iteration: int = 0

    @property
    def kv_cache_length(self) -> int:
        """The cache's length as MiniCPM-o's worker reports it after a step (after streaming_generate, before
        finalize_unit): `kv_length`, and a forced listen's <|turn_eos|>, which the reference feeds at once
        (modeling_minicpmo_unified.py:5003-5011) and the stage with the unit's close."""
        return self.kv_length + int(self.turn_closed)


# ---- tts ----
@dataclass
class TtsRequest:
    text_ids: np.ndarray = tensor(np.int64, 1)
    tts_hidden: np.ndarray = tensor(np.float32, 2)
    turn_start: bool = False
    turn_end: bool = False
    n_tokens: int = _D.tts_tokens_per_chunk
    temperature: float = _D.tts_temperature
    seed: int = 0


@dataclass
class TtsResult:
    speech_tokens: np.ndarray = tensor(np.int64, 1)
    kv_length: int = 0


# ---- token2wav ----
def audio_key(audio: np.ndarray) -> bytes:
    """What identifies a voice reference: the hash of its float32 samples."""
    return hashlib.sha256(np.ascontiguousarray(audio, np.float32).tobytes()).digest()


@dataclass
class Token2WavRequest:
    speech_tokens: np.ndarray = tensor(np.int64, 1)
    turn_start: bool = False
    finalize: bool = False
    # A voice reference (16 kHz), sent when a session's voice is set or changes; empty: the session's voice
    # so far (at first, the default voice), or the default voice again with `default_voice`.
    voice: np.ndarray = tensor(np.float32, 1)
    default_voice: bool = False

    @functools.cached_property
    def voice_key(self) -> bytes:
        """`audio_key` of its voice reference, hashed once however often the stage asks (30 s: 2 MB)."""
        return audio_key(self.voice)


@dataclass
class Token2WavResult:
    waveform: np.ndarray = tensor(np.float32, 1)  # 24 kHz mono


@dataclass
class SpeechRefused:
    """The second response of an llm call that spoke, when the TTS refused its chunk (`tts_in_llm`): the error in
    `errors.to_wire`'s form. Triton 2.51's python backend never hands a BLS caller an error response that follows a
    first response (its iterator waits on), so the refusal rides as a tensor of a plain response."""

    speech_error: np.ndarray = tensor(np.object_, 1)  # [to_wire(error)]

    @staticmethod
    def of(exc: Exception) -> SpeechRefused:
        return SpeechRefused(np.array([to_wire(exc).encode()], np.object_))

    def error(self) -> StepError | None:
        """The refusal as the error the TTS answered (its code kept), or None (the codes came)."""
        if not len(self.speech_error):
            return None
        raw = self.speech_error[0]
        return from_wire(raw.decode() if isinstance(raw, bytes) else str(raw), "tts")


@dataclass
class VoicedSpeech:
    """The second response of an llm call that spoke where the llm model runs token2wav too (`token2wav_in_llm`):
    the chunk's audio, and how many codes made it (the step's usage), instead of the codes."""

    waveform: np.ndarray = tensor(np.float32, 1)  # 24 kHz mono
    n_speech_tokens: int = 0


def spoke(request: LlmRequest, result: LlmResult) -> bool:
    """An llm call whose stream carries the TTS's codes after its result (`LlmRequest.speak`): it spoke."""
    return request.speak and request.decode and not result.is_listen


def voice_request(request: LlmRequest, result: LlmResult) -> Token2WavRequest:
    """token2wav's call for a call that spoke (`token2wav_in_llm`; its codes are the TTS's answer), as the duplex
    pipeline builds the token2wav model's request."""
    return Token2WavRequest(turn_start=request.voice_turn_start, finalize=result.end_of_turn, voice=request.voice,
                            default_voice=request.default_voice)


def speech_request(request: LlmRequest, result: LlmResult) -> TtsRequest:
    """The TTS's chunk for a call that spoke, as the duplex pipeline builds the tts model's request."""
    return TtsRequest(text_ids=result.text_ids, tts_hidden=result.tts_hidden, turn_start=request.tts_turn_start,
                      turn_end=result.end_of_turn, n_tokens=request.tts_tokens, temperature=request.tts_temperature,
                      seed=request.seed)


STAGE_IO: dict[str, tuple[type, type]] = {
    "audio_encoder": (AudioEncoderRequest, AudioEncoderResult),
    "vision_encoder": (VisionEncoderRequest, VisionEncoderResult),
    "llm": (LlmRequest, LlmResult),
    "tts": (TtsRequest, TtsResult),
    "token2wav": (Token2WavRequest, Token2WavResult),
}

# What a model's requests may carry (its config.pbtxt's inputs): its request's tensors, and for the llm a TTS call's
# (`SPEECH_CALL`; `temperature` and `seed` are then the TTS's) with token2wav's fields for its codes
# (`token2wav_in_llm`; `turn_start` is both the TTS's and token2wav's, as the pipeline sends them).
STAGE_INPUTS: dict[str, tuple[type, ...]] = {**{m: (io[0],) for m, io in STAGE_IO.items()},
                                             "llm": (LlmRequest, TtsRequest, Token2WavRequest)}

# What a model's responses may carry (its config.pbtxt's outputs): its result's tensors, and for the llm the TTS's
# codes (`tts_in_llm`; `kv_length` is then the TTS's), or their audio (`token2wav_in_llm`), or the refusal after them.
STAGE_OUTPUTS: dict[str, tuple[type, ...]] = {**{m: (io[1],) for m, io in STAGE_IO.items()},
                                              "llm": (LlmResult, TtsResult, SpeechRefused, VoicedSpeech)}


def output_names(model: str) -> list[str]:
    """The output tensors a model declares, each once, in its results' order."""
    return list(dict.fromkeys(f.name for cls in STAGE_OUTPUTS[model] for f in dataclasses.fields(cls)))

"""Compile exported ONNX stages to TensorRT engines with optimisation profiles (needs an NVIDIA GPU).

Precision: bf16 (`trt.BuilderFlag.BF16`: TensorRT may run layers in bf16, keeping fp32 where it must), never
fp16: Qwen3's activations overflow fp16, and bf16 keeps fp32's range. The ONNX graphs stay fp32 (they are what
the CPU runs and what the parity tests check), so the network is not strongly typed: the flag lets the builder
choose bf16 kernels.

Profiles cover what is served: per stage a list, the runner (`minicpmo_triton/engine/exported.py`) picks the first
whose ranges hold a call's shapes. The TTS's batched steps at any batch and a prefill of up to PREFILL_TOKENS at a
few rows; the audio encoders' 1 s steps at any batch and up to 30 s (Whisper's window) at a few rows. The LLM has no
plan: on a GPU it runs on the device engine core (minicpmo_triton/engine), its KV cache in a pool there; a plan fed
the whole cache from the host each call (`NOT_BUILT`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from ..model_config import PresetConfig


class NoGpuError(RuntimeError):
    pass


def require_gpu() -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None or subprocess.run([smi, "-L"], capture_output=True).returncode != 0:
        raise NoGpuError(
            "--runtime tensorrt needs an NVIDIA GPU with its driver (nvidia-smi found none); "
            "on this machine use the default --runtime onnx"
        )
    try:
        import tensorrt  # noqa: F401 (only whether it imports)
    except ImportError as exc:
        raise NoGpuError("TensorRT is not installed: pip install 'minicpmo-triton[gpu]'") from exc


Shapes = dict[str, tuple[tuple[int, ...], ...]]  # input -> (min, opt, max)

PRECISIONS = ("bf16", "fp32")
PREFILL_TOKENS = 2048  # a decoder prefill's longest (a system prompt, a turn-based question), at PREFILL_ROWS rows
PREFILL_ROWS = 4
STEP_TOKENS = 64  # a duplex step's new tokens (a unit's 11 + up to a chunk's text; a TTS chunk's condition)
LONG_AUDIO_S = 30  # the audio encoders' longest input (Whisper's window: 1500 positions), at PREFILL_ROWS rows
SAMPLE_RATE = 16_000


def builder_flags(trt: Any, precision: str) -> list[Any]:
    """The builder flags for `precision`: bf16 (the default) or fp32; fp16 is refused (Qwen3 overflows it)."""
    if precision == "bf16":
        return [trt.BuilderFlag.BF16]
    if precision == "fp32":
        return []
    raise ValueError(f"precision must be one of {PRECISIONS} (fp16 overflows Qwen3's activations), not {precision!r}")


NOT_BUILT = ("llm",)  # stages served on a GPU by the engine core, whose exported graph is the CPU's only


def profiles(stage: str, preset: PresetConfig, max_batch: int) -> list[Shapes]:
    """Optimisation profiles, each min / opt / max shapes per input: the batched 1-second step first, then a
    few rows of long input (prefill over 256 tokens, audio over 4 s), up to the 8192-token context."""
    if stage == "audio_encoder":
        return [{"audio": ((1, 1600), (max_batch // 2, SAMPLE_RATE), (max_batch, SAMPLE_RATE * 4))},
                {"audio": ((1, 1600), (1, SAMPLE_RATE * 10), (PREFILL_ROWS, SAMPLE_RATE * LONG_AUDIO_S))}]
    if stage == "audio_encoder_stream":  # 1 to 4 s chunks at any batch, up to 30 s at a few rows
        return [_stream_profile(preset, ((1, 1), (max_batch // 2, 10), (max_batch, 40))),
                _stream_profile(preset, ((1, 1), (1, 100), (PREFILL_ROWS, 10 * LONG_AUDIO_S)))]
    if stage.startswith("token2wav_"):
        return [token2wav_profiles(stage, preset, max_batch)]
    if stage == "vision_encoder":
        v = preset.vision
        n, opt, most = v.batch_slices, (v.scale_resolution // v.patch) ** 2, v.max_patches
        return [{"pixels": ((1, 3, v.patch, v.patch), (n, 3, v.patch, opt * v.patch), (n, 3, v.patch, most * v.patch)),
                 "position_ids": ((1, 1), (n, opt), (n, most)), "tgt_sizes": ((1, 2), (n, 2), (n, 2))}]
    return [_decoder_profile(stage, preset, ((1, 1), (max_batch // 2, 1), (max_batch, STEP_TOKENS))),
            _decoder_profile(stage, preset, ((1, 1), (1, 300), (PREFILL_ROWS, PREFILL_TOKENS)))]


def _stream_profile(preset: PresetConfig, chunks: tuple[tuple[int, int], ...]) -> Shapes:
    """The streaming Whisper: (rows, tenths of a second of audio) min / opt / max, against 0 to 1500 cached
    positions."""
    a = preset.audio
    frames = tuple((b, 4 + 10 * n) for b, n in chunks)
    pasts = tuple((b, p) for (b, _), p in zip(chunks, (0, a.max_positions // 2, a.max_positions), strict=True))
    kv = tuple((a.layers, b, a.heads, p, a.d_model // a.heads) for b, p in pasts)
    return {"mel": tuple((b, a.n_mels, f) for b, f in frames), "mel_mask": frames,
            "position_ids": tuple((b, (f - 4) // 2) for b, f in frames), "past_mask": pasts,
            "past_key": kv, "past_value": kv}


def _decoder_profile(stage: str, preset: PresetConfig, seq: tuple[tuple[int, int], ...]) -> Shapes:
    """The TTS: (rows, new tokens) min / opt / max against 0 to the whole context of past."""
    ctx = preset.duplex.context_tokens
    d = preset.tts.decoder

    def kv_shape(p: tuple[int, int]) -> tuple[int, ...]:
        return d.layers, p[0], d.kv_heads, p[1], d.head_dim

    past = tuple((b, p) for (b, _), p in zip(seq, (0, ctx // 2, ctx), strict=True))
    names = ["text_ids", "has_hidden", "code_ids", "is_code"]
    hidden_in = "llm_hidden"
    shapes: dict[str, tuple[tuple[int, ...], ...]] = {n: seq for n in names + ["position_ids"]}
    shapes[hidden_in] = tuple((b, t, preset.llm.hidden) for b, t in seq)
    shapes["past_mask"] = past
    shapes["past_key"] = shapes["past_value"] = tuple(kv_shape(p) for p in past)
    shapes["last_index"] = tuple((b,) for b, _ in seq)
    return shapes


def token2wav_profiles(stage: str, preset: PresetConfig, max_batch: int) -> Shapes:
    """One chunk (25 + 3 tokens, 50 mel frames); caches up to a 30 s prompt + 100 frames."""
    d = preset.token2wav
    b = ((1,), (max_batch // 2,), (max_batch,))
    t, n = d.chunk_tokens + d.lookahead, 2 * d.chunk_tokens
    cache = ((0,), (400,), (1500 + d.cache_tail_frames,))  # mel frames
    if stage == "token2wav_encoder":
        dk = 2 * d.channels // d.heads
        pairs = list(zip(b, cache, strict=True))
        return {"tokens": tuple((x[0], w) for x, w in zip(b, (1, t, t), strict=True)), "n_real": b,
                "cnn_cache": tuple((x[0], d.channels, 6) for x in b), "cache_len": b,
                "token_cache": tuple((d.num_blocks, x[0], d.heads, c[0] // 2, dk) for x, c in pairs),
                "mel_cache": tuple((d.num_up_blocks, x[0], d.heads, c[0], dk) for x, c in pairs)}
    if stage == "token2wav_estimator":
        mel = tuple((x[0], d.n_mels, w) for x, w in zip(b, (2, n, n + 2 * d.lookahead), strict=True))
        return {"x": mel, "mu": mel, "cond": mel, "t": b, "spk": tuple((x[0], d.n_mels) for x in b), "cache_len": b,
                "cnn_cache": tuple((d.dit_depth, 2 * x[0], 2 * d.dit_hidden, 2) for x in b),
                "att_cache": tuple((d.dit_depth, 2 * x[0], d.dit_heads, c[0], 2 * d.dit_head_dim)
                                   for x, c in zip(b, cache, strict=True))}
    frames = (2, n + d.mel_cache_frames, n + d.mel_cache_frames + 2 * d.lookahead)
    return {"mel": tuple((x[0], d.n_mels, f) for x, f in zip(b, frames, strict=True)), "cache_len": b,
            "cache_source": tuple((x[0], 1, d.source_cache_samples) for x in b),
            "rand_ini": tuple((x[0], 9) for x in b),
            "sine_noise": tuple((x[0], f * 480, 9) for x, f in zip(b, frames, strict=True))}


def build_engine(onnx_path: Path, plan_path: Path, shapes: list[Shapes], precision: str = "bf16") -> None:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 8 << 30)
    for flag in builder_flags(trt, precision):
        config.set_flag(flag)
    for ranges in shapes:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in ranges.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build {plan_path}")
    plan_path.write_bytes(bytes(serialized))

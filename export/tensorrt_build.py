"""Compile exported ONNX stages to TensorRT engines with optimisation profiles (needs an NVIDIA GPU)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from minicpmo_triton.model_config import PresetConfig


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
        import tensorrt  # noqa: F401
    except ImportError as exc:
        raise NoGpuError("TensorRT is not installed: pip install 'minicpmo-triton[gpu]'") from exc


def profiles(stage: str, preset: PresetConfig, max_batch: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """min / opt / max shapes per input: one 1-second step, up to the 8192-token context."""
    ctx = preset.duplex.context_tokens
    if stage == "audio_encoder":
        return {"audio": ((1, 1600), (max_batch // 2, 16_000), (max_batch, 16_000 * 4))}
    spk = preset.speaker.dim
    if stage == "token2wav":
        w = preset.token2wav.left_context + preset.token2wav.lookahead
        return {"tokens": ((1, w + 1), (max_batch // 2, w + 25), (max_batch, w + 200)),
                "speaker": ((1, spk), (max_batch // 2, spk), (max_batch, spk))}
    if stage == "vision_encoder":
        s = preset.vision.image_size
        return {"pixels": ((1, 3, s, s), (8, 3, s, s), (36, 3, s, s))}
    if stage == "speaker_encoder":
        return {"audio": ((1, 1600), (1, 16_000 * 5), (4, 16_000 * 30))}
    d = preset.llm if stage == "llm" else preset.tts.decoder
    kv = lambda p: (d.layers, p[0], d.kv_heads, p[1], d.head_dim)  # noqa: E731
    seq = ((1, 1), (max_batch // 2, 1), (max_batch, 256))
    past = ((1, 0), (max_batch // 2, ctx // 2), (max_batch, ctx))
    names = ["input_ids", "use_embeds"] if stage == "llm" else ["text_ids", "has_hidden", "code_ids", "is_code"]
    hidden_in = "embeds" if stage == "llm" else "llm_hidden"
    shapes = {n: seq for n in names + ["position_ids"]}
    shapes[hidden_in] = tuple((b, t, preset.llm.hidden) for b, t in seq)
    shapes["past_mask"] = past
    shapes["past_key"] = shapes["past_value"] = tuple(kv(p) for p in past)
    shapes["last_index"] = tuple((b,) for b, _ in seq)
    return shapes


def build_engine(onnx_path: Path, plan_path: Path, shapes: dict, fp16: bool = True) -> None:
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
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build {plan_path}")
    plan_path.write_bytes(bytes(serialized))

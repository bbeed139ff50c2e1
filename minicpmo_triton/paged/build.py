"""A paged decoder built over its weights: the dtype, the attention backend, the pool sized to its budget.

Shared by the LLM and the TTS engines (each holds a pool of its own: their layers and heads differ); the streaming
Whisper's pool (whisper.py) is built by `build_pool` too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..model_config import DecoderDims
from .attention import PagedAttention, pick_attention
from .model import PagedDecoder
from .pool import KvPool, PoolShape, blocks_in_budget, budget_bytes
from .traffic import Traffic, Work


def device_dtype(device: torch.device) -> torch.dtype:
    """bf16 on the GPU (Qwen3 overflows fp16), fp32 on the CPU (where bf16 matmuls are slow and the parity
    tests hold the path to 1e-4)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_pool(shape: PoolShape, weights: dict[str, torch.Tensor], *, device: str = "cpu", pool_size: float = 0.5,
               kv_dtype: str = "auto", max_sessions: int = 256, max_tokens: int = 8192, attention: str = "auto",
               pool_tokens: int = 0, dtype: torch.dtype | None = None) -> tuple[KvPool, PagedAttention, torch.dtype]:
    """A KV pool of `shape` sized to its budget and the attention backend that reads it; returns them and the
    weights' dtype. `pool_size`: GB (> 1) or a fraction of the device's free memory (less these `weights` on a
    GPU), unless `pool_tokens` says how many tokens it holds; `kv_dtype`: auto (the weights'), fp8; `dtype`: the
    weights' (default: `device_dtype`)."""
    dev = torch.device(device)
    dtype = dtype or device_dtype(dev)
    kv = torch.float8_e4m3fn if kv_dtype == "fp8" else dtype
    backend: PagedAttention = pick_attention(dev, "gather" if kv_dtype == "fp8" else attention)
    if backend.name == "flex":
        shape = dataclasses.replace(shape, block_size=max(shape.block_size, 128))  # flex's KV tile: one block a tile
    budget = budget_bytes(pool_size, dev)
    if pool_size <= 1 and dev.type == "cuda":
        budget -= sum(t.numel() for t in weights.values()) * torch.empty(0, dtype=dtype).element_size()
    blocks = shape.blocks_for(pool_tokens) if pool_tokens else blocks_in_budget(shape, kv, budget)
    # flex masks scores, not values: a never-written block must hold no NaN, so its pool is zeroed
    pool = KvPool(shape, max(1, blocks), kv, dev, max_sessions, max_tokens, Traffic(),
                  zeroed=backend.name == "flex" or dev.type != "cpu")
    return pool, backend, dtype


def build_decoder(weights: dict[str, torch.Tensor], dims: DecoderDims, *, device: str = "cpu",
                  pool_size: float = 0.5, block_size: int = 16, kv_dtype: str = "auto", max_sessions: int = 256,
                  max_tokens: int = 8192, attention: str = "auto", pool_tokens: int = 0,
                  dtype: torch.dtype | None = None, compile_layers: bool | None = None) -> PagedDecoder:
    """`build_pool`'s settings; `compile_layers`: None = on CUDA (model.py). The pool's traffic ledger is
    `decoder.pool.traffic`."""
    shape = PoolShape(dims.layers, dims.kv_heads, dims.head_dim, block_size)
    pool, backend, dtype = build_pool(shape, weights, device=device, pool_size=pool_size, kv_dtype=kv_dtype,
                                      max_sessions=max_sessions, max_tokens=max_tokens, attention=attention,
                                      pool_tokens=pool_tokens, dtype=dtype)
    return PagedDecoder(weights, dims, pool, backend, dtype, Work(), compile_layers)


WEIGHTS_FILE = "weights.safetensors"  # written by the export beside a paged stage's model.onnx (llm, tts)


def load_weights(folder: Path, device: str) -> dict[str, torch.Tensor]:
    """The exported weights of a paged stage (`folder`/weights.safetensors), on `device`."""
    from safetensors.torch import load_file

    path = Path(folder) / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m export` first")
    return load_file(str(path), device=device)

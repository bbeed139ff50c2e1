"""Building the engine cores: a decoder over its weights, its pool sized to its budget, the attention backend, the
head, the runner and the core. Shared by the LLM and the TTS (each holds a pool of its own: their layers and heads
differ); the streaming Whisper's pool (whisper.py) is built by `build_pool` too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from ..model_config import DecoderDims, SpecialTokens, TtsDims
from .attention import PagedAttention, pick_attention
from .core import EngineCore
from .llm_head import LlmHead
from .model import DuplexLLM, PagedDecoder
from .pool import KvPool, PoolShape, blocks_in_budget, budget_bytes
from .protocol import TtsRules
from .runner import ModelRunner
from .scheduler import Scheduler
from .traffic import Traffic, Work
from .tts import TtsHead
from .tts_model import DuplexTTS

BATCH_ROWS = 256  # rows of a core's persistent batch (its largest CUDA graph bucket) unless the pool says fewer


def device_dtype(device: torch.device) -> torch.dtype:
    """bf16 on the GPU (Qwen3 overflows fp16), fp32 on the CPU (where bf16 matmuls are slow and the parity
    tests hold the path to 1e-4)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


Net = TypeVar("Net", bound=nn.Module)


def load_net(make: Callable[[], Net], weights: dict[str, torch.Tensor], device: torch.device,
             dtype: torch.dtype) -> Net:
    """The network `make` builds, holding `weights` (its state dict, the checkpoint's names) on `device` in `dtype`:
    built on the meta device (no random initialisation, nothing allocated twice), the weights assigned, then cast;
    no autograd (the engine never trains)."""
    with torch.device("meta"):
        net = make()
    net.load_state_dict(weights, assign=True)
    return net.to(device, dtype).eval().requires_grad_(False)


def build_pool(shape: PoolShape, *, device: str = "cpu", pool_size: float = 0.5,
               kv_dtype: str = "auto", max_sessions: int = 256, max_tokens: int = 8192, attention: str = "auto",
               pool_tokens: int = 0, dtype: torch.dtype | None = None, compiled: bool | None = None,
               pool_bytes: int = 0) -> tuple[KvPool, PagedAttention, torch.dtype]:
    """A KV pool of `shape` sized to its budget and the attention backend that reads it; returns them and the
    weights' dtype. `pool_bytes`: its bytes (the models': their memory plan's share), else `pool_size`: GB (> 1) or a
    fraction of the device's memory, unless `pool_tokens` says how many tokens it holds; `kv_dtype`: auto (the
    weights'), fp8 (read by the gather: flex reads bf16 only); `dtype`: the weights' (default: `device_dtype`);
    `compiled`: flex and the layers compiled (None: on CUDA)."""
    dev = torch.device(device)
    dtype = dtype or device_dtype(dev)
    kv = torch.float8_e4m3fn if kv_dtype == "fp8" else dtype
    flex = attention == "flex" or (attention == "auto" and kv_dtype != "fp8" and dev.type == "cuda")
    if flex:
        shape = dataclasses.replace(shape, block_size=max(shape.block_size, 128))  # flex's KV tile: one block a tile
    budget = pool_bytes or budget_bytes(pool_size, dev)
    blocks = shape.blocks_for(pool_tokens) if pool_tokens else blocks_in_budget(shape, kv, budget)
    # flex masks scores, not values: a never-written block must hold no NaN, so its pool is zeroed
    pool = KvPool(shape, max(1, blocks), kv, dev, max_sessions, max_tokens, Traffic(), zeroed=flex or dev.type != "cpu")
    backend = pick_attention(dev, pool, "flex" if flex else "gather", compiled)
    return pool, backend, dtype


def build_decoder(net: Callable[[], DuplexLLM | DuplexTTS], weights: dict[str, torch.Tensor], dims: DecoderDims, *,
                  device: str = "cpu", pool_size: float = 0.5, block_size: int = 16, kv_dtype: str = "auto",
                  max_sessions: int = 256, max_tokens: int = 8192, attention: str = "auto", pool_tokens: int = 0,
                  dtype: torch.dtype | None = None, compile_layers: bool | None = None,
                  pool_bytes: int = 0) -> PagedDecoder:
    """The decoder of the network `net` builds (dims: its decoder's) over `weights`, on a pool of its own:
    `build_pool`'s settings; `compile_layers`: the layers and flex compiled (None: on CUDA). The pool's traffic
    ledger is `decoder.pool.traffic`."""
    shape = PoolShape(dims.layers, dims.kv_heads, dims.head_dim, block_size)
    pool, backend, dtype = build_pool(shape, device=device, pool_size=pool_size, kv_dtype=kv_dtype,
                                      max_sessions=max_sessions, max_tokens=max_tokens, attention=attention,
                                      pool_tokens=pool_tokens, dtype=dtype, compiled=compile_layers,
                                      pool_bytes=pool_bytes)
    return PagedDecoder(load_net(net, weights, pool.device, dtype), pool, backend, dtype, Work(), compile_layers)


def core_over(head: LlmHead | TtsHead, rows: int, overlap: bool = True, graphs: bool | None = None,
              prefill_tokens: int = 2048) -> EngineCore:
    """The engine core over a head: its runner (`rows` of persistent batch; CUDA graphs: None = on CUDA) and its
    scheduler."""
    pool = head.model.pool
    runner = ModelRunner(head, rows, graphs)
    widths = (pool.max_blocks,) if head.model.attention.name == "flex" else None  # flex: one width (see attention)
    return EngineCore(runner, Scheduler(rows, pool.shape.block_size, pool.max_blocks, prefill_tokens, widths),
                      overlap)


def llm_core(weights: dict[str, torch.Tensor], dims: DecoderDims, tokens: SpecialTokens, forbidden: np.ndarray, *,
             window: int = 512, top_k: int = 20, rows: int = BATCH_ROWS, overlap: bool = True,
             graphs: bool | None = None, **build: object) -> EngineCore:
    """The LLM's core: `forbidden` [DUPLEX / CHAT, vocab] its rule sets' masks, `window` the repetition window,
    `top_k` the largest k its fixed top-k serves; `build`: `build_decoder`'s settings (the pool's sessions at
    least the batch's rows: `rows` past 256 where the memory holds them)."""
    build.setdefault("max_sessions", max(256, rows))
    model = build_decoder(lambda: DuplexLLM(dims), weights, dims, **build)  # type: ignore[arg-type]
    rows = min(rows, model.pool.trash_seq)
    head = LlmHead(model, tokens, forbidden, rows, model.pool.writes, window, top_k=top_k)
    return core_over(head, rows, overlap, graphs)


def tts_core(weights: dict[str, torch.Tensor], tts: TtsDims, rules: TtsRules, *, rows: int = BATCH_ROWS,
             overlap: bool = True, graphs: bool | None = None, **build: object) -> EngineCore:
    """The TTS's core over its rules' settings; `build`: `build_decoder`'s settings."""
    build.setdefault("max_sessions", max(256, rows))
    llm_hidden = weights["projector_semantic.linear1.weight"].shape[1]
    model = build_decoder(lambda: DuplexTTS(tts, llm_hidden), weights, tts.decoder, **build)  # type: ignore[arg-type]
    rows = min(rows, model.pool.trash_seq)
    return core_over(TtsHead(model, tts, rules, rows, model.pool.writes), rows, overlap, graphs)


WEIGHTS_FILE = "weights.safetensors"  # written by the export beside a device stage's model.onnx (llm, tts, audio)


def load_weights(folder: Path, device: str) -> dict[str, torch.Tensor]:
    """The exported weights of a device stage (`folder`/weights.safetensors), on `device`."""
    from safetensors.torch import load_file

    path = Path(folder) / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m export` first")
    return load_file(str(path), device=device)

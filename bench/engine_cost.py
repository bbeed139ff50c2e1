"""Decode cost at the real LLM's width on the CPU: today's path against the paged engine, 200 vs 3000 tokens of history.

The LLM at MiniCPM-o 4.5's hidden size, heads, KV heads and MLP width (Qwen3-8B) with 2 layers and random
weights; the vocabulary cut to 32000 to fit this machine's memory (the lm_head costs both paths the same, at any
history). Per decode token, for one session and for a batch of four:
- before: the exported graph's module (`export/modules/llm.py`, what the ONNX graph is) fed the session's
  whole cache and returning the grown one (`present = cat(past, new)`), through `KvBatch`, as the stage runs it;
- after: the paged engine (KV in its pool, written in place, the token chosen by the device sampler).
Bytes host<->device per token are counted the same way for both (paged/traffic.py). One run, both paths.

    python -m bench.engine_cost
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch

from export.modules.llm import DuplexLLM
from export.presets import tiny
from export.torch_engine import TorchEngine
from minicpmo_triton.kv_batch import KvBatch, KvCache
from minicpmo_triton.model_config import DecoderDims
from minicpmo_triton.paged.engine import PagedLlmEngine
from minicpmo_triton.paged.protocol import DUPLEX, Prefill, RowPick
from minicpmo_triton.paged.traffic import CountingEngine, Traffic
from minicpmo_triton.sampling import SamplingParams

from .gpu_check import REAL

WIDTH = dataclasses.replace(REAL, layers=2, vocab=32_000)
OUTPUTS = ["logits", "hidden", "present_key", "present_value"]


def today(module: DuplexLLM, d: DecoderDims, history: int, batch: int, tokens: int) -> tuple[float, float]:
    """ms and bytes per decode token: the cache in, the grown cache out, every token."""
    traffic = Traffic()
    engine = CountingEngine(TorchEngine(module, OUTPUTS), traffic)
    rng = np.random.default_rng(0)
    caches = [KvCache(rng.standard_normal((d.layers, d.kv_heads, history, d.head_dim), np.float32),
                      rng.standard_normal((d.layers, d.kv_heads, history, d.head_dim), np.float32))
              for _ in range(batch)]
    kv = KvBatch(caches)
    ones = np.ones(batch, np.int64)
    t0 = time.perf_counter()
    for _ in range(tokens):
        out = engine.run({"input_ids": rng.integers(0, d.vocab, (batch, 1)), "embeds": np.zeros((batch, 1, d.hidden),
                          np.float32), "use_embeds": np.zeros((batch, 1), bool), **kv.feeds(ones)})
        kv.advance(out["present_key"], out["present_value"], ones)
        [int(np.argmax(row)) for row in out["logits"]]  # the host picks from the logits it was sent
    return (time.perf_counter() - t0) * 1000 / tokens, traffic.total() / tokens / batch


def paged(weights: dict[str, torch.Tensor], d: DecoderDims, history: int, batch: int,
          tokens: int) -> tuple[float, float]:
    eng = PagedLlmEngine.build(weights, d, pool_tokens=batch * (history + tokens + 32), attention="gather")
    tk = tiny().tokens
    eng.use_rules(np.zeros((2, d.vocab), bool), tk)
    for layer in range(d.layers):
        eng.pool.key[layer].normal_()
        eng.pool.value[layer].normal_()
    seqs = [eng.pool.open(history + tokens) for _ in range(batch)]
    rng = np.random.default_rng(0)
    picks = [RowPick(DUPLEX, SamplingParams(temperature=0.0), history=rng.integers(0, d.vocab, 512).tolist())
             for _ in range(batch)]
    assert eng.sampler is not None
    eng.traffic.reset()
    t0 = time.perf_counter()
    for step in range(tokens):
        rows = [Prefill(rng.integers(0, d.vocab, 1), np.zeros((0, d.hidden), np.float32), np.zeros(1, bool))
                for _ in range(batch)]
        out = eng.forward(seqs, [history + step] * batch, rows)
        eng.sampler.pick(out.logits, picks)
    return (time.perf_counter() - t0) * 1000 / tokens, eng.traffic.total() / tokens / batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8, help="decode tokens per measurement")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    d = WIDTH
    torch.manual_seed(0)
    module = DuplexLLM(d).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    weights = module.state_dict()
    print(f"LLM width {d.hidden}, {d.heads} heads / {d.kv_heads} KV x {d.head_dim}, MLP {d.intermediate}, "
          f"{d.layers} layers, vocab {d.vocab}; CPU, {args.threads} threads, fp32; {args.tokens} tokens each")
    print(f"{'history':>8} {'batch':>6} {'before ms/tok':>14} {'after ms/tok':>13} {'ratio':>6} "
          f"{'before KiB/tok/sess':>20} {'after KiB/tok/sess':>19}")
    with torch.inference_mode():
        for batch in (1, 4):
            for history in (200, 3000):
                b_ms, b_bytes = today(module, d, history, batch, args.tokens)
                a_ms, a_bytes = paged(weights, d, history, batch, args.tokens)
                print(f"{history:>8} {batch:>6} {b_ms:>14.1f} {a_ms:>13.1f} {b_ms / a_ms:>6.2f} "
                      f"{b_bytes / 1024:>20,.0f} {a_bytes / 1024:>19,.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

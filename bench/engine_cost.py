"""Decode cost at the real LLM's width on the CPU: the host-cache path against the engine core, 200 vs 3000 tokens of
history.

The LLM at MiniCPM-o 4.5's hidden size, heads, KV heads and MLP width (Qwen3-8B) with 2 layers and random
weights; the vocabulary cut to 32000 to fit this machine's memory (the lm_head costs both paths the same, at any
history). Per decode token, for one session and for a batch of four:
- before: the exported graph's module (`DuplexLLM.forward`, what the ONNX graph is) fed the session's
  whole cache and returning the grown one (`present = cat(past, new)`), through `KvBatch`, as the stage runs it;
- after: the engine core (KV in its pool, written in place, the token chosen by the device's rules, the next
  iteration launched before this one's token is read).
Bytes host<->device per token are counted the same way for both (engine/traffic.py). One run, both paths.

    python -m bench.engine_cost
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch

from export.presets import tiny
from export.torch_engine import TorchEngine
from minicpmo_triton.engine.build import llm_core
from minicpmo_triton.engine.kv_batch import KvBatch, KvCache
from minicpmo_triton.engine.model import DuplexLLM
from minicpmo_triton.engine.protocol import DUPLEX, LlmRow, Prefill
from minicpmo_triton.engine.request import Request
from minicpmo_triton.engine.traffic import CountingEngine, Traffic
from minicpmo_triton.model_config import DecoderDims

from .gpu_check import REAL
from .scripted import Scripted

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


class Tokens(Scripted):
    """A row's rules: greedy duplex over a 512-token window, `n` tokens, each fed (the host reads each)."""

    def __init__(self, n: int, history: list[int]) -> None:
        self.n, self.seen = n, 0
        self.row = LlmRow(DUPLEX, 0.0, 20, 0.8, 1.05, 1.0, n + 2, history, [], True, np.zeros(0))

    n_hidden = 0

    def confirm(self, token: int, flags: int) -> bool:
        self.seen += 1
        return self.seen < self.n


def paged(weights: dict[str, torch.Tensor], d: DecoderDims, history: int, batch: int,
          tokens: int) -> tuple[float, float]:
    core = llm_core(weights, d, tiny().tokens, np.zeros((2, d.vocab), bool), attention="gather", rows=batch,
                    pool_tokens=batch * (history + tokens + 32))
    pool = core.pool
    for layer in range(d.layers):
        pool.key[layer].normal_()
        pool.value[layer].normal_()
    rng = np.random.default_rng(0)
    for r in range(batch):
        core.add(Request(r, pool.open(history + tokens + 2), history,
                         Prefill(rng.integers(0, d.vocab, 1), np.zeros((0, d.hidden), np.float32), np.zeros(1, bool)),
                         Tokens(tokens + 1, rng.integers(0, d.vocab, 512).tolist())))
    core.step()  # the one-token prefill (its row chooses its first token)
    pool.traffic.reset()
    t0 = time.perf_counter()
    for _ in range(tokens):
        core.step()
    return (time.perf_counter() - t0) * 1000 / tokens, pool.traffic.total() / tokens / batch


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

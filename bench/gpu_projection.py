"""A PROJECTION, not a measurement: how many duplex sessions one H200 serves in the 1 s period, from counted work.

128..512 simulated sessions, each 60 s into its call (780 tokens of history), 30% of them speaking, go through the
paged engine's own loop (`PagedLlmEngine.run`: the packed prefill of every session's chunk, then one batched
decode forward per token until the last row is done, the KV pool reserving and handing out blocks) with a
shape-only model at the LLM's real dims (MiniCPM-o 4.5: Qwen3-8B, bf16): no math, every forward bills its FLOPs,
the weight bytes it reads (once per forward, whatever the batch), the KV bytes it reads and writes
(`paged/traffic.py` `Work`), and the bytes that cross host<->device (`Traffic`). Listeners decide one token
(<|listen|>); speakers decide 20 (a chunk's budget), the TTS taking each fed token's hidden row.

Counts become H200 time with a roofline per forward: max(FLOPs / compute, bytes / bandwidth), at NVIDIA's
published peaks (HBM3e 4.8 TB/s; bf16 dense 989 TFLOP/s) derated to what kernels commonly reach (75% of the
bandwidth, 50% of the FLOPs), plus a launch overhead per forward (10 kernels a layer, 4 us each, no CUDA graphs)
and host<->device bytes at 50 GB/s (PCIe Gen5 x16, pinned). The LLM stage only: the encoders, the TTS and
token2wav run beside it on the same GPU (not counted here).

    python -m bench.gpu_projection
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch

from export.memory import pool_bytes
from export.presets import minicpmo45
from minicpmo_triton.model_config import DecoderDims, SpecialTokens
from minicpmo_triton.paged.attention import Rows
from minicpmo_triton.paged.engine import Forward, PagedLlmEngine
from minicpmo_triton.paged.pool import KvPool, PoolShape
from minicpmo_triton.paged.protocol import DUPLEX, Picked, Prefill, RowPick
from minicpmo_triton.paged.traffic import Traffic, Work, layer_weight_count
from minicpmo_triton.sampling import SamplingParams

PEAK_BW = 4.8e12  # bytes/s, H200 HBM3e (published)
PEAK_FLOPS = 989e12  # bf16 dense, H200 SXM (published)
BW_EFF, FLOPS_EFF = 0.75, 0.5
LAUNCH_S = 10 * 4e-6  # per layer per forward
PCIE = 50e9
HBM_GIB = 141
HISTORY = 780  # 60 s listening: <unit>, 10 audio tokens, <|listen|>, </unit> a second
CHUNK = 12  # </unit> of the last chunk's terminator pair, <unit>, 10 audio placeholders
SPEAK_TOKENS = 20
SPEAKING = 0.3
BF16 = 2


@dataclass
class Bill:
    flops: float
    bytes: float


class ShapeOnlyDecoder:
    """The paged decoder's interface, no math: each forward bills its work from the shapes (`Work`)."""

    def __init__(self, dims: DecoderDims, pool: KvPool) -> None:
        self.d, self.pool, self.device = dims, pool, pool.device
        self.work = Work()
        self.bills: list[Bill] = []
        self.layer_bytes = layer_weight_count(dims) * BF16
        self.head_bytes = dims.vocab * dims.hidden * BF16

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.empty((ids.shape[0], self.d.hidden), device=self.device, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rows: Rows) -> torch.Tensor:
        before = (self.work.flops, self.work.weight_bytes + self.work.kv_read + self.work.kv_written)
        self.work.count_forward(self.d, rows, self.layer_bytes, self.pool.shape.token_bytes(self.pool.dtype))
        self.work.count_head(self.d, len(rows.count), self.head_bytes)
        after = (self.work.flops, self.work.weight_bytes + self.work.kv_read + self.work.kv_written)
        # the device sampler reads each row's logits a few times (masks, penalties, top-k, sort): fp32, ~6 passes
        self.bills.append(Bill(after[0] - before[0], after[1] - before[1] + 6 * 4 * len(rows.count) * self.d.vocab))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.empty((hidden.shape[0], 0), device=self.device)


class ShapeOnlyEngine(PagedLlmEngine):
    def hidden_rows(self, out: Forward, positions: list[int]) -> np.ndarray:
        self.traffic.to_host["outputs"] += len(positions) * self.model.d.hidden * 4
        return np.zeros((len(positions), self.model.d.hidden), np.float32)


class ScriptedSampler:
    """Every row's token is its script's (RowPick.forced); the token ids and flags cross as the real ones do."""

    def __init__(self, traffic: Traffic) -> None:
        self.traffic = traffic

    def pick(self, logits: torch.Tensor, picks: list[RowPick]) -> Picked:
        self.traffic.to_host["outputs"] += 3 * 8 * len(picks)
        self.traffic.to_device["inputs"] += sum(8 * len(p.history) + 8 * 12 for p in picks)  # window + settings
        return Picked(np.array([p.forced for p in picks], np.int64), np.ones(len(picks), bool))


class ScriptedRows:
    """Listeners decide <|listen|> at once; speakers decide SPEAK_TOKENS tokens, the TTS taking each fed one's
    hidden row (from the second on)."""

    def __init__(self, speaking: list[bool], tokens: SpecialTokens) -> None:
        self.speaking, self.tokens = speaking, tokens
        self.decided = [0] * len(speaking)
        self.hidden = [0] * len(speaking)

    def wants_hidden(self, row: int) -> bool:
        return self.speaking[row] and self.hidden[row] < self.decided[row] - 1

    def add_hidden(self, row: int, hidden: np.ndarray) -> None:
        self.hidden[row] += 1

    def pick(self, row: int) -> RowPick | None:
        if self.decided[row] >= (SPEAK_TOKENS if self.speaking[row] else 1):
            return None
        last = self.decided[row] == (SPEAK_TOKENS if self.speaking[row] else 1) - 1
        token = (self.tokens.chunk_eos if self.speaking[row] else self.tokens.listen) if last else 1000
        return RowPick(DUPLEX, SamplingParams(), forced=token, history=[0] * 512)

    def accept(self, row: int, token: int, drew_second: bool) -> int | None:
        self.decided[row] += 1
        return None if token in (self.tokens.listen, self.tokens.chunk_eos) else token


def step_seconds(bills: list[Bill], layers: int, host_bytes: float, derated: bool) -> float:
    bw, flops = PEAK_BW * (BW_EFF if derated else 1), PEAK_FLOPS * (FLOPS_EFF if derated else 1)
    launch = LAUNCH_S * layers if derated else 0.0
    return sum(max(b.flops / flops, b.bytes / bw) + launch for b in bills) + host_bytes / PCIE


def simulate(d: DecoderDims, tokens: SpecialTokens, sessions: int, steps: int) -> dict[str, float]:
    shape = PoolShape(d.layers, d.kv_heads, d.head_dim, 128)
    traffic = Traffic()
    need = sessions * (HISTORY + steps * (CHUNK + SPEAK_TOKENS) + 256)
    pool = KvPool(shape, shape.blocks_for(need), torch.bfloat16, "meta", sessions, 8192, traffic)
    model = ShapeOnlyDecoder(d, pool)
    engine = ShapeOnlyEngine(model, traffic)  # type: ignore[arg-type]
    engine.sampler = ScriptedSampler(traffic)  # type: ignore[assignment]
    seqs = [pool.open(HISTORY + CHUNK + SPEAK_TOKENS) for _ in range(sessions)]
    lengths = [HISTORY] * sessions
    speaking = [i < round(sessions * SPEAKING) for i in range(sessions)]
    per_step = []
    for _ in range(steps):
        model.bills.clear()
        traffic.reset()
        prefill = [Prefill(np.full(CHUNK, 1, np.int64), np.zeros((10, d.hidden), np.float32),
                           np.arange(CHUNK) >= 2) for _ in range(sessions)]
        lengths, _ = engine.run(seqs, lengths, prefill, ScriptedRows(speaking, tokens))
        per_step.append((list(model.bills), traffic.total()))
    bills, host = per_step[-1]
    return {"sessions": sessions, "forwards": len(bills), "tflop": sum(b.flops for b in bills) / 1e12,
            "gb_read_written": sum(b.bytes for b in bills) / 1e9, "host_mb": host / 1e6,
            "peak_ms": step_seconds(bills, d.layers, host, False) * 1000,
            "derated_ms": step_seconds(bills, d.layers, host, True) * 1000,
            "pool_gib_60s": pool_bytes(minicpmo45(), sessions, 60, BF16) / 2**30,
            # the streaming Whisper's pool beside it (same GPU, same llm model): its bound, 30 s of frames each
            "whisper_gib": pool_bytes(minicpmo45(), sessions, 60, BF16, "audio_encoder") / 2**30}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[128, 192, 256, 384, 512])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    preset = minicpmo45()
    d = preset.llm
    weights_gib = (layer_weight_count(d) + 2 * d.vocab * d.hidden) * BF16 / 2**30
    print("PROJECTION from counted work (not a measurement): LLM stage, H200, bf16, "
          f"{HISTORY} tokens of history (60 s), {SPEAKING:.0%} speaking {SPEAK_TOKENS} tokens, the rest listening")
    print(f"peaks: {PEAK_BW / 1e12} TB/s, {PEAK_FLOPS / 1e12:.0f} TFLOP/s bf16 dense (published); derated: "
          f"{BW_EFF:.0%} / {FLOPS_EFF:.0%}, {LAUNCH_S * d.layers * 1e3:.2f} ms launches per forward; "
          f"weights {weights_gib:.1f} GiB")
    print(f"{'sessions':>8} {'forwards':>8} {'TFLOP':>7} {'GB r/w':>7} {'host MB':>8} {'peak ms':>8} "
          f"{'derated ms':>10} {'KV GiB':>7} {'+Whisper':>8} {'fits 1 s':>8}")
    fitting = 0
    for n in args.sessions:
        r = simulate(d, preset.tokens, n, args.steps)
        fits = r["derated_ms"] <= 1000 and r["pool_gib_60s"] + r["whisper_gib"] + weights_gib < HBM_GIB * 0.9
        fitting = max(fitting, n if fits else 0)
        print(f"{n:>8} {r['forwards']:>8.0f} {r['tflop']:>7.1f} {r['gb_read_written']:>7.1f} {r['host_mb']:>8.2f} "
              f"{r['peak_ms']:>8.0f} {r['derated_ms']:>10.0f} {r['pool_gib_60s']:>7.1f} {r['whisper_gib']:>8.1f} "
              f"{'yes' if fits else 'no':>8}",
              flush=True)
    print(f"projected: {fitting} sessions fit the 1 s period (derated, LLM stage alone; its KV and the Whisper's "
          "within 90% of HBM)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

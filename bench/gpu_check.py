"""The paged engines on a GPU, with no checkpoint: random weights at MiniCPM-o 4.5's dims (the LLM: Qwen3-8B).

1. parity: the CUDA backend (flex_attention over the pool) against the reference gather, same weights, same
   pool, same inputs (2 layers at real width): logits' max difference and greedy agreement, prefill and decode,
   eager layers and compiled ones (each against the eager gather; decode's flex at static padded shapes);
2. speed: all 36 layers, 32 / 64 / 128 sessions each holding 60 s of history in the pool: ms per decode
   iteration (every session one token, sampling and the duplex rules on the device included; forward and sampler
   timed apart) and per packed chunk prefill (12 tokens each), and a 1 s step estimated from them (every
   session's prefill, one decode iteration for all, then 30% speaking for the rest of a 20-token chunk); each
   size as it was (eager layers, flex compiled dynamic) and as it is (compiled layers, decode's flex static at
   padded shapes: inductor's decoding kernel), so the before and after are one run;
   profile: torch.profiler's top ops of one decode iteration at the first size, eager and compiled
   (OUT/profile_*.txt);
3. memory: the pool's bytes, the weights', the peak allocated;
4. tts, whisper: the paged TTS and the paged streaming Whisper (bench/gpu_check_speech.py): parity, ms per TTS
   decode iteration and chunk, per Whisper 1 s chunk, at 32 / 64 / 128 sessions, pool GiB; within
   `--speech-budget-s` together;
5. token2wav: its device path (bench/gpu_check_token2wav.py): the waveform against the CPU's, ms per iteration at
   8 / 32 / 64 / 128 speaking sessions, memory per slot; its sizes within `--speech-budget-s` of its parity.
Each stage's results go to OUT/gpu_check.json as it ends (a stage that fails records its error, and so does one
size of a stage), a table to stdout; `--stages` runs a subset. `--device cpu --quick` runs the same code at
small dims to test the script.

    python -m bench.gpu_check --out gpu_out            (scripts/gpu_check.sh runs this)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.presets import minicpmo45, tiny
from minicpmo_triton.model_config import DecoderDims
from minicpmo_triton.paged.attention import FlexAttention, GatherAttention
from minicpmo_triton.paged.engine import PagedLlmEngine
from minicpmo_triton.paged.protocol import CHAT, DUPLEX, Prefill, RowPick
from minicpmo_triton.sampling import SamplingParams

from .gpu_check_speech import CONDITION, tts_stage, whisper_stage
from .gpu_check_token2wav import token2wav_stage
from .gpu_timing import peak_gib, sync, timed

# Qwen3-8B as MiniCPM-o 4.5 configures it (export/presets.py MINICPMO45_CONFIG)
REAL = DecoderDims(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151748)
QUICK = DecoderDims(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=2000)
HISTORY_60S = 13 * 60  # tokens a listening session holds after 60 s (<unit>, 10 audio, <|listen|>, </unit> a second)
CHUNK_TOKENS = 12
SPEAK_TOKENS = 20  # max_new_speak_tokens_per_chunk
SPEAKING = 0.3
TTS_CHUNK = CONDITION + 26  # a TTS chunk's positions: its condition, then 26 codes
TTS_HISTORY = 8 * TTS_CHUNK  # a speaking session 8 chunks into its turn
WHISPER_HISTORY_S = 10.0  # seconds of encoder frames each listening session holds
STAGES = ("parity", "speed", "tts", "whisper", "token2wav")


def random_weights(d: DecoderDims, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    out = {"model.embed_tokens.weight": w(d.vocab, d.hidden), "lm_head.weight": w(d.vocab, d.hidden),
           "model.norm.weight": torch.ones(d.hidden, device=device, dtype=dtype)}
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": torch.ones(d.hidden, device=device, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(d.hidden, device=device, dtype=dtype),
                p + "self_attn.q_norm.weight": torch.ones(d.head_dim, device=device, dtype=dtype),
                p + "self_attn.k_norm.weight": torch.ones(d.head_dim, device=device, dtype=dtype),
                p + "self_attn.q_proj.weight": w(d.heads * d.head_dim, d.hidden),
                p + "self_attn.k_proj.weight": w(d.kv_heads * d.head_dim, d.hidden),
                p + "self_attn.v_proj.weight": w(d.kv_heads * d.head_dim, d.hidden),
                p + "self_attn.o_proj.weight": w(d.hidden, d.heads * d.head_dim),
                p + "mlp.gate_proj.weight": w(d.intermediate, d.hidden),
                p + "mlp.up_proj.weight": w(d.intermediate, d.hidden),
                p + "mlp.down_proj.weight": w(d.hidden, d.intermediate)}
    return out


def build(d: DecoderDims, weights: dict[str, torch.Tensor], device: str, sessions: int, history: int,
          attention: str, compiled: bool = False) -> PagedLlmEngine:
    eng = PagedLlmEngine.build(weights, d, device=device, pool_tokens=sessions * (history + 2 * 128 + CHUNK_TOKENS),
                               attention=attention, max_sessions=max(sessions, 1), max_tokens=8192,
                               compile_layers=compiled)
    tokens = (minicpmo45() if d.vocab == REAL.vocab else tiny()).tokens  # the sampler reads <|chunk_eos|> etc.
    forbidden = np.zeros((2, d.vocab), bool)
    forbidden[:, tokens.tts_pad] = True
    eng.use_rules(forbidden, tokens)
    return eng


def chunk_rows(d: DecoderDims, n: int, tokens: int, rng: np.random.Generator) -> list[Prefill]:
    return [Prefill(rng.integers(0, d.vocab, tokens), np.zeros((0, d.hidden), np.float32), np.zeros(tokens, bool))
            for _ in range(n)]


def picks(n: int, rng: np.random.Generator) -> list[RowPick]:
    """Duplex rows, greedy and sampled (the defaults: 0.7, top-k 20, top-p 0.8, a 512-token repetition window,
    length penalty 1.1), and every eighth a chat row."""
    out = []
    for r in range(n):
        params = SamplingParams(temperature=0.0) if r % 2 else SamplingParams()
        out.append(RowPick(CHAT if r % 8 == 7 else DUPLEX, params, history=rng.integers(0, 1000, 512).tolist(),
                           length_penalty=1.1, u=(float(rng.random()), float(rng.random()))))
    return out


def parity(d: DecoderDims, device: str, sessions: int, history: int) -> dict[str, Any]:
    """One engine, its attention swapped: the same forwards (rewriting the same keys in the same slots)."""
    d2 = dataclasses.replace(d, layers=2)
    weights = random_weights(d2, device)
    eng = build(d2, weights, device, sessions, history, "flex")  # flex's pool blocks: 128 tokens
    rng = np.random.default_rng(0)
    lens = rng.integers(1, history, sessions).tolist()
    seqs = [eng.pool.open(1) for _ in range(sessions)]
    rows = [Prefill(rng.integers(0, d2.vocab, n), np.zeros((0, d2.hidden), np.float32), np.zeros(n, bool))
            for n in lens]
    gather, flex = GatherAttention(), FlexAttention(compiled=device == "cuda")
    out: dict[str, Any] = {"sessions": sessions, "layers": 2, "dtype": str(eng.model.dtype)}
    for name, pasts, batch in (("prefill", [0] * sessions, rows),
                               ("decode", lens, chunk_rows(d2, sessions, 1, rng))):
        logits = {}
        for key, backend, compiled in (("gather", gather, False), ("flex", flex, False),
                                       ("flex_compiled", flex, True), ("gather_compiled", gather, True)):
            eng.model.attention = backend
            eng.model.use_compiled(compiled)
            logits[key] = eng.forward(seqs, pasts, batch).logits.float()
        ref = logits.pop("gather")
        scale = ref.abs().max().item()
        out[name] = {key: {"max_abs_diff": (got - ref).abs().max().item(), "max_abs_logit": scale,
                           "greedy_agreement": (got.argmax(1) == ref.argmax(1)).float().mean().item()}
                     for key, got in logits.items()}
    return out


def measure(d: DecoderDims, weights: dict[str, torch.Tensor], device: str, n: int, history: int,
            repeats: int, attention: str = "auto", compiled: bool = False, profile: Path | None = None
            ) -> dict[str, Any]:
    """`n` sessions `history` tokens in: a decode iteration of all, of the 30% speaking, a chunk prefill of all."""
    eng = build(d, weights, device, n, history, attention, compiled)
    if not compiled and eng.model.attention.name == "flex":  # the engine as it was: flex dynamic for decode too
        eng.model.attention = FlexAttention(compiled=device == "cuda", static_decode=False)
    for layer in range(d.layers):  # any history will do: the work is the same whatever the values
        eng.pool.key[layer].normal_()
        eng.pool.value[layer].normal_()
    seqs = [eng.pool.open(history + CHUNK_TOKENS + 1) for _ in range(n)]
    rng = np.random.default_rng(n)
    pasts = [history] * n
    step_rows, prefill_rows = chunk_rows(d, n, 1, rng), chunk_rows(d, n, CHUNK_TOKENS, rng)
    row_picks = picks(n, rng)
    speakers = max(1, int(n * SPEAKING))
    sampler = eng.sampler
    assert sampler is not None

    def decode(k: int) -> tuple[float, float]:
        """ms of the forward (logits included) and of the sampler, the device synchronised between."""
        sync(device)
        t0 = time.perf_counter()
        logits = eng.forward(seqs[:k], pasts[:k], step_rows[:k]).logits
        sync(device)
        t1 = time.perf_counter()
        sampler.pick(logits, row_picks[:k])  # ends in a download: synchronised
        return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000

    def split(k: int) -> tuple[float, float]:
        for _ in range(2):  # warm-ups: the first compiles
            decode(k)
        runs = [decode(k) for _ in range(repeats)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    forward_ms, sampler_ms = split(n)
    speak_forward_ms, speak_sampler_ms = split(speakers)
    prefill_ms = timed(device, lambda: eng.forward(seqs, pasts, prefill_rows), repeats)
    if profile is not None:
        write_profile(profile, lambda: decode(n))
        write_profile(profile.with_name(profile.stem + "_30pct.txt"), lambda: decode(speakers))
    decode_ms, speak_ms = forward_ms + sampler_ms, speak_forward_ms + speak_sampler_ms
    return {"sessions": n, "history": history, "attention": eng.model.attention.name, "compiled": eng.model.compiled,
            "attention_fallbacks": getattr(eng.model.attention, "fallbacks", []),
            "decode_iteration_ms": decode_ms, "decode_forward_ms": forward_ms, "decode_sampler_ms": sampler_ms,
            "decode_iteration_30pct_ms": speak_ms, "decode_30pct_forward_ms": speak_forward_ms,
            "decode_30pct_sampler_ms": speak_sampler_ms, "chunk_prefill_ms": prefill_ms,
            "step_estimate_ms": prefill_ms + decode_ms + (SPEAK_TOKENS - 1) * speak_ms,
            "pool_gib": eng.pool.nbytes / 2**30, "pool_blocks": eng.pool.num_blocks,
            "block_size": eng.pool.shape.block_size,
            "peak_allocated_gib": peak_gib(device)}


def write_profile(path: Path, fn: Any) -> None:
    """torch.profiler's ops of one call, by host time and by device time: where a decode iteration goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
    table = prof.key_averages()
    text = table.table(sort_by="cpu_time_total", row_limit=30)
    if torch.cuda.is_available():
        text += "\n" + table.table(sort_by="cuda_time_total", row_limit=20)
    path.write_text(text)


def speed(d: DecoderDims, device: str, counts: list[int], history: int, repeats: int,
          deadline: float, out: Path) -> list[dict[str, Any]]:
    weights = random_weights(d, device)
    weights_gib = sum(t.numel() * t.element_size() for t in weights.values()) / 2**30
    results: list[dict[str, Any]] = []
    for n, compiled in [(n, c) for n in counts for c in (False, True)]:
        if time.monotonic() > deadline:
            results.append({"sessions": n, "compiled": compiled, "skipped": "out of time"})
            continue
        profile = out / f"profile_{'compiled' if compiled else 'eager'}.txt" if n == counts[0] else None
        try:
            results.append({**measure(d, weights, device, n, history, repeats, compiled=compiled, profile=profile),
                            "weights_gib": weights_gib})
        except Exception as exc:  # noqa: BLE001 (one size failing, out of memory say, leaves the others)
            error = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"sessions {n}: {error}; again with the gather backend", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
            try:
                results.append({**measure(d, weights, device, n, history, repeats, "gather", compiled),
                                "weights_gib": weights_gib, "flex_error": error})
            except Exception as again:  # noqa: BLE001
                results.append({"sessions": n, "compiled": compiled, "error": error,
                                "gather_error": f"{type(again).__name__}: {again}"})
        print(json.dumps(results[-1]), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_out"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small dims, 2 and 4 sessions (tests the script)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="the LLM's speed stage starts no new size past this (from the start)")
    parser.add_argument("--speech-budget-s", type=float, default=90.0,
                        help="the TTS and Whisper stages together start no new size past this (from their start)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    args = parser.parse_args(argv)
    chosen = args.stages.split(",")
    if unknown := set(chosen) - set(STAGES):
        parser.error(f"unknown stages {sorted(unknown)}: choose from {', '.join(STAGES)}")
    deadline = time.monotonic() + args.budget_s
    speech: dict[str, float] = {}

    def speech_deadline() -> float:  # set when the first of the two stages starts
        return speech.setdefault("deadline", time.monotonic() + args.speech_budget_s)

    args.out.mkdir(parents=True, exist_ok=True)
    d = QUICK if args.quick else REAL
    counts = [2, 4] if args.quick else [32, 64, 128]
    history = 50 if args.quick else HISTORY_60S
    preset = tiny() if args.quick else minicpmo45()
    repeats = 3 if args.quick else 20
    tts_history = 2 * TTS_CHUNK if args.quick else TTS_HISTORY
    whisper_history = 2.0 if args.quick else WHISPER_HISTORY_S
    report: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "dims": dataclasses.asdict(d),
                              "speech_preset": preset.name,
                              "note": "random weights; speed of the engines, not of a served model"}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
        # each size's pool is a new static shape for the decode graphs (a server has one pool): room for them all
        torch._dynamo.config.recompile_limit = 64
    path = args.out / "gpu_check.json"
    stages = {"parity": lambda: parity(d, args.device, 8, history),
              "speed": lambda: speed(d, args.device, counts, history, repeats, deadline, args.out),
              "tts": lambda: tts_stage(preset, args.device, counts, tts_history, repeats, speech_deadline()),
              "whisper": lambda: whisper_stage(preset, args.device, counts, whisper_history, repeats,
                                               speech_deadline()),
              "token2wav": lambda: token2wav_stage(preset, args.device, [2, 4] if args.quick else [8, 32, 64, 128],
                                                   repeats, args.speech_budget_s)}
    failed = False
    for name in chosen:
        run = stages[name]
        t0 = time.perf_counter()
        try:
            report[name] = run()
        except Exception as exc:  # noqa: BLE001 (a stage that breaks is recorded; the next one still runs)
            failed = True
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        report[f"{name}_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(report, indent=1))
        print(f"== {name} ({report[f'{name}_s']:.0f} s)\n{json.dumps(report[name], indent=1)[:3000]}", flush=True)
    print(f"results: {path}")
    return 1 if failed or errors(report) else 0


def errors(report: Any) -> list[str]:
    """Every "error" in the report, a stage's or one size's (a size that failed leaves the others measured)."""
    if isinstance(report, dict):
        return ([str(report["error"])] if "error" in report else []) + [
            e for k, v in report.items() if k != "error" for e in errors(v)]
    if isinstance(report, list):
        return [e for v in report for e in errors(v)]
    return []


if __name__ == "__main__":
    raise SystemExit(main())

"""The device engine core on a GPU, with no checkpoint: random weights at MiniCPM-o 4.5's dims (the LLM: Qwen3-8B),
each row's rules scripted (bench/scripted.py: the device runs its full rules every iteration).

1. parity (FAILS the run past its thresholds): the CUDA graphs of the decode step against the same step run eagerly
   (the same tokens, every row, 12 iterations; 2 layers at real width); flex over the pool against the reference
   gather (logits of a varlen prefill and of a static decode batch: max difference within 5% of the logits' range,
   greedy agreement >= 0.99); the host's waits per decode iteration on the GPU (the sync ledger: at most 1);
2. speed: all 36 layers, 32 / 64 / 128 / 256 rows each 60 s into its call: wall ms per LLM decode iteration with
   the graphs (the core's `step`: host work, launch, the previous iteration's tokens read) and without (eager);
   the same for the TTS's iteration (its real dims, rows 8 chunks into their turn);
3. step: the whole duplex step, as the engine would serve it on one GPU: N sessions (32 / 64 / 128 / 256) sending
   their seconds at staggered offsets, 30% speaking, for `--step-seconds`; a loop that runs, each iteration, the
   streaming Whisper over the arrived seconds (its pool, 10 s of history), the LLM core (their prefills beside the
   decoding rows), the TTS core (the spoken chunks' conditions beside the decoding codes) and token2wav's three
   graphs over the chunks whose codes are whole; the p50 / p95 of a speaking step (its arrival to its audio's end);
4. tts, whisper (bench/gpu_check_speech.py): their parity (flex vs gather; the Whisper's fixed-shape chunk vs its
   varlen forward and its CUDA graphs vs eager) and ms per iteration / chunk (the Whisper's at 8 / 32 / 128 rows,
   with its graphs and without);
5. memory: each stage's pool and the peak allocated.
6. token2wav: its device path (bench/gpu_check_token2wav.py): the waveform against the CPU's, ms per iteration at
   8 / 32 / 64 / 128 speaking sessions, memory per slot; its sizes within `--speech-budget-s` of its parity.
Each stage's results go to OUT/gpu_check.json as it ends (a stage that fails records its error, and so does one
size); a table to stdout; `--stages` runs a subset. `--device cpu --quick` runs the same code at small dims (no
graphs on the CPU) to test the script.

    python -m bench.gpu_check --out gpu_out            (scripts/gpu_check.sh runs this)
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from export.presets import minicpmo45, tiny
from minicpmo_triton.engine.attention import GatherAttention
from minicpmo_triton.engine.build import llm_core, tts_core
from minicpmo_triton.engine.core import EngineCore
from minicpmo_triton.engine.protocol import Prefill, TtsFeed
from minicpmo_triton.engine.request import Request
from minicpmo_triton.engine.syncs import SyncLedger
from minicpmo_triton.model_config import DecoderDims, PresetConfig
from minicpmo_triton.stages.tts import tts_rules

from .gpu_check_speech import (
    CONDITION,
    ROUNDING,
    WHISPER_COUNTS,
    chunk_mel,
    encoder_frames,
    random_state,
    tts_stage,
    whisper,
    whisper_stage,
)
from .gpu_check_token2wav import token2wav_stage
from .gpu_timing import iteration_ms, peak_gib, sync
from .scripted import SpokenChunk, SpokenCodes

# Qwen3-8B as MiniCPM-o 4.5 configures it (export/presets.py MINICPMO45_CONFIG)
REAL = DecoderDims(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151748)
QUICK = tiny().llm  # the quick run's LLM: tiny's, as its speech stages' (the Whisper's embeddings are its width)
HISTORY_60S = 13 * 60  # tokens a listening session holds after 60 s (<unit>, 10 audio, <|listen|>, </unit> a second)
CHUNK_TOKENS = 12
SPEAK_TOKENS = 20  # max_new_speak_tokens_per_chunk
SPEAKING = 0.3
TTS_CODES = 25
TTS_HISTORY = 8 * (CONDITION + TTS_CODES + 1)  # a speaking session 8 chunks into its turn
WHISPER_HISTORY_S = 10.0  # seconds of encoder frames each listening session holds
STAGES = ("parity", "speed", "step", "tts", "whisper", "token2wav")
THRESHOLDS = {"flex_rel_diff": 0.05, "flex_greedy": 0.99, "graph_token_agreement": 1.0, "syncs": 1}


def random_weights(d: DecoderDims, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    out = {"model.embed_tokens.weight": w(d.vocab, d.hidden), "lm_head.weight": w(d.vocab, d.hidden),
           "model.norm.weight": ones(d.hidden)}
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": ones(d.hidden), p + "post_attention_layernorm.weight": ones(d.hidden),
                p + "self_attn.q_norm.weight": ones(d.head_dim), p + "self_attn.k_norm.weight": ones(d.head_dim),
                p + "self_attn.q_proj.weight": w(d.heads * d.head_dim, d.hidden),
                p + "self_attn.k_proj.weight": w(d.kv_heads * d.head_dim, d.hidden),
                p + "self_attn.v_proj.weight": w(d.kv_heads * d.head_dim, d.hidden),
                p + "self_attn.o_proj.weight": w(d.hidden, d.heads * d.head_dim),
                p + "mlp.gate_proj.weight": w(d.intermediate, d.hidden),
                p + "mlp.up_proj.weight": w(d.intermediate, d.hidden),
                p + "mlp.down_proj.weight": w(d.hidden, d.intermediate)}
    return out


def preset_for(d: DecoderDims) -> PresetConfig:
    return minicpmo45() if d.vocab == REAL.vocab else tiny()


def llm(d: DecoderDims, weights: dict[str, torch.Tensor], device: str, sessions: int, tokens: int,
        graphs: bool | None = None, attention: str = "auto") -> EngineCore:
    """An LLM core with room for `sessions` sessions of `tokens` tokens; nothing forbidden but <|tts_pad|>."""
    preset = preset_for(d)
    forbidden = np.zeros((2, d.vocab), bool)
    forbidden[:, preset.tokens.tts_pad] = True
    return llm_core(weights, d, preset.tokens, forbidden, rows=max(sessions, 1), graphs=graphs,
                    pool_tokens=sessions * (tokens + 256), attention=attention, max_sessions=sessions + 1,
                    max_tokens=8192)


def randomize(pool: Any) -> None:
    """Any history will do: the work is the same whatever the values (the trash block stays zero)."""
    for t in (*pool.key, *pool.value):
        t[:-1].normal_()


def admit(core: EngineCore, d: DecoderDims, n: int, history: int, rng: np.random.Generator, speaking: float = 1.0,
          tokens: int = SPEAK_TOKENS) -> list[Request]:
    """n rows `history` tokens in, each prefilling a chunk and decoding its scripted tokens."""
    preset = preset_for(d)
    out = []
    for r in range(n):
        seq = core.pool.open(history + CHUNK_TOKENS + tokens + 2)
        prefill = Prefill(rng.integers(0, 250, CHUNK_TOKENS), np.zeros((0, d.hidden), np.float32),
                          np.zeros(CHUNK_TOKENS, bool))
        req = Request(r, seq, history, prefill, SpokenChunk(preset.tokens, rng.random() < speaking, tokens, rng))
        core.add(req)
        out.append(req)
    return out


def clear(core: EngineCore) -> None:
    """Every request given up, every pool session given back."""
    core.abort()
    core.scheduler.waiting.clear()
    for seq in list(core.pool.tables):
        core.pool.free(seq)


# ---------------------------------------------------------------- parity

def parity(d: DecoderDims, device: str, sessions: int, history: int) -> dict[str, Any]:
    d2 = dataclasses.replace(d, layers=2)
    weights = random_weights(d2, device)
    out: dict[str, Any] = {"sessions": sessions, "layers": 2}
    # flex against the gather: a varlen prefill, then a static decode batch, the same pool and weights
    core = llm(d2, weights, device, sessions, history, graphs=False, attention="flex")
    runner = core.runner
    rng = np.random.default_rng(0)
    lens = rng.integers(1, history, sessions).tolist()
    seqs = [core.pool.open(n + 2) for n in lens]
    rows = [Prefill(rng.integers(0, d2.vocab, n), np.zeros((0, d2.hidden), np.float32), np.zeros(n, bool))
            for n in lens]
    flex = runner.model.attention
    logits = {}
    for key, backend in (("gather", GatherAttention()), ("flex", flex)):
        runner.model.attention = backend
        logits[key] = runner.logits(seqs, [0] * sessions, rows).float()
    out["prefill"] = _diff(logits["flex"], logits["gather"])
    steps = [Prefill(rng.integers(0, d2.vocab, 1), np.zeros((0, d2.hidden), np.float32), np.zeros(1, bool))
             for _ in seqs]
    for key, backend in (("gather", GatherAttention()), ("flex", flex)):
        runner.model.attention = backend
        logits[key] = runner.logits(seqs, lens, steps).float()
    out["decode_varlen"] = _diff(logits["flex"], logits["gather"])
    runner.model.attention = flex
    # the CUDA graphs of the decode step against the same step eager: the same tokens, every row and iteration
    picks = {}
    for graphs in (False, True):
        core = llm(d2, weights, device, sessions, history, graphs=graphs if device == "cuda" else False)
        randomize(core.pool)
        rng = np.random.default_rng(1)
        admit(core, d2, sessions, history // 2, rng, tokens=40)
        seen: list[Any] = []
        step = core.runner.step

        def recorded(batch: Any, step: Any = step, seen: list[Any] = seen) -> Any:
            launched = step(batch)
            seen.append(launched)
            return launched

        core.runner.step = recorded  # type: ignore[method-assign]
        syncs = []
        for i in range(12):
            with SyncLedger() as ledger:
                core.step()
            if i >= 3:
                syncs.append(ledger.total)
        picks[graphs] = [launched.picks()[:, 0].copy() for launched in seen]
        out["graph_captures" if graphs else "eager_iterations"] = getattr(core.runner.graphs, "captures", 0) \
            if graphs else len(seen)
        out["syncs_per_iteration_graphs" if graphs else "syncs_per_iteration"] = max(syncs)
    agree = [float(np.mean(a == b)) for a, b in zip(picks[False], picks[True], strict=True)]
    out["graph_token_agreement"] = min(agree)
    out["failed"] = failures(out)
    if out["failed"]:
        out["error"] = "parity past its thresholds: " + "; ".join(out["failed"])
    return out


def _diff(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    scale = ref.abs().max().item()
    return {"max_abs_diff": (got - ref).abs().max().item(), "max_abs_logit": scale,
            "rel_diff": (got - ref).abs().max().item() / max(scale, 1e-9),
            "greedy_agreement": (got.argmax(1) == ref.argmax(1)).float().mean().item()}


def failures(out: dict[str, Any]) -> list[str]:
    t = THRESHOLDS
    bad = [f"{k} flex rel diff {out[k]['rel_diff']:.3g} > {t['flex_rel_diff']}" for k in ("prefill", "decode_varlen")
           if out[k]["rel_diff"] > t["flex_rel_diff"]]
    bad += [f"{k} flex greedy agreement {out[k]['greedy_agreement']:.3f} < {t['flex_greedy']}"
            for k in ("prefill", "decode_varlen") if out[k]["greedy_agreement"] < t["flex_greedy"]]
    if out["graph_token_agreement"] < t["graph_token_agreement"]:
        bad.append(f"graph vs eager token agreement {out['graph_token_agreement']:.3f}")
    bad += [f"{k} {out[k]} > {t['syncs']}" for k in ("syncs_per_iteration", "syncs_per_iteration_graphs")
            if out[k] > t["syncs"]]
    return bad


# ---------------------------------------------------------------- speed

def speed(d: DecoderDims, preset: PresetConfig, device: str, counts: list[int], history: int, repeats: int,
          deadline: float) -> list[dict[str, Any]]:
    weights = random_weights(d, device)
    largest = max(counts)
    results: list[dict[str, Any]] = []
    cores = {"llm": llm(d, weights, device, largest, history + 64)}
    tts_weights = random_state(preset, "tts", device)
    cores["tts"] = tts_core(tts_weights, preset.tts, tts_rules(preset), rows=largest,
                            pool_tokens=largest * (TTS_HISTORY + 64 + ROUNDING), max_sessions=largest + 1,
                            max_tokens=8192, device=device)
    for core in cores.values():
        randomize(core.pool)
    rng = np.random.default_rng(0)
    for n in counts:
        if time.monotonic() > deadline:
            results.append({"sessions": n, "skipped": "out of time"})
            continue
        row: dict[str, Any] = {"sessions": n}
        try:
            for name, core in cores.items():
                for graphs in (True, False):
                    if not graphs and device != "cuda":
                        continue
                    saved = core.runner.graphs
                    if not graphs:
                        core.runner.graphs = None
                    if name == "llm":
                        admit(core, d, n, history, rng, tokens=60)
                    else:
                        for r in range(n):
                            seq = core.pool.open(TTS_HISTORY + 64)
                            feed = TtsFeed(rng.integers(0, 200, CONDITION), np.zeros((0, preset.llm.hidden),
                                                                                      np.float32))
                            core.add(Request(r, seq, TTS_HISTORY, feed, SpokenCodes(60, rng)))
                    key = f"{name}_iteration_ms" + ("" if graphs else "_eager")
                    row[key] = iteration_ms(core, device, repeats)
                    clear(core)
                    core.runner.graphs = saved
            row["llm_roofline_ms"] = _roofline(n, history)
            row["peak_allocated_gib"] = peak_gib(device)
            row["llm_pool_gib"] = cores["llm"].pool.nbytes / 2**30
        except Exception as exc:  # noqa: BLE001 (one size failing, out of memory say, leaves the others)
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            for core in cores.values():
                clear(core)
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def _roofline(rows: int, history: int) -> float:
    from .gpu_projection import BF16, decode_bill, roofline

    return roofline(decode_bill(minicpmo45().llm, rows, history, BF16)) * 1000


# ---------------------------------------------------------------- the whole step

class Token2WavGraphs:
    """token2wav's three graphs (export's modules at the preset's widths, random weights) on the device: a batch of
    chunks is the conformer once, the DiT estimator for each Euler step, HiFT once (pairs of chunks: the graphs'
    example inputs are batches of 2)."""

    def __init__(self, preset: PresetConfig, device: str) -> None:
        from export.stages import build_module, token2wav_stage_graphs

        model = build_module(preset, "token2wav", 0)
        g = torch.Generator().manual_seed(0)
        self.steps = preset.token2wav.n_timesteps
        self.parts = []
        for graph in token2wav_stage_graphs(preset, cast(Any, model)):
            inputs = {k: v.to(device) for k, v in graph.make_inputs(g).items()}
            self.parts.append((graph.module.to(device).eval(), inputs, graph.name.endswith("estimator")))

    def run(self, chunks: int) -> None:
        with torch.inference_mode():
            for _ in range(-(-chunks // 2)):
                for module, inputs, estimator in self.parts:
                    for _ in range(self.steps if estimator else 1):
                        module(**inputs)


@dataclasses.dataclass(order=True)
class Second:
    arrival: float
    session: int = dataclasses.field(compare=False)
    speaking: bool = dataclasses.field(compare=False)


def step_loop(d: DecoderDims, preset: PresetConfig, device: str, counts: list[int], history: int, seconds: float,
              deadline: float, speaking: float = SPEAKING) -> list[dict[str, Any]]:
    """The whole duplex step on one device: the engines' loop, in wall-clock time."""
    weights = random_weights(d, device)
    largest = max(counts)
    lm = llm(d, weights, device, largest, history + 2 * CHUNK_TOKENS + SPEAK_TOKENS)
    tts = tts_core(random_state(preset, "tts", device), preset.tts, tts_rules(preset), rows=largest,
                   pool_tokens=largest * (TTS_HISTORY + CONDITION + TTS_CODES + ROUNDING), max_sessions=largest + 1,
                   max_tokens=8192, device=device)
    w_frames = encoder_frames(WHISPER_HISTORY_S)
    enc = whisper(preset, random_state(preset, "audio_encoder", device), device, largest,
                  w_frames + encoder_frames(seconds + 2))
    t2w = Token2WavGraphs(preset, device)
    for pool in (lm.pool, tts.pool, enc.pool):
        randomize(pool)
    results = []
    for n in counts:
        if time.monotonic() > deadline:
            results.append({"sessions": n, "skipped": "out of time"})
            continue
        try:
            results.append(_one_load(lm, tts, enc, t2w, d, preset, device, n, history, w_frames, seconds, speaking))
        except Exception as exc:  # noqa: BLE001 (one size failing leaves the others)
            results.append({"sessions": n, "error": f"{type(exc).__name__}: {exc}"[:2000],
                            "traceback": traceback.format_exc()[-2000:]})
        for core in (lm, tts):
            clear(core)
        for seq in list(enc.pool.tables):
            enc.pool.free(seq)
        print(json.dumps(results[-1]), flush=True)
    return results


def _one_load(lm: EngineCore, tts: EngineCore, enc: Any, t2w: Token2WavGraphs, d: DecoderDims,
              preset: PresetConfig, device: str, n: int, history: int, w_frames: int, seconds: float,
              speaking: float) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    llm_seqs = [lm.pool.open(history + 2 * CHUNK_TOKENS) for _ in range(n)]
    tts_seqs = [tts.pool.open(TTS_HISTORY + CONDITION + TTS_CODES + 2) for _ in range(n)]
    enc_seqs = [enc.pool.open(w_frames + 50) for _ in range(n)]
    llm_len, enc_len = [history] * n, [w_frames] * n
    offsets = rng.random(n)
    pending = [Second(s + offsets[i], i, bool(rng.random() < speaking)) for s in range(int(seconds)) for i in range(n)]
    heapq.heapify(pending)
    mel = list(torch.as_tensor(chunk_mel(preset, n, 1.0, rng)[0], device=device))  # the device mel's, as served
    latencies: list[float] = []
    t2w_ready: list[Any] = []
    t2w_ms: list[float] = []
    sync(device)
    t0 = time.perf_counter()
    while pending or lm.has_work or tts.has_work or t2w_ready:
        now = time.perf_counter() - t0
        if not (lm.has_work or tts.has_work or t2w_ready) and pending[0].arrival > now:
            time.sleep(pending[0].arrival - now)
            now = pending[0].arrival
        arrived: list[Second] = []
        later: list[Second] = []
        while pending and pending[0].arrival <= now:
            s = heapq.heappop(pending)
            (later if any(a.session == s.session for a in arrived) else arrived).append(s)
        for s in later:  # a session's next second behind its previous one (an iteration longer than a second)
            heapq.heappush(pending, s)
        if arrived:  # their seconds through the streaming Whisper, its embeddings spliced on the device
            rows = [s.session for s in arrived]
            for r in rows:
                enc.pool.reserve(enc_seqs[r], enc_len[r] + 50)
            embeds = enc.forward_chunks([enc_seqs[s] for s in rows], [enc_len[s] for s in rows],
                                        mel[: len(rows)], [0] * len(rows), 50)
            for s in arrived:
                enc_len[s.session] = w_frames  # the stream holds ~10 s: its chunk is rewritten in place
                seq = llm_seqs[s.session]
                lm.pool.reserve(seq, llm_len[s.session] + 2 * CHUNK_TOKENS + SPEAK_TOKENS)
                use = np.zeros(CHUNK_TOKENS, bool)
                use[2:] = True
                prefill = Prefill(rng.integers(0, 250, CHUNK_TOKENS), embeds[rows.index(s.session)], use)
                req = Request(s.session, seq, llm_len[s.session], prefill,
                              SpokenChunk(preset_for(d).tokens, s.speaking, SPEAK_TOKENS, rng))
                req.tag = s
                lm.add(req)
        for req in lm.step():
            s = req.tag
            llm_len[s.session] = history  # the session's context stays 60 s (its unit rewritten in place)
            if s.speaking:
                hidden = req.hidden if req.hidden is not None else np.zeros((0, preset.llm.hidden), np.float32)
                feed = TtsFeed(rng.integers(0, 200, len(hidden) + 1), hidden.astype(np.float32))
                treq = Request(s.session, tts_seqs[s.session], TTS_HISTORY, feed, SpokenCodes(TTS_CODES, rng))
                treq.tag = s
                tts.add(treq)
        t2w_done, t2w_ready = t2w_ready, [req.tag for req in tts.step()]
        if t2w_done:
            t1 = time.perf_counter()
            t2w.run(len(t2w_done))
            sync(device)
            t2w_ms.append((time.perf_counter() - t1) * 1000)
            end = time.perf_counter() - t0
            latencies += [end - s.arrival for s in t2w_done if s.arrival >= 1.0]  # past the first second
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    return {"sessions": n, "seconds": seconds, "speaking_steps": len(latencies),
            "speaking_p50_ms": float(np.percentile(lat, 50)), "speaking_p95_ms": float(np.percentile(lat, 95)),
            "token2wav_batch_ms_median": statistics.median(t2w_ms) if t2w_ms else None,
            "llm_iterations": lm.iterations, "tts_iterations": tts.iterations,
            "peak_allocated_gib": peak_gib(device)}


# ---------------------------------------------------------------- the run

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_out"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small dims, 2 and 4 sessions (tests the script)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="the speed stage starts no new size past this (from the start)")
    parser.add_argument("--step-budget-s", type=float, default=150.0, help="the step stage's, from its start")
    parser.add_argument("--speech-budget-s", type=float, default=60.0,
                        help="the TTS and Whisper stages together start no new size past this (from their start)")
    parser.add_argument("--step-seconds", type=float, default=4.0)
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    args = parser.parse_args(argv)
    chosen = args.stages.split(",")
    if unknown := set(chosen) - set(STAGES):
        parser.error(f"unknown stages {sorted(unknown)}: choose from {', '.join(STAGES)}")
    t_start = time.monotonic()
    starts: dict[str, float] = {}

    def budget(key: str, seconds: float) -> float:  # set when the stage (or the first of a pair) starts
        return starts.setdefault(key, time.monotonic() + seconds)

    args.out.mkdir(parents=True, exist_ok=True)
    d = QUICK if args.quick else REAL
    counts = [2, 4] if args.quick else [32, 64, 128, 256]
    history = 50 if args.quick else HISTORY_60S
    preset = tiny() if args.quick else minicpmo45()
    repeats = 3 if args.quick else 20
    tts_history = 2 * (CONDITION + 26) if args.quick else TTS_HISTORY
    whisper_history = 2.0 if args.quick else WHISPER_HISTORY_S
    step_seconds = 3.0 if args.quick else args.step_seconds
    report: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "dims": dataclasses.asdict(d),
                              "speech_preset": preset.name, "thresholds": THRESHOLDS,
                              "note": "random weights, scripted rows; speed of the engines, not of a served model"}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
        torch._dynamo.config.recompile_limit = 64  # a compile per bucket, per stage's pool
    path = args.out / "gpu_check.json"
    stages = {"parity": lambda: parity(d, args.device, 8, history),
              "speed": lambda: speed(d, preset, args.device, counts, history, repeats, t_start + args.budget_s),
              "step": lambda: step_loop(d, preset, args.device, counts, history, step_seconds,
                                        budget("step", args.step_budget_s), 0.6 if args.quick else SPEAKING),
              "tts": lambda: tts_stage(preset, args.device, counts, tts_history, repeats,
                                       budget("speech", args.speech_budget_s)),
              "whisper": lambda: whisper_stage(preset, args.device, [2, 4] if args.quick else WHISPER_COUNTS,
                                               whisper_history, repeats,
                                               budget("speech", args.speech_budget_s)),
              "token2wav": lambda: token2wav_stage(preset, args.device, [2, 4] if args.quick else [8, 32, 64, 128],
                                                   repeats, args.speech_budget_s)}
    failed = False
    for name in chosen:
        t0 = time.perf_counter()
        try:
            report[name] = stages[name]()
        except Exception as exc:  # noqa: BLE001 (a stage that breaks is recorded; the next one still runs)
            failed = True
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        report[f"{name}_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(report, indent=1))
        print(f"== {name} ({report[f'{name}_s']:.0f} s)\n{json.dumps(report[name], indent=1)[:3000]}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
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

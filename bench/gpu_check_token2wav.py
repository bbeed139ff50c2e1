"""bench/gpu_check.py's stage for token2wav's device path (stages/token2wav_device.py), with no checkpoint: random
weights (`Token2WavModel.random`) at a preset's token2wav dims (MiniCPM-o 4.5's on the GPU, `tiny`'s for
`--quick`).

parity: the device path on the device against the same path on the CPU in fp32 (the reference: the tests hold it
to today's path and to the official streaming), same weights, same noise: two sessions with different voices,
whole chunks and a flushed one; max |waveform difference| with the caches in fp32 and in bf16 (what `auto` keeps
on a GPU), each failing past its bound.
speed: n speaking sessions (8/32/64/128; 2/4 with --quick) mid-turn with one 10 s voice: ms per iteration (every
session's whole chunk: the conformer, the 5 DiT steps through the CUDA graphs, HiFT) and per chunk, graph
replays, the pool's bytes per slot, peak memory; the sizes that start within the budget after the parity.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import torch

from export.modules.token2wav import Token2WavModel
from export.presets import PresetConfig
from minicpmo_triton.stages.token2wav_device import DeviceStreamer
from minicpmo_triton.vocoder.hift import fold_weight_norm

from .gpu_timing import peak_gib, sync, timed

SEED = 0
BOUND = {"fp32": 1e-3, "bf16": 5e-2}  # max |difference| of the waveform against the CPU's fp32 (audio peaks ~1)
VOICE_S = 10.0  # the speed sizes' voice (25 tokens a second)


def streamer(model: Token2WavModel, preset: PresetConfig, device: str, dtype: torch.dtype,
             slots: int = 16) -> DeviceStreamer:
    """The device path over copies of the model's modules, on `device`."""
    return DeviceStreamer(copy.deepcopy(model.flow).to(device), copy.deepcopy(model.hift).to(device),
                          model.tables(), preset.token2wav, device, max_slots=slots, cache_dtype=dtype)


def voice(d: Any, seconds: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = int(25 * seconds)
    return (rng.integers(0, d.vocab, n), rng.normal(-6, 1.5, (2 * n, d.n_mels)).astype(np.float32),
            rng.standard_normal(d.spk_embed_dim).astype(np.float32))


def stream_audio(s: DeviceStreamer, chunks: list[int]) -> list[np.ndarray]:
    """Two sessions (a 3 s and a 5 s voice), one turn each of chunks `chunks` tokens long, side by side."""
    d, rng = s.d, np.random.default_rng(1)
    streams = [s.new_stream(s.setup(*voice(d, sec, i)), seed=i) for i, sec in enumerate((3.0, 5.0))]
    for st in streams:
        s.restart(st)
    out = []
    for n in chunks:
        tokens = rng.integers(0, d.vocab, n).tolist()
        out += s.chunk([(st, tokens, False) for st in streams])
    return out


def parity(model: Token2WavModel, preset: PresetConfig, device: str) -> dict[str, Any]:
    chunks = [28, 28, 17, 28]  # whole chunks (graphed on CUDA) and a flushed one
    reference = stream_audio(streamer(model, preset, "cpu", torch.float32), chunks)
    out: dict[str, Any] = {"reference": "the device path on the CPU, fp32", "chunks": chunks}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        got = stream_audio(streamer(model, preset, device, dtype), chunks)
        worst = max(float(np.abs(g - r).max()) for g, r in zip(got, reference, strict=True))
        out[name] = {"max_abs_diff": worst, "bound": BOUND[name]}
        if worst > BOUND[name]:
            out[name]["error"] = f"{name} caches: max |diff| {worst:.3g} past {BOUND[name]}"
    out["max_abs_reference"] = max(float(np.abs(r).max()) for r in reference)
    return out


def speed(model: Token2WavModel, preset: PresetConfig, device: str, n: int, repeats: int) -> dict[str, Any]:
    """n sessions mid-turn with one voice: one iteration = every session's whole chunk."""
    s = streamer(model, preset, device, torch.bfloat16 if device == "cuda" else torch.float32, slots=n)
    d, rng = s.d, np.random.default_rng(n)
    prompt = s.setup(*voice(d, VOICE_S, 0))
    streams = [s.new_stream(prompt, seed=i) for i in range(n)]
    for st in streams:
        s.restart(st)
    chunk = d.chunk_tokens + d.lookahead

    def iteration() -> None:
        s.chunk([(st, rng.integers(0, d.vocab, chunk).tolist(), False) for st in streams])

    for _ in range(6):  # past the caches' bound (the voice + 100 frames): the steady size
        iteration()
    ms = timed(device, iteration, repeats)
    graphs = s.graphs
    return {"sessions": n, "iteration_ms": ms, "chunk_ms": ms / n, "real_time_sessions": n * 1000 / ms,
            "graph_replays": None if graphs is None else graphs.replays, "slot_mib": s.pool.slot_bytes() / 2**20,
            "pool_gib": s.pool.nbytes / 2**30, "peak_allocated_gib": peak_gib(device)}


def token2wav_stage(preset: PresetConfig, device: str, counts: list[int], repeats: int,
                    budget_s: float) -> dict[str, Any]:
    """The parity, then the sizes that start within `budget_s` of the parity's end."""
    if device == "cuda":
        torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 (HiFT's convolutions): the parity's bound
    else:
        torch.set_num_threads(1)  # the CPU run checks the script: one thread, as a CPU instance runs torch
    d = preset.token2wav
    t0 = time.perf_counter()
    model = Token2WavModel.random(d, SEED)
    fold_weight_norm(model.hift)  # HiFT's weights computed once, as the served model's (before any copy of it)
    report: dict[str, Any] = {"dims": "minicpm-o-4.5" if d.dit_depth > 2 else "tiny", "voice_s": VOICE_S,
                              "build_s": time.perf_counter() - t0, "parity": parity(model, preset, device)}
    sizes: list[dict[str, Any]] = []
    deadline = time.monotonic() + budget_s
    for n in counts:
        if time.monotonic() > deadline:
            sizes.append({"sessions": n, "skipped": "out of time"})
            continue
        try:
            sizes.append(speed(model, preset, device, n, repeats))
        except Exception as exc:  # noqa: BLE001 (one size failing, out of memory say, leaves the others)
            sizes.append({"sessions": n, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        sync(device)
        if device == "cuda":
            torch.cuda.empty_cache()
    report["speed"] = sizes
    return report

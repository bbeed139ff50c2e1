"""bench/gpu_check.py's stages for the TTS and the streaming Whisper on the device engine, with no checkpoint: random
weights (export/stages.py `build_module`, the modules the export builds) at a preset's dims (MiniCPM-o 4.5's on
the GPU, `tiny`'s for `--quick`).

TTS: parity of the CUDA backend (flex over the pool) against the reference gather, same weights, same pool, same
rows (a chunk's condition prefilled, then one code a row): logits' max difference and greedy agreement; the device
rules' greedy codes against the host's (`ChunkRules.adjusted` + `sampling.sample`); speed at n speaking sessions,
each `TTS_HISTORY` positions into its turn: ms per decode iteration (the core's step, one code a row, its rules
included) and per chunk (the condition's prefill, then 26 codes a row: 25 kept and the one `generate_chunk` drops),
pool GiB.
Whisper: parity of flex against gather (the chunk's non-causal rows over each session's past), of the fixed-shape
chunk step against the varlen forward, and (on CUDA) of its CUDA graphs' replays against the same step run eagerly:
embeddings' max difference; speed at n sessions each holding 10 s of encoder frames: ms per 1 s chunk of all through
the fixed-shape step, with its CUDA graphs (on CUDA) and eagerly, pool GiB.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

import numpy as np
import torch

from export.presets import PresetConfig
from export.stages import build_module
from minicpmo_triton.engine.attention import FlexAttention, GatherAttention, PagedAttention
from minicpmo_triton.engine.build import tts_core
from minicpmo_triton.engine.core import EngineCore
from minicpmo_triton.engine.graphs import DecodeGraphs
from minicpmo_triton.engine.protocol import TtsFeed
from minicpmo_triton.engine.request import Request
from minicpmo_triton.engine.tts import TtsHead
from minicpmo_triton.engine.whisper import PagedWhisper
from minicpmo_triton.media.audio_mel import CONTEXT_FRAMES, HOP
from minicpmo_triton.rules.sampling import SamplingParams, apply_repetition_penalty, sample
from minicpmo_triton.stages.tts import tts_rules

from .gpu_timing import iteration_ms, peak_gib, timed
from .scripted import SpokenCodes

CONDITION = 11  # a chunk's condition: 10 text tokens with their LLM hidden states, then audio_bos
SEED = 0
ROUNDING = 128  # room a session's tokens take beyond their count: the last block (flex's are 128 tokens)


def random_state(preset: PresetConfig, stage: str, device: str) -> dict[str, torch.Tensor]:
    """The stage's module built (and initialised) on `device`: real widths' weights are not made on the host."""
    with torch.device(device):
        return build_module(preset, stage, SEED).state_dict()


def _backends(pool: Any, device: str) -> list[tuple[str, PagedAttention, bool]]:
    """(name, backend, compiled layers): what is compared with the eager gather. As served on CUDA: the layers
    and flex compiled; on the CPU flex eager only (inductor's CPU compile takes longer than the whole check)."""
    out: list[tuple[str, PagedAttention, bool]] = [("flex", FlexAttention(pool, compiled=False), False)]
    if device == "cuda":
        out.append(("flex_compiled", FlexAttention(pool, compiled=True), True))
    return out


def _diff(got: torch.Tensor, ref: torch.Tensor, greedy: bool) -> dict[str, float]:
    out = {"max_abs_diff": (got - ref).abs().max().item(), "max_abs_ref": ref.abs().max().item()}
    if greedy:
        out["greedy_agreement"] = (got.argmax(1) == ref.argmax(1)).float().mean().item()
    return out


# ---------------------------------------------------------------- TTS

def tts(preset: PresetConfig, weights: dict[str, torch.Tensor], device: str, sessions: int, tokens: int,
        **build: Any) -> EngineCore:
    return tts_core(weights, preset.tts, tts_rules(preset), device=device, pool_tokens=sessions * (tokens + ROUNDING),
                    max_sessions=max(sessions, 1), rows=max(sessions, 1), **build)


def condition(preset: PresetConfig, rng: np.random.Generator, n: int = CONDITION) -> TtsFeed:
    """A chunk's condition: text ids with LLM hidden states, audio_bos last (text only)."""
    ids = rng.integers(0, preset.tts.num_text_tokens, n)
    ids[-1] = preset.tts.audio_bos_token_id
    return TtsFeed(ids, rng.standard_normal((n - 1, preset.llm.hidden)).astype(np.float32))


def host_greedy(preset: PresetConfig, logits: np.ndarray, history: list[int], allow_eos: bool) -> int:
    """The host's rules (`ChunkRules.adjusted` then `sample`) for a greedy row."""
    dx = preset.duplex
    x = logits.astype(np.float32)
    apply_repetition_penalty(x, history, dx.tts_repetition_penalty, dx.tts_repetition_window, per_occurrence=True)
    if not allow_eos:
        x[preset.tts.num_audio_tokens - 1] = -np.inf
    return sample(x, SamplingParams(0.0, dx.tts_top_k, dx.tts_top_p), np.random.default_rng(0))


def tts_parity(preset: PresetConfig, device: str, sessions: int, history: int) -> dict[str, Any]:
    """One core, its attention swapped (the same forwards rewrite the same keys in the same slots)."""
    small_tts = dataclasses.replace(preset.tts, decoder=dataclasses.replace(preset.tts.decoder, layers=2))
    small = dataclasses.replace(preset, tts=small_tts)
    core = tts(small, random_state(small, "tts", device), device, sessions, history, attention="flex",
               compile_layers=False)
    runner = core.runner
    rng = np.random.default_rng(0)
    lens = rng.integers(1, history, sessions).tolist()
    seqs = [core.pool.open(n + 2) for n in lens]
    out: dict[str, Any] = {"sessions": sessions, "layers": 2, "dtype": str(runner.model.dtype)}
    step = [TtsFeed(np.zeros(1, np.int64), np.zeros((0, preset.llm.hidden), np.float32)) for _ in seqs]
    for name, pasts, feeds in (("prefill", [0] * sessions, [condition(small, rng, n) for n in lens]),
                               ("decode", lens, step)):
        runner.model.attention = GatherAttention()
        runner.model.use_compiled(False)
        ref = runner.logits(seqs, pasts, feeds)
        out[name] = {}
        for key, backend, compiled in _backends(core.pool, device):
            runner.model.attention = backend
            runner.model.use_compiled(compiled)
            out[name][key] = _diff(runner.logits(seqs, pasts, feeds), ref, greedy=True)
        if name == "decode":  # the device rules' greedy codes against the host's, on the reference's logits
            head = cast(TtsHead, runner.head)
            window = preset.duplex.tts_repetition_window
            histories = [rng.integers(0, 50, window).tolist() for _ in range(sessions)]
            allow = [r % 3 == 0 for r in range(sessions)]
            from minicpmo_triton.engine.protocol import TtsRow

            head.admit(list(range(sessions)), [TtsRow(0.0, a, 64, np.zeros(0)) for a in allow])
            core.pool.flush()
            for r, h in enumerate(histories):
                head.ring[r] = torch.tensor(h)
            live = torch.ones(sessions, dtype=torch.bool, device=device)
            head.choose(ref, slice(0, sessions), runner.state, live, runner.topk)
            codes = runner.state.out[:sessions, 0].tolist()
            host = ref.float().cpu().numpy()
            out["sampler_greedy_agreement"] = float(np.mean(
                [codes[r] == host_greedy(preset, host[r], histories[r], allow[r]) for r in range(sessions)]))
    return out


def tts_measure(preset: PresetConfig, weights: dict[str, torch.Tensor], device: str, n: int, history: int,
                repeats: int) -> dict[str, Any]:
    codes = preset.duplex.tts_tokens_per_chunk
    core = tts(preset, weights, device, n, history + CONDITION + codes + 2)
    for t in (*core.pool.key, *core.pool.value):  # any history will do: the work is the same whatever the values
        t[:-1].normal_()
    seqs = [core.pool.open(history + CONDITION + codes + 2) for _ in range(n)]
    rng = np.random.default_rng(n)

    def chunk(long: int = codes) -> list[Request]:
        reqs = [Request(r, seqs[r], history, condition(preset, rng), SpokenCodes(long, rng)) for r in range(n)]
        for req in reqs:
            core.add(req)
        return reqs

    def whole_chunk() -> None:
        reqs = chunk()
        while any(not r.finished for r in reqs):
            core.step()
        while core.has_work:
            core.step()

    chunk_ms = timed(device, whole_chunk, max(1, repeats // 5))
    chunk(4 * codes + repeats)  # long rows: every timed iteration decodes all n
    decode_ms = iteration_ms(core, device, repeats)
    core.abort()
    return {"sessions": n, "history": history, "attention": core.runner.model.attention.name,
            "compiled": core.runner.model.compiled, "graphs": core.runner.graphs is not None,
            "decode_iteration_ms": decode_ms, "chunk_ms": chunk_ms, "chunk_codes": codes + 1,
            "pool_gib": core.pool.nbytes / 2**30, "block_size": core.pool.shape.block_size,
            "peak_allocated_gib": peak_gib(device)}


# ---------------------------------------------------------------- Whisper

def chunk_mel(preset: PresetConfig, n: int, seconds: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n rows of a `seconds` chunk's mel past a stream's first: its frames and the context on each side."""
    frames = int(seconds * 16_000) // HOP + 2 * CONTEXT_FRAMES
    return (rng.standard_normal((n, preset.audio.n_mels, frames)).astype(np.float32), np.ones((n, frames), bool))


def encoder_frames(seconds: float) -> int:
    return int(seconds * 16_000) // HOP // 2  # the conv stem's stride 2: 50 frames a second


WHISPER_COUNTS = [8, 32, 128]  # rows of a chunk step timed on the GPU


def whisper(preset: PresetConfig, weights: dict[str, torch.Tensor], device: str, sessions: int, tokens: int,
            **build: Any) -> PagedWhisper:
    return PagedWhisper.build(weights, preset.audio, device=device, pool_tokens=sessions * (tokens + ROUNDING),
                              max_sessions=max(sessions, 1), **build)


def whisper_parity(preset: PresetConfig, device: str, sessions: int, history_s: float) -> dict[str, Any]:
    small = dataclasses.replace(preset, audio=dataclasses.replace(preset.audio, layers=2))
    history = encoder_frames(history_s)
    weights = random_state(small, "audio_encoder", device)
    enc = whisper(small, weights, device, sessions, history, attention="flex", graphs=False)
    rng = np.random.default_rng(0)
    lens = (rng.integers(1, history // 50 + 1, sessions) * 50).tolist()  # whole seconds of past, ragged
    for t in (*enc.pool.key, *enc.pool.value):  # the sessions' pasts: random keys and values
        t[:-1].normal_()
    seqs = [enc.pool.open(1) for _ in range(sessions)]
    mel, mask = chunk_mel(small, sessions, 1.0, rng)
    out: dict[str, Any] = {"sessions": sessions, "layers": 2, "dtype": str(enc.dtype), "pasts": lens}
    enc.attention = GatherAttention()
    ref = enc.forward(seqs, lens, mel, mask)
    for key, backend, _ in _backends(enc.pool, device):
        enc.attention = backend
        out[key] = _diff(enc.forward(seqs, lens, mel, mask), ref, greedy=False)
    # the fixed-shape step (rows padded to a bucket) on the served backend: the varlen forward's embeddings
    varlen = enc.forward(seqs, lens, mel, mask)
    chunks = enc.forward_chunks(seqs, lens, list(mel), [0] * sessions, encoder_frames(1.0))
    out["padded"] = _diff(chunks, varlen, greedy=False)
    if device == "cuda":  # its CUDA graph: captured at the second call of its key, replayed from the third
        enc.graphs = graphs = DecodeGraphs(enc._chunk_step)
        for _ in range(3):  # the same rows again: the same keys rewritten at the same places
            replay = enc.forward_chunks(seqs, lens, list(mel), [0] * sessions, encoder_frames(1.0))
        out["graphs"] = {**_diff(replay, chunks, greedy=False), "replays": graphs.replays}
    return out


def whisper_measure(preset: PresetConfig, weights: dict[str, torch.Tensor], device: str, n: int, history_s: float,
                    repeats: int) -> dict[str, Any]:
    history, new = encoder_frames(history_s), encoder_frames(1.0)
    enc = whisper(preset, weights, device, n, history + new)
    for t in (*enc.pool.key, *enc.pool.value):
        t[:-1].normal_()
    seqs = [enc.pool.open(history + new) for _ in range(n)]
    mel, _ = chunk_mel(preset, n, 1.0, np.random.default_rng(n))
    device_mel = list(torch.as_tensor(mel, device=device))  # as the device mel hands them over

    def chunk() -> None:
        enc.forward_chunks(seqs, [history] * n, device_mel, [0] * n, new)

    graphs, enc.graphs = enc.graphs, None
    eager_ms = timed(device, chunk, repeats)
    enc.graphs = graphs
    graph_ms = timed(device, chunk, repeats) if graphs is not None else None
    return {"sessions": n, "history_s": history_s, "attention": enc.attention.name, "chunk_ms": graph_ms or eager_ms,
            "chunk_ms_eager": eager_ms, "chunk_ms_graphs": graph_ms, "pool_gib": enc.pool.nbytes / 2**30,
            "block_size": enc.pool.shape.block_size, "peak_allocated_gib": peak_gib(device)}


# ---------------------------------------------------------------- the stages

def sizes(measure: Any, counts: list[int], deadline: float, device: str) -> list[dict[str, Any]]:
    """`measure(n)` for each count until the deadline; one size failing (out of memory, say) leaves the others."""
    results: list[dict[str, Any]] = []
    for n in counts:
        if time.monotonic() > deadline:
            results.append({"sessions": n, "skipped": "out of time"})
            continue
        if device == "cuda":  # each size's own peak, not the LLM stages' before it
            torch.cuda.reset_peak_memory_stats()
        try:
            results.append(measure(n))
        except Exception as exc:  # noqa: BLE001
            results.append({"sessions": n, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        print(results[-1], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def tts_stage(preset: PresetConfig, device: str, counts: list[int], history: int, repeats: int,
              deadline: float) -> dict[str, Any]:
    """`counts[-1]` sessions (at most 8) for the parity."""
    out: dict[str, Any] = {"parity": tts_parity(preset, device, min(8, counts[-1]), history)}
    weights = random_state(preset, "tts", device)
    out["weights_gib"] = sum(t.numel() for t in weights.values()) * (2 if device == "cuda" else 4) / 2**30
    out["speed"] = sizes(lambda n: tts_measure(preset, weights, device, n, history, repeats), counts, deadline,
                         device)
    return out


def whisper_stage(preset: PresetConfig, device: str, counts: list[int], history_s: float, repeats: int,
                  deadline: float) -> dict[str, Any]:
    """`counts[-1]` sessions (at most 8) for the parity."""
    out: dict[str, Any] = {"parity": whisper_parity(preset, device, min(8, counts[-1]), history_s)}
    weights = random_state(preset, "audio_encoder", device)
    out["speed"] = sizes(lambda n: whisper_measure(preset, weights, device, n, history_s, repeats), counts,
                         deadline, device)
    return out

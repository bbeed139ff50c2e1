"""bench/gpu_check.py's stages for the paged TTS and the paged streaming Whisper, with no checkpoint: random
weights (export/stages.py `build_module`, the modules the export builds) at a preset's dims (MiniCPM-o 4.5's on
the GPU, `tiny`'s for `--quick`).

TTS: parity of the CUDA backend (flex over the pool, eager and as served: compiled layers) against the reference
gather, same weights, same pool, same rows (prefill of a chunk's condition, then one code a row): logits' max
difference and greedy agreement; the device sampler's greedy codes against the host's rules (`sampling`);
speed at n speaking sessions, each `TTS_HISTORY` positions into its turn: ms per decode iteration (one code a
row, the device sampler included) and per chunk (the condition's prefill, then 26 codes a row through the engine's
loop: 25 returned and the one `generate_chunk` drops), pool GiB.
Whisper: parity of flex against gather (the chunk's non-causal rows over each session's past), embeddings' max
difference; speed at n sessions each holding 10 s of encoder frames: ms per 1 s chunk of all, pool GiB.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from export.presets import PresetConfig
from export.stages import build_module
from minicpmo_triton.audio_mel import CONTEXT_FRAMES, HOP
from minicpmo_triton.paged.attention import FlexAttention, GatherAttention, PagedAttention
from minicpmo_triton.paged.protocol import TtsPick, TtsRules
from minicpmo_triton.paged.tts import PagedTtsEngine, TtsFeed
from minicpmo_triton.paged.whisper import PagedWhisper
from minicpmo_triton.sampling import SamplingParams, apply_repetition_penalty, sample

from .gpu_timing import peak_gib, timed

CONDITION = 11  # a chunk's condition: 10 text tokens with their LLM hidden states, then audio_bos
SEED = 0
ROUNDING = 128  # room a session's tokens take beyond their count: the last block (flex's are 128 tokens)


def random_state(preset: PresetConfig, stage: str, device: str) -> dict[str, torch.Tensor]:
    """The stage's module built (and initialised) on `device`: real widths' weights are not made on the host."""
    with torch.device(device):
        return build_module(preset, stage, SEED).state_dict()


def _backends(device: str) -> list[tuple[str, PagedAttention, bool]]:
    """(name, backend, compiled layers): what is compared with the eager gather. As served on CUDA: the layers
    and flex compiled; on the CPU flex eager only (inductor's CPU compile takes longer than the whole check)."""
    cuda = device == "cuda"
    out: list[tuple[str, PagedAttention, bool]] = [("flex", FlexAttention(compiled=False), False)]
    if cuda:
        out.append(("flex_compiled", FlexAttention(compiled=True), True))
    return out


def _diff(got: torch.Tensor, ref: torch.Tensor, greedy: bool) -> dict[str, float]:
    out = {"max_abs_diff": (got - ref).abs().max().item(), "max_abs_ref": ref.abs().max().item()}
    if greedy:
        out["greedy_agreement"] = (got.argmax(1) == ref.argmax(1)).float().mean().item()
    return out


# ---------------------------------------------------------------- TTS

def tts_rules(preset: PresetConfig) -> TtsRules:
    dx = preset.duplex
    return TtsRules(preset.tts.num_audio_tokens - 1, dx.tts_top_k, dx.tts_top_p, dx.tts_repetition_penalty)


def tts_engine(preset: PresetConfig, weights: dict[str, torch.Tensor], device: str, sessions: int, tokens: int,
               **build: Any) -> PagedTtsEngine:
    eng = PagedTtsEngine.build(weights, preset.tts, device=device, pool_tokens=sessions * (tokens + ROUNDING),
                               max_sessions=max(sessions, 1), **build)
    eng.use_rules(tts_rules(preset))
    return eng


def condition(preset: PresetConfig, rng: np.random.Generator, n: int = CONDITION) -> TtsFeed:
    """A chunk's condition: text ids with LLM hidden states, audio_bos last (text only)."""
    has = np.ones(n, bool)
    has[-1] = False
    ids = rng.integers(0, preset.tts.num_text_tokens, n)
    ids[-1] = preset.tts.audio_bos_token_id
    return TtsFeed(ids, rng.standard_normal((n - 1, preset.llm.hidden)).astype(np.float32), has,
                   np.zeros(n, np.int64), np.zeros(n, bool))


class Speaker:
    """The TTS loop's driver: every row speaks `codes` codes (no EOS mid-chunk), even rows sampled at the stage's
    temperature, odd rows greedy; the repetition window is the row's last codes."""

    def __init__(self, preset: PresetConfig, rows: int, codes: int, rng: np.random.Generator) -> None:
        self.temperature, self.window = preset.duplex.tts_temperature, preset.duplex.tts_repetition_window
        self.codes: list[list[int]] = [[] for _ in range(rows)]
        self.limit = codes
        self.rng = rng

    def pick(self, row: int) -> TtsPick:
        return TtsPick(self.temperature if row % 2 == 0 else 0.0, self.codes[row][-self.window:], False,
                       float(self.rng.random()))

    def accept(self, row: int, code: int) -> int | None:
        if code < 0:
            raise FloatingPointError(f"row {row}: logits not finite")
        self.codes[row].append(code)
        return code if len(self.codes[row]) < self.limit else None


def host_greedy(preset: PresetConfig, logits: np.ndarray, pick: TtsPick) -> int:
    """The host's rules (`TtsRows.adjusted` then `sample`) for a greedy row."""
    dx = preset.duplex
    x = logits.astype(np.float32)
    apply_repetition_penalty(x, pick.history, dx.tts_repetition_penalty, dx.tts_repetition_window,
                             per_occurrence=True)
    if not pick.allow_eos:
        x[preset.tts.num_audio_tokens - 1] = -np.inf
    return sample(x, SamplingParams(0.0, dx.tts_top_k, dx.tts_top_p), np.random.default_rng(0))


def tts_parity(preset: PresetConfig, device: str, sessions: int, history: int) -> dict[str, Any]:
    """One engine, its attention swapped (the same forwards rewrite the same keys in the same slots)."""
    tts = dataclasses.replace(preset.tts, decoder=dataclasses.replace(preset.tts.decoder, layers=2))
    small = dataclasses.replace(preset, tts=tts)
    eng = tts_engine(small, random_state(small, "tts", device), device, sessions, history,
                     attention="flex", compile_layers=False)
    rng = np.random.default_rng(0)
    lens = rng.integers(1, history, sessions).tolist()
    seqs = [eng.pool.open(1) for _ in range(sessions)]
    prefill = [condition(small, rng, n) for n in lens]
    step = [eng.code_feed(int(c)) for c in rng.integers(0, tts.num_audio_tokens - 1, sessions)]
    out: dict[str, Any] = {"sessions": sessions, "layers": 2, "dtype": str(eng.model.dtype)}
    gather = GatherAttention()
    for name, pasts, feeds in (("prefill", [0] * sessions, prefill), ("decode", lens, step)):
        eng.model.attention = gather
        eng.model.use_compiled(False)
        ref = eng.forward(seqs, pasts, feeds)
        out[name] = {}
        for key, backend, compiled in _backends(device):
            eng.model.attention = backend
            eng.model.use_compiled(compiled)
            out[name][key] = _diff(eng.forward(seqs, pasts, feeds), ref, greedy=True)
        if name == "decode":  # the device sampler's greedy codes against the host's, on the reference's logits
            window = preset.duplex.tts_repetition_window
            picks = [TtsPick(0.0, rng.integers(0, 50, window).tolist(), r % 3 == 0) for r in range(sessions)]
            assert eng.sampler is not None
            codes, _ = eng.sampler.pick(ref, picks)
            host = ref.cpu().numpy()
            out["sampler_greedy_agreement"] = float(np.mean(
                [int(codes[r]) == host_greedy(preset, host[r], picks[r]) for r in range(sessions)]))
    return out


def tts_measure(preset: PresetConfig, weights: dict[str, torch.Tensor], device: str, n: int, history: int,
                repeats: int) -> dict[str, Any]:
    codes = preset.duplex.tts_tokens_per_chunk + 1  # the 26th is sampled and dropped (generate_chunk)
    room = history + CONDITION + codes
    eng = tts_engine(preset, weights, device, n, room)
    for layer in range(eng.pool.shape.layers):  # any history will do: the work is the same whatever the values
        eng.pool.key[layer].normal_()
        eng.pool.value[layer].normal_()
    seqs = [eng.pool.open(room) for _ in range(n)]
    rng = np.random.default_rng(n)
    pasts = [history] * n
    feeds = [eng.code_feed(int(c)) for c in rng.integers(0, preset.tts.num_audio_tokens - 1, n)]
    conditions = [condition(preset, rng) for _ in range(n)]
    speaker = Speaker(preset, n, codes, rng)
    picks = [speaker.pick(r) for r in range(n)]
    assert eng.sampler is not None
    sampler = eng.sampler

    def decode() -> None:
        sampler.pick(eng.forward(seqs, pasts, feeds), picks)  # ends in the codes' download: synchronised

    def chunk() -> None:
        eng.run(seqs, pasts, conditions, Speaker(preset, n, codes, rng))

    decode_ms = timed(device, decode, repeats)
    chunk_ms = timed(device, chunk, max(1, repeats // 5))
    return {"sessions": n, "history": history, "attention": eng.model.attention.name,
            "compiled": eng.model.compiled, "attention_fallbacks": getattr(eng.model.attention, "fallbacks", []),
            "decode_iteration_ms": decode_ms, "chunk_ms": chunk_ms, "chunk_codes": codes,
            "pool_gib": eng.pool.nbytes / 2**30, "block_size": eng.pool.shape.block_size,
            "peak_allocated_gib": peak_gib(device)}


# ---------------------------------------------------------------- Whisper

def chunk_mel(preset: PresetConfig, n: int, seconds: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n rows of a `seconds` chunk's mel past a stream's first: its frames and the context on each side."""
    frames = int(seconds * 16_000) // HOP + 2 * CONTEXT_FRAMES
    return (rng.standard_normal((n, preset.audio.n_mels, frames)).astype(np.float32), np.ones((n, frames), bool))


def encoder_frames(seconds: float) -> int:
    return int(seconds * 16_000) // HOP // 2  # the conv stem's stride 2: 50 frames a second


def whisper(preset: PresetConfig, weights: dict[str, torch.Tensor], device: str, sessions: int, tokens: int,
            **build: Any) -> PagedWhisper:
    return PagedWhisper.build(weights, preset.audio, device=device, pool_tokens=sessions * (tokens + ROUNDING),
                              max_sessions=max(sessions, 1), **build)


def whisper_parity(preset: PresetConfig, device: str, sessions: int, history_s: float) -> dict[str, Any]:
    small = dataclasses.replace(preset, audio=dataclasses.replace(preset.audio, layers=2))
    history = encoder_frames(history_s)
    enc = whisper(small, random_state(small, "audio_encoder", device), device, sessions, history,
                  attention="flex")
    rng = np.random.default_rng(0)
    lens = (rng.integers(1, history // 50 + 1, sessions) * 50).tolist()  # whole seconds of past, ragged
    for layer in range(enc.pool.shape.layers):  # the sessions' pasts: random keys and values
        enc.pool.key[layer].normal_()
        enc.pool.value[layer].normal_()
    seqs = [enc.pool.open(1) for _ in range(sessions)]
    mel, mask = chunk_mel(small, sessions, 1.0, rng)
    out: dict[str, Any] = {"sessions": sessions, "layers": 2, "dtype": str(enc.dtype), "pasts": lens}
    enc.attention = GatherAttention()
    ref = torch.as_tensor(enc.encode(seqs, lens, mel, mask))
    for key, backend, _ in _backends(device):
        enc.attention = backend
        out[key] = _diff(torch.as_tensor(enc.encode(seqs, lens, mel, mask)), ref, greedy=False)
    return out


def whisper_measure(preset: PresetConfig, weights: dict[str, torch.Tensor], device: str, n: int, history_s: float,
                    repeats: int) -> dict[str, Any]:
    history, new = encoder_frames(history_s), encoder_frames(1.0)
    enc = whisper(preset, weights, device, n, history + new)
    for layer in range(enc.pool.shape.layers):
        enc.pool.key[layer].normal_()
        enc.pool.value[layer].normal_()
    seqs = [enc.pool.open(history + new) for _ in range(n)]
    mel, mask = chunk_mel(preset, n, 1.0, np.random.default_rng(n))
    chunk_ms = timed(device, lambda: enc.encode(seqs, [history] * n, mel, mask), repeats)  # ends in a download
    return {"sessions": n, "history_s": history_s, "attention": enc.attention.name, "chunk_ms": chunk_ms,
            "attention_fallbacks": getattr(enc.attention, "fallbacks", []),
            "pool_gib": enc.pool.nbytes / 2**30, "block_size": enc.pool.shape.block_size,
            "peak_allocated_gib": peak_gib(device)}


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

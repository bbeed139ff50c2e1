"""Memory per stage at a preset's dimensions: weights, and KV bytes one session holds after 1, 60, 300 s.

Weights are counted from the modules built on the meta device (no memory, so the real dimensions
count on any machine). KV is computed on paper from the dims and the duplex loop's token rates:
- LLM: per second `<unit>` + 10 audio tokens + `<|listen|>` + `</unit>` when listening, plus up to
  `max_new_speak_tokens_per_chunk` text tokens when speaking; capped at `context_tokens`.
- TTS: one spoken turn's cache: per spoken second up to that many text conditions + audio_bos + 25 codes;
  reset at each turn's end (a session that talks the whole time is the bound).
- Audio encoder: the streaming Whisper cache: 50 positions per second, reset at
  `max_positions` (1500 = 30 s).
"""

from __future__ import annotations

import torch

from minicpmo_triton.model_config import SPEECH_TOKENS_PER_SECOND, DecoderDims, PresetConfig
from minicpmo_triton.stages.tts import tts_admit_tokens

SECONDS = (1, 60, 300)
FP32, BF16, FP8 = 4, 2, 1
POOL_SESSIONS = (32, 128, 256, 512)
POOL_SECONDS = (60, 300)
SPEAKING = 0.3  # the share of sessions speaking at a time, for the pool's size
WHISPER_FRAMES_PER_SECOND = 50


def parameter_counts(preset: PresetConfig) -> dict[str, int]:
    from .stages import build_modules

    with torch.device("meta"):
        modules = build_modules(preset, seed=0)
    return {name: sum(p.numel() for p in m.parameters()) for name, m in modules.items()}


def _kv_per_token(d: DecoderDims, dtype_bytes: int) -> int:
    return 2 * d.layers * d.kv_heads * d.head_dim * dtype_bytes  # keys and values


def kv_bytes(preset: PresetConfig, seconds: float, speaking: bool, dtype_bytes: int = FP32) -> dict[str, int]:
    dx = preset.duplex
    llm_per_s = 3 + preset.audio_tokens_per_second + (dx.max_new_speak_tokens_per_chunk if speaking else 0)
    llm_tokens = min(int(llm_per_s * seconds), dx.context_tokens)
    tts_tokens = int((dx.max_new_speak_tokens_per_chunk + 1 + SPEECH_TOKENS_PER_SECOND) * seconds) if speaking else 0
    a = preset.audio
    whisper_positions = min(int(WHISPER_FRAMES_PER_SECOND * seconds), a.max_positions)
    return {
        "llm": llm_tokens * _kv_per_token(preset.llm, dtype_bytes),
        "tts": tts_tokens * _kv_per_token(preset.tts.decoder, dtype_bytes),
        "audio_encoder": whisper_positions * 2 * a.layers * a.d_model * dtype_bytes,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def memory_report(preset: PresetConfig) -> str:
    counts = parameter_counts(preset)
    lines = [f"memory at {preset.name} dimensions (weights counted from the modules; KV on paper):",
             f"  {'stage':16s} {'params':>14s} {'fp32 MiB':>11s} {'bf16 MiB':>11s}"]
    for name, n in counts.items():
        lines.append(f"  {name:16s} {n:14,d} {_mib(n * FP32):>11s} {_mib(n * BF16):>11s}")
    total = sum(counts.values())
    lines.append(f"  {'total':16s} {total:14,d} {_mib(total * FP32):>11s} {_mib(total * BF16):>11s}")
    lines.append("  KV per session, fp32 MiB (bf16: half), listening / speaking the whole time:")
    lines.append(f"  {'stage':16s} " + " ".join(f"{f'{s} s':>17s}" for s in SECONDS))
    rows = {s: (kv_bytes(preset, s, False), kv_bytes(preset, s, True)) for s in SECONDS}
    for stage in ("llm", "tts", "audio_encoder"):
        cells = [f"{_mib(rows[s][0][stage])} / {_mib(rows[s][1][stage])}" for s in SECONDS]
        lines.append(f"  {stage:16s} " + " ".join(f"{c:>17s}" for c in cells))
    lines.append("  (token2wav's stream caches: Step-Audio2 flow + HiFT; vision: none kept)")
    lines.extend(pool_report(preset))
    return "\n".join(lines)


def pool_bytes(preset: PresetConfig, sessions: int, seconds: float, dtype_bytes: int, stage: str = "llm") -> int:
    """The `stage`'s (llm, tts, audio_encoder) KV pool for `sessions` sessions `seconds` in, SPEAKING of them
    speaking the whole time (for the TTS: one turn that long, its bound; a listening session holds its admission
    room)."""
    speaking = round(sessions * SPEAKING)
    if stage == "tts":
        listening = tts_admit_tokens(preset) * _kv_per_token(preset.tts.decoder, dtype_bytes)
    else:
        listening = kv_bytes(preset, seconds, False, dtype_bytes)[stage]
    return speaking * kv_bytes(preset, seconds, True, dtype_bytes)[stage] + (sessions - speaking) * listening


def pool_report(preset: PresetConfig) -> list[str]:
    """The pools the paged engines need (`kv_pool_size`, `tts_pool_size`, `audio_pool_size`), bf16 and fp8 KV
    (the Whisper's restarts at `max_positions`: 30 s of frames is its bound, listening or speaking)."""
    lines = []
    for stage, name in (("llm", "LLM"), ("tts", "TTS"), ("audio_encoder", "Whisper")):
        lines += [f"  {name} KV pool for N sessions ({SPEAKING:.0%} speaking), GiB bf16 / fp8:",
                  f"  {'sessions':16s} " + " ".join(f"{f'{s} s':>17s}" for s in POOL_SECONDS)]
        for n in POOL_SESSIONS:
            cells = [f"{pool_bytes(preset, n, s, BF16, stage) / 2**30:,.2f} / "
                     f"{pool_bytes(preset, n, s, FP8, stage) / 2**30:,.2f}" for s in POOL_SECONDS]
            lines.append(f"  {n:<16d} " + " ".join(f"{c:>17s}" for c in cells))
    return lines

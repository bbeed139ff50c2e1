"""Every setting of the Triton models, written down once: its key, default, the models that read it, and what it
does. Each model's `config.pbtxt` carries the same value under `parameters` (`tests/test_settings.py` keeps the
two equal), and `MINICPMO_<KEY>` in tritonserver's environment overrides it, for every key alike.
The table in docs/settings.md is printed from here (`python -m minicpmo_triton.serving.stage_settings`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..model_config import DuplexDefaults

ENV_PREFIX = "MINICPMO_"
STATEFUL = ("duplex", "llm", "tts", "token2wav")  # the models that keep state per sequence
ENGINES = ("audio_encoder", "vision_encoder", "llm", "tts", "token2wav")  # the models that run an engine
_D = DuplexDefaults()
POOL_SHARE = ("GB when > 1 (an explicit size), else that share of the pools' budget: the device's memory less every "
              "stage's weights and workspace and a margin, whatever order the models load in (engine/memory_plan.py; "
              "CPU: of 8 GB)")


@dataclass(frozen=True)
class StageSetting:
    key: str
    default: str  # as config.pbtxt writes it
    kind: Callable[[str], float | int | str]
    models: tuple[str, ...]
    doc: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()


STAGE_SETTINGS: dict[str, StageSetting] = {s.key: s for s in (
    StageSetting("state_ttl_s", "600", float, STATEFUL,
                 "a sequence's state idle this long is evicted (its session is gone without an END)"),
    StageSetting("sweep_period_s", "5", float, STATEFUL,
                 "how often idle state is swept and the live-sequence gauge published"),
    StageSetting("ort_threads", "1", int, ENGINES, "onnxruntime intra-op threads per model instance"),
    StageSetting("llm_engine", "auto", str, ("llm",),
                 "auto (the device engine on a GPU instance, ONNX on the CPU), paged (the device engine) or onnx; "
                 "the duplex model's door before the LLM stands aside when it resolves to the device engine"),
    StageSetting("kv_pool_size", "0.65", float, ("llm",),
                 "the device engine's KV pool: " + POOL_SHARE),
    StageSetting("kv_dtype", "auto", str, ("llm",),
                 "the device engine's KV: auto (bf16 on a GPU, fp32 on the CPU) or fp8"),
    StageSetting("audio_engine", "auto", str, ("llm",),
                 "the duplex audio stream's Whisper (encoded in the llm model): auto (its KV cache in a pool on "
                 "a GPU instance, the stream.onnx graph on the CPU), paged or onnx"),
    StageSetting("audio_pool_size", "0.15", float, ("llm",),
                 "the device Whisper's KV pool: " + POOL_SHARE),
    StageSetting("tts_engine", "auto", str, ("tts", "llm"),
                 "auto (the device engine on a GPU instance, ONNX on the CPU), paged (the device engine) or onnx"),
    StageSetting("tts_in_llm", "auto", str, ("llm", "duplex", "tts"),
                 "the llm model runs the TTS's engine core too, so a speaking step's text and speech codes come from "
                 "one request (its hidden rows stay on the device, no tts hop, no tts queue delay) and every other "
                 "use of the TTS goes there (the tts model loads nothing: one TTS pool per GPU): auto (when "
                 "llm_engine and tts_engine both resolve to the device engine), 1 (needs llm_engine paged) or 0"),
    StageSetting("token2wav_in_llm", "auto", str, ("llm", "duplex", "token2wav"),
                 "the llm model runs token2wav too (its stage_engine path: the device streamer and its engine thread, "
                 "or the host path), so a speaking step's one request answers its text, then its audio (the codes "
                 "never leave the process) and the token2wav model loads nothing: auto (where tts_in_llm is on and "
                 "token2wav's stage_engine resolves to the device), 1 (needs tts_in_llm) or 0"),
    StageSetting("tts_pool_size", "0.15", float, ("tts", "llm"),
                 "the device TTS's KV pool: " + POOL_SHARE),
    StageSetting("engine_rows", "256", int, ("llm", "tts"),
                 "the device engine's persistent batch: rows decoding at once (its largest CUDA graph bucket)"),
    StageSetting("engine_graphs", "1", int, ("llm", "tts"),
                 "the device engine's decode step replayed as CUDA graphs per batch bucket (0: eager; the CPU: eager)"),
    StageSetting("engine_overlap", "1", int, ("llm", "tts"),
                 "the device engine launches an iteration before reading the previous one's tokens (0: one by one)"),
    StageSetting("engine_compile", "1", int, ("llm", "tts"),
                 "the device engines' layers and flex attention torch.compile'd on a GPU (0: eager)"),
    StageSetting("tts_top_k", str(_D.tts_top_k), int, ("tts", "llm"),
                 "the TTS's speech codes from its k likeliest only (0: off, as MiniCPM-o's own generate_chunk, "
                 "which builds the warper and never applies it)"),
    StageSetting("tts_top_p", str(_D.tts_top_p), float, ("tts", "llm"),
                 "... and from the likeliest whose probabilities reach p (1.0: off, as the reference; "
                 "vllm-omni applies top-k 20 / top-p 0.7)"),
    StageSetting("admit_tokens", "1024", int, ("llm",),
                 "the pool room a new session needs; refused with pool_full (retryable) when there is less"),
    StageSetting("stage_engine", "auto", str, ("token2wav", "vision_encoder", "audio_encoder"),
                 "auto (on a GPU instance the device path: token2wav's batched ring-cache path in torch, the encoders' "
                 "TensorRT bf16 plans, built at first load and kept by hash; ONNX Runtime on a CPU instance), device "
                 "(the device path on the instance's device: token2wav's in torch on the CPU too) or onnx; a GPU "
                 "instance that cannot reach its GPU refuses to load (device_unavailable, on /health)"),
    StageSetting("token2wav_slots", "64", int, ("token2wav",),
                 "the device path: turns speaking at once per instance (a slot each, its caches preallocated; a "
                 "turn's first chunk waits while all are taken)"),
    StageSetting("token2wav_cache_dtype", "auto", str, ("token2wav",),
                 "the device path's flow caches: auto (bf16 on a GPU, fp32 on the CPU), bf16 or fp32"),
    StageSetting("voice_prompt_cache_mb", "2048", float, ("token2wav",),
                 "voice prompts (their flow caches) kept for reuse across sessions, in MiB"),
    StageSetting("voice_prep_queue", "8", int, ("token2wav",),
                 "new voice prompts waiting or being prepared at once, across sessions; past it a new reference "
                 "is refused queue_full (retryable)"),
    StageSetting("llm_gather_ms", "10", float, ("duplex",),
                 "steps in flight wait up to this long for each other before the LLM, so they batch"),
    StageSetting("prefill_chunk_tokens", "128", int, ("duplex",),
                 "a longer LLM prefill (prompt, history, voice prompt) goes in chunks of at most this many tokens, "
                 "other sessions' steps between them (0: never split)"),
    StageSetting("llm_batch_target", "8", int, ("duplex",),
                 "mid load, the first step at the LLM holds the door until this many wait ..."),
    StageSetting("llm_batch_window_ms", "250", float, ("duplex",),
                 "... or for at most this long (0: never holds)"),
    StageSetting("llm_batch_min_sessions", "24", int, ("duplex",),
                 "the door is held only with at least this many live sessions ..."),
    StageSetting("llm_batch_max_sessions", "40", int, ("duplex",),
                 "... and at most this many (above, the queues batch by themselves)"),
    StageSetting("llm_batch_budget_ms", "500", float, ("duplex",),
                 "... and only while recent steps' p90 time to first event plus the hold fits in this"),
    StageSetting("bls_threads", "256", int, ("duplex",),
                 "threads for the BLS calls in flight, all sessions together"),
    StageSetting("voices_dir", "", str, ("duplex",),
                 "named voices: `<voices_dir>/<name>.wav` (empty: none)"),
    StageSetting("otlp_endpoint", "", str, ("duplex",),
                 "an OTLP/HTTP collector (http://host:4318) for the spans of the steps the gateway traces; the "
                 "gateway's MINICPMO_OTLP_ENDPOINT, in tritonserver's environment (empty: none)"),
)}


def stage_setting(key: str, params: Mapping[str, str], env: Mapping[str, str] = os.environ) -> float | int | str:
    """A model's setting: MINICPMO_<KEY> when set (non-empty), else its config.pbtxt parameter, else the default."""
    s = STAGE_SETTINGS[key]
    raw = env.get(s.env) or params.get(key, s.default)
    return s.kind(raw)


def markdown_table() -> str:
    rows = ["| parameter (config.pbtxt) | environment | default | models | what it does |",
            "|---|---|---|---|---|"]
    rows += [f"| `{s.key}` | `{s.env}` | {s.default or '(empty)'} | {', '.join(s.models)} | {s.doc} |"
             for s in STAGE_SETTINGS.values()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())

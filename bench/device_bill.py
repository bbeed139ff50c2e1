"""The device work of one engine forward as a roofline bill: FLOPs and bytes counted over the decoders' formulas
(`engine/traffic.py`), seconds at NVIDIA's published H200 peaks derated to what kernels commonly reach. Shared by
bench/gpu_projection.py (the whole step's projection) and bench/engine_host.py (the host's time beside the GPU's)."""

from __future__ import annotations

from dataclasses import dataclass

from minicpmo_triton.engine.traffic import layer_flops_per_token, layer_weight_count
from minicpmo_triton.model_config import DecoderDims, PresetConfig

PEAK_BW = 4.8e12  # bytes/s, H200 HBM3e (published)
PEAK_FLOPS = 989e12  # bf16 dense, H200 SXM (published)
BW_EFF, FLOPS_EFF = 0.75, 0.5
HISTORY = 780  # LLM tokens a session holds 60 s in: <unit>, 10 audio, <|listen|>, </unit> a second
WHISPER_FRAMES = 50  # a 1 s chunk's encoder frames
WHISPER_HISTORY = 750  # the frames a session's stream holds on average (it restarts at 1500)
BF16 = 2
SAMPLER_PASSES = 10  # the LLM's rules and draws read the logits about this many times (fp32 and fp64 passes)


@dataclass
class Bill:
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Bill) -> Bill:
        return Bill(self.flops + other.flops, self.bytes + other.bytes)


def roofline(bill: Bill) -> float:
    """Seconds on the H200, derated."""
    return max(bill.flops / (PEAK_FLOPS * FLOPS_EFF), bill.bytes / (PEAK_BW * BW_EFF))


def _kv_token(d: DecoderDims, dtype: int) -> int:
    return 2 * d.layers * d.kv_heads * d.head_dim * dtype


def forward_bill(d: DecoderDims, rows: int, tokens: int, history: int, dtype: int, head: int = 0,
                 sampler: int = 0) -> Bill:
    """A forward of `rows` rows bringing `tokens` new tokens in all over `history` tokens each: the weights once,
    each row's KV read once, the new KV written; `head` rows through a head of `sampler` columns (read by the
    rules' passes)."""
    if not rows:
        return Bill()
    attention = 4 * d.layers * d.heads * d.head_dim * (history * tokens)
    flops = tokens * layer_flops_per_token(d) + attention + 2 * head * d.hidden * sampler
    weights = layer_weight_count(d) * dtype + (sampler * d.hidden * dtype if head else 0)
    kv = rows * history * _kv_token(d, dtype) + tokens * _kv_token(d, dtype)
    return Bill(flops, weights + kv + head * sampler * 4 * SAMPLER_PASSES)


def decode_bill(d: DecoderDims, rows: int, history: int, dtype: int) -> Bill:
    """One LLM decode iteration: every row one token, its logits through the rules."""
    return forward_bill(d, rows, rows, history, dtype, head=rows, sampler=d.vocab)


def whisper_bill(preset: PresetConfig, chunks: int) -> Bill:
    a = preset.audio
    if not chunks:
        return Bill()
    per_frame = 2 * a.layers * (4 * a.d_model**2 + 2 * a.d_model * a.ffn)
    attention = 4 * a.layers * a.d_model * WHISPER_HISTORY * WHISPER_FRAMES
    weights = a.layers * (4 * a.d_model**2 + 2 * a.d_model * a.ffn) * BF16
    kv = chunks * (WHISPER_HISTORY + WHISPER_FRAMES) * 2 * a.layers * a.d_model * BF16
    return Bill(chunks * (WHISPER_FRAMES * per_frame + attention), weights + kv)

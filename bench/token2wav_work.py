"""token2wav's device work per speaking chunk (25 tokens: 1 s of speech) of one session, at MiniCPM-o 4.5's
published dims: FLOPs (counted by torch's FlopCounterMode over the modules themselves, on meta tensors: shapes
only, no math), the bytes its attention reads and writes of the caches, the weights an iteration reads (shared by
every session in it), and what crosses between host and device (the device path's: tokens and key lists up,
HiFT's noise up, the audio down).

`chunk_work(d, voice_frames)` is the one count of it: bench/gpu_projection.py bills token2wav's chunks with it.

    python -m bench.token2wav_work [--voice-s 10]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from export.modules.stepaudio2 import load_flow_yaml
from export.modules.token2wav import ConformerChunk, EstimatorStep, flow_yaml
from export.presets import minicpmo45
from minicpmo_triton.model_config import Token2WavDims
from minicpmo_triton.vocoder.hift import VocoderChunk, build_hift, fold_weight_norm

SAMPLES_PER_FRAME = 480
HARMONICS = 9  # HiFT's source: the fundamental and 8 overtones (its noise input per sample)


@dataclass(frozen=True)
class ChunkWork:
    """One session's speaking chunk on the device path."""

    flops: dict[str, float] = field(default_factory=dict)  # by part: conformer, estimator (5 steps), vocoder
    weight_bytes: float = 0.0  # flow + HiFT weights, held once, shared by every session
    weight_reads: float = 0.0  # what an iteration reads of them, once for every session in it (the estimator's at
    # each of its Euler steps)
    cache_read: float = 0.0  # keys/values its attention reads (the voice's kept frames and its own), all layers
    cache_written: float = 0.0  # the chunk's new keys/values
    host_bytes: float = 0.0  # host <-> device

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())


def _kept(voice_frames: int, tail: int) -> int:
    """Mel frames an attention cache holds in a turn's steady state: the voice's frames and 100 more (the
    conformer: the prompt + the last 100; the estimator: the newest `voice_frames` + the oldest 100)."""
    return voice_frames + tail


def chunk_work(d: Token2WavDims | None = None, voice_frames: int = 500, cache_bytes: int = 2,
               weight_bytes: int = 2) -> ChunkWork:
    """A whole chunk (25 tokens + 3 lookahead -> 50 mel frames) of one session in a turn's steady state, its voice
    `voice_frames` mel frames long (500: a 10 s reference), caches and weights in bf16 (2 bytes)."""
    d = d or minicpmo45().token2wav
    n_tok = d.chunk_tokens
    n = 2 * n_tok
    kept = _kept(voice_frames, d.cache_tail_frames)
    # built on the CPU (some official modules make tensors there whatever the default device), then shapes only
    hift = fold_weight_norm(build_hift(d))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "flow.yaml").write_text(flow_yaml(d))
        flow = load_flow_yaml(Path(tmp) / "flow.yaml")
    count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    weights = (count(flow) + count(hift)) * weight_bytes
    reads = weights + (d.n_timesteps - 1) * count(flow.decoder) * weight_bytes
    mods = {"conformer": ConformerChunk(flow).eval().to("meta"), "estimator": EstimatorStep(flow).eval().to("meta"),
            "vocoder": VocoderChunk(hift).eval().to("meta")}
    with torch.device("meta"):
        dk, hd = 2 * d.channels // d.heads, 2 * d.dit_head_dim
        enc_in = {"tokens": torch.zeros(1, n_tok + d.lookahead, dtype=torch.int64), "n_real": torch.tensor([28]),
                  "cnn_cache": torch.zeros(1, d.channels, 6), "cache_len": torch.tensor([kept // 2]),
                  "token_cache": torch.zeros(d.num_blocks, 1, d.heads, kept // 2, dk),
                  "mel_cache": torch.zeros(d.num_up_blocks, 1, d.heads, kept, dk)}
        est_in = {"x": torch.zeros(1, d.n_mels, n), "mu": torch.zeros(1, d.n_mels, n), "t": torch.zeros(1),
                  "spk": torch.zeros(1, d.n_mels), "cond": torch.zeros(1, d.n_mels, n),
                  "cnn_cache": torch.zeros(d.dit_depth, 2, 2 * d.dit_hidden, 2),
                  "att_cache": torch.zeros(d.dit_depth, 2, d.dit_heads, kept, hd), "cache_len": torch.tensor([kept])}
        frames = n + d.mel_cache_frames
        voc_in = {"mel": torch.zeros(1, d.n_mels, frames), "cache_source": torch.zeros(1, 1, d.source_cache_samples),
                  "cache_len": torch.tensor([d.source_cache_samples]), "rand_ini": torch.zeros(1, HARMONICS),
                  "sine_noise": torch.zeros(1, frames * SAMPLES_PER_FRAME, HARMONICS)}
        flops = {}
        for name, inputs, times in (("conformer", enc_in, 1), ("estimator", est_in, d.n_timesteps),
                                    ("vocoder", voc_in, 1)):
            counter = FlopCounterMode(display=False)
            with counter, torch.inference_mode(), torch.device("meta"):
                mods[name](**inputs)
            flops[name] = float(counter.get_total_flops()) * times
    # caches: the conformer's token- and mel-rate layers, the estimator's 5 steps x depth x 2 guidance rows
    conformer_frame = (d.num_blocks / 2 + d.num_up_blocks) * d.heads * dk * cache_bytes  # per mel frame
    estimator_frame = d.n_timesteps * d.dit_depth * 2 * d.dit_heads * hd * cache_bytes
    read = kept * (conformer_frame + estimator_frame) + n * (conformer_frame + estimator_frame)
    written = n * (conformer_frame + estimator_frame)
    ids = 8 * (kept // 2 + kept + kept + 3 * n)  # the rows' key lists and new frames' ids (int64), per cache
    host = (8 * (n_tok + d.lookahead) + ids + kept * 3 + 4 * d.n_mels  # tokens, ids, masks, the voice vector
            + 4 * frames * SAMPLES_PER_FRAME * HARMONICS  # HiFT's noise (1.0.5's path)
            + 4 * n * SAMPLES_PER_FRAME)  # the audio back
    return ChunkWork(flops, float(weights), float(reads), float(read), float(written), float(host))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--voice-s", type=float, default=10.0, help="the voice reference's length (25 tokens/s)")
    args = parser.parse_args(argv)
    w = chunk_work(voice_frames=int(50 * args.voice_s))
    print(f"token2wav at MiniCPM-o 4.5's dims, one session's 1 s speaking chunk, a {args.voice_s:g} s voice:")
    print("| part | GFLOP |\n|---|---:|")
    for name, f in w.flops.items():
        print(f"| {name} | {f / 1e9:.1f} |")
    print(f"| total | {w.total_flops / 1e9:.1f} |")
    print(f"weights {w.weight_bytes / 2**20:.0f} MiB, {w.weight_reads / 2**20:.0f} MiB read an iteration; caches "
          f"read {w.cache_read / 2**20:.1f} MiB, written {w.cache_written / 2**20:.1f} MiB; host<->device "
          f"{w.host_bytes / 2**20:.2f} MiB per session and chunk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A PROJECTION, not a measurement: how many duplex sessions one H200 serves with a speaking step's p95 under its
1 s period, the whole step counted (the streaming Whisper, the LLM, the TTS and token2wav on one GPU).

A discrete-event simulation of the device engine's loop, second after second: N sessions, each sending its second at
its own offset in the second (staggered arrivals, uniform), 30% of the steps speaking. An arriving step is encoded
(Whisper: its 1 s chunk over up to 30 s of frames), prefilled into the LLM (12 tokens over 60 s of history) and
decodes: a listening step 1 token, a speaking step 20 (its chunk's budget); a spoken chunk then goes to the TTS
(its condition, 11 positions, then 26 codes, one an iteration) and its 25 codes to token2wav (one 1 s chunk: the
flow's conformer over 28 tokens, 5 Euler steps of the DiT estimator with guidance, HiFT over 58 mel frames). Each
loop iteration runs every engine's work at hand: the Whisper chunks and LLM prefills of the steps that arrived, one
LLM decode iteration of every decoding row, one TTS iteration, the token2wav chunks ready. A speaking step's latency
is its arrival to its audio's end.

Device time per piece of work: a roofline from counted work at NVIDIA's published H200 peaks (HBM3e 4.8 TB/s, bf16
dense 989 TFLOP/s) derated to what kernels commonly reach (75% / 50%): max(FLOPs / compute, bytes / bandwidth), the
bytes each forward's weights read once and each row's KV read (`engine/traffic.py`'s `Work` formulas), the samplers'
passes over the logits; token2wav's work per chunk as `bench/token2wav_work.chunk_work` counts it (FLOPs counted
over its modules at the real widths, a 3 s voice; its weights read once an iteration, the estimator's at each
step; each chunk's cache reads and writes). An iteration's wall time is the larger of its device time and the host's
work per iteration (overlap: the next iteration is launched before this one's tokens are read), plus each CUDA
graph's replay launch. The host's work per iteration is MEASURED on this machine by `bench/engine_host.py`'s after
path (the engine core's step, the decode step's replay stubbed) at 32 / 128 / 256 rows, interpolated, plus each
step admitted in the iteration: its request's host work and its second's mel's host share (the stream's bookkeeping
and the samples it stages; the FFT runs on the device: engine/mel.py), both measured (`engine_host.admission_ms`),
on the engine thread; the graphs' replay is a constant
(`REPLAY_S`, labelled, not measured here: no GPU). Memory: the weights and every pool at 60 s of history within
90% of HBM. Triton's hops are not counted: the LLM's rows go to the TTS inside the llm model's process
(`tts_in_llm`), as the loop here has them; the BLS hops left (the llm call, token2wav's) cost host time outside the
engines' loop, not device time.

    python -m bench.gpu_projection [--sessions 64 128 192 256 320 384 512] [--host-ms 32:x,128:y,256:z]

Last line: `sessions per H200 (whole step, speaking p95 < 1 s): N`.
"""

from __future__ import annotations

import argparse
import heapq
from dataclasses import dataclass, field

import numpy as np

from bench.device_bill import (
    BF16,
    BW_EFF,
    FLOPS_EFF,
    HISTORY,
    PEAK_BW,
    PEAK_FLOPS,
    Bill,
    decode_bill,
    forward_bill,
    roofline,
    whisper_bill,
)
from bench.token2wav_work import ChunkWork, chunk_work
from export.memory import pool_bytes
from export.presets import minicpmo45
from minicpmo_triton.model_config import PresetConfig

REPLAY_S = 30e-6  # one CUDA graph's replay launch (assumed: no GPU measured it here)
HBM_GIB = 141
CHUNK = 12  # an LLM step's prefill: the last chunk's terminator + </unit>, <unit>, 10 audio placeholders
SPEAK_TOKENS = 20  # a speaking chunk's budget
SPEAKING = 0.3
TTS_CONDITION = 11  # 10 text tokens with their hidden states, then audio_bos
TTS_CODES = 26  # 25 kept and the one `generate_chunk` drops
TTS_HISTORY = 8 * (TTS_CONDITION + TTS_CODES)  # a speaking session 8 chunks into its turn
VOICE_FRAMES = 150  # token2wav's voice prompt: a 3 s reference (its kept frames are what each chunk attends to)
SECONDS = 6  # simulated; the first two are the warm-up (their steps are not counted)


@dataclass
class Token2Wav:
    """token2wav's work per speaking chunk, as `bench/token2wav_work.chunk_work` counts it (the one definition):
    FLOPs by FlopCounterMode over its modules at the real widths, its weights' reads per iteration (shared by the
    chunks in it), each chunk's cache reads and writes."""

    work: ChunkWork

    @classmethod
    def of(cls, preset: PresetConfig) -> Token2Wav:
        return cls(chunk_work(preset.token2wav, VOICE_FRAMES, cache_bytes=BF16, weight_bytes=BF16))

    def bill(self, chunks: int) -> Bill:
        """`chunks` 1 s chunks in one iteration: the conformer over 28 tokens, 5 Euler steps x 2 (guidance) of the
        DiT over the voice's kept frames, its cache and the chunk's 50 frames, HiFT over 58 mel frames."""
        if not chunks:
            return Bill()
        w = self.work
        return Bill(chunks * w.total_flops, w.weight_reads + chunks * (w.cache_read + w.cache_written))


@dataclass(order=True)
class Step:
    arrival: float
    session: int = field(compare=False)
    speaking: bool = field(compare=False)
    llm_left: int = field(default=0, compare=False)
    tts_left: int = field(default=0, compare=False)


class HostCost:
    """The host's work per iteration, interpolated over the rows decoding (measured points), plus each arriving
    step's admission (its request's host work and its second's mel, on the host today: both measured)."""

    def __init__(self, points: dict[int, float], per_arrival_ms: float) -> None:
        self.rows = sorted(points)
        self.ms = [points[r] for r in self.rows]
        self.per_arrival_ms = per_arrival_ms

    def __call__(self, rows: int, arrivals: int) -> float:
        return (float(np.interp(rows, self.rows, self.ms)) + arrivals * self.per_arrival_ms) / 1000


def simulate(preset: PresetConfig, sessions: int, host: HostCost, t2w: Token2Wav, seed: int = 0) -> dict[str, float]:
    """The engine loop over `SECONDS` seconds of `sessions` sessions; speaking steps' latency from the third second."""
    rng = np.random.default_rng(seed)
    offsets = rng.random(sessions)
    arrivals = [Step(second + offsets[s], s, bool(rng.random() < SPEAKING))
                for second in range(SECONDS) for s in range(sessions)]
    heapq.heapify(arrivals)
    d, td, codes = preset.llm, preset.tts.decoder, preset.tts.num_audio_tokens
    llm_rows: list[Step] = []  # decoding (past their prefill)
    tts_next: list[Step] = []  # their text whole: the TTS's condition next iteration
    tts_rows: list[Step] = []  # decoding codes
    t2w_next: list[Step] = []  # their codes whole: token2wav next iteration
    latencies: list[float] = []
    t, iterations, busy = 0.0, 0, 0.0
    while arrivals or llm_rows or tts_next or tts_rows or t2w_next:
        if not (llm_rows or tts_next or tts_rows or t2w_next) and arrivals[0].arrival > t:
            t = arrivals[0].arrival  # idle until the next step arrives
        new = []
        while arrivals and arrivals[0].arrival <= t:
            new.append(heapq.heappop(arrivals))
        device = (whisper_bill(preset, len(new))
                  + forward_bill(d, len(new), len(new) * CHUNK, HISTORY, BF16, head=len(new), sampler=d.vocab)
                  + decode_bill(d, len(llm_rows), HISTORY, BF16)
                  + forward_bill(td, len(tts_next), len(tts_next) * TTS_CONDITION, TTS_HISTORY, BF16,
                                 head=len(tts_next), sampler=codes)
                  + forward_bill(td, len(tts_rows), len(tts_rows), TTS_HISTORY, BF16, head=len(tts_rows),
                                 sampler=codes)
                  + t2w.bill(len(t2w_next)))
        graphs = 2 * REPLAY_S  # the LLM's and the TTS's decode graphs
        t += max(roofline(device), host(len(llm_rows) + len(tts_rows), len(new))) + graphs
        busy += roofline(device)
        iterations += 1
        latencies += [t - s.arrival for s in t2w_next if s.arrival >= 2]  # the audio is out: past the warm-up
        for s in new:  # the prefill chose the first token
            s.llm_left = (SPEAK_TOKENS if s.speaking else 1) - 1
        for s in llm_rows:
            s.llm_left -= 1
        for s in tts_next:  # the condition chose the first code
            s.tts_left = TTS_CODES - 1
        for s in tts_rows:
            s.tts_left -= 1
        decoding = llm_rows + new
        t2w_next = [s for s in tts_rows if s.tts_left == 0]
        tts_rows = [s for s in tts_rows + tts_next if s.tts_left > 0]
        tts_next = [s for s in decoding if s.llm_left == 0 and s.speaking]
        llm_rows = [s for s in decoding if s.llm_left > 0]
    lat = np.array(latencies) if latencies else np.array([0.0])
    return {"sessions": sessions, "iterations_per_s": iterations / t, "device_busy": busy / t,
            "speaking_p50_ms": float(np.percentile(lat, 50)) * 1000,
            "speaking_p95_ms": float(np.percentile(lat, 95)) * 1000}


def memory_gib(preset: PresetConfig, sessions: int) -> float:
    from export.memory import parameter_counts

    counts = parameter_counts(preset)
    weights = sum(counts[s] for s in ("audio_encoder", "llm", "tts", "token2wav")) * BF16
    pools = sum(pool_bytes(preset, sessions, 60, BF16, stage) for stage in ("llm", "tts", "audio_encoder"))
    return (weights + pools) / 2**30


def measured_host() -> tuple[dict[int, float], dict[str, float]]:
    """The engine core's host work per iteration on this machine (bench/engine_host.py's after path), and per
    admitted step (its request; its second's mel)."""
    import torch

    from bench.engine_host import admission_ms, after

    torch.set_num_threads(1)
    token = 97
    return {rows: after(rows, 8, token, eager=False)["ms"] for rows in (32, 128, 256)}, admission_ms()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[64, 128, 192, 256, 320, 384, 512])
    parser.add_argument("--host-ms", default="", help="rows:ms,... instead of measuring (bench/engine_host.py)")
    parser.add_argument("--arrival-ms", type=float, default=-1.0, help="host ms per admitted step instead of "
                        "measuring (its request and its mel)")
    args = parser.parse_args(argv)
    preset = minicpmo45()
    if args.host_ms:
        points = {int(k): float(v) for k, v in (p.split(":") for p in args.host_ms.split(","))}
        admission = {"request_ms": max(args.arrival_ms, 0.0), "mel_ms": 0.0}
    else:
        points, admission = measured_host()
    host = HostCost(points, admission["request_ms"] + admission["mel_ms"])
    t2w = Token2Wav.of(preset)
    print("PROJECTION (not a measurement): one H200, MiniCPM-o 4.5's dims, bf16; the whole duplex step (Whisper, LLM, "
          f"TTS, token2wav) from counted work at {PEAK_BW / 1e12} TB/s x {BW_EFF:.0%} and {PEAK_FLOPS / 1e12:.0f} "
          f"TFLOP/s x {FLOPS_EFF:.0%}; staggered arrivals, {SPEAKING:.0%} of the steps speaking")
    print("host ms per iteration, MEASURED on this CPU (engine core, decode step's replay stubbed): "
          + ", ".join(f"{r} rows {ms:.2f}" for r, ms in sorted(points.items()))
          + f"; per admitted step: its request {admission['request_ms']:.2f} + its mel's host share "
          f"{admission['mel_ms']:.2f}; CUDA graph replay {REPLAY_S * 1e6:.0f} us each (ASSUMED)")
    print(f"{'sessions':>8} {'iter/s':>7} {'GPU busy':>9} {'speak p50 ms':>13} {'speak p95 ms':>13} "
          f"{'memory GiB':>11} {'fits':>5}")
    best = 0
    for n in args.sessions:
        r = simulate(preset, n, host, t2w)
        mem = memory_gib(preset, n)
        fits = r["speaking_p95_ms"] < 1000 and mem < 0.9 * HBM_GIB
        best = max(best, n if fits else 0)
        print(f"{n:>8} {r['iterations_per_s']:>7.0f} {r['device_busy']:>9.0%} {r['speaking_p50_ms']:>13.0f} "
              f"{r['speaking_p95_ms']:>13.0f} {mem:>11.1f} {'yes' if fits else 'no':>5}", flush=True)
    print(f"sessions per H200 (whole step, speaking p95 < 1 s): {best}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

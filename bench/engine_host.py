"""Host work per decode iteration of the LLM's device engine, before and after the engine core, in one run.

What a GPU cannot hide is the host's share of an iteration: the scheduler, each row's rules and bookkeeping, the
staging of inputs, the sampler's launches, and the waits. Here the forward is replaced by a precomputed result (the
device's work is not measured: it is the roofline column), and everything else runs as served, at 32 / 128 / 256
rows all decoding (a duplex chunk each, sampled at the defaults, `tiny`'s tokenizer and rules):
- before: the paged engine this core replaced (`minicpmo_triton/paged` at git revision BEFORE_REV, exported with
  `git archive` and run in a subprocess): its loop's `decide` (each row's `RowPick` with its 512-token window and rng
  draws, ~10 uploads, the sampler's ops, the download, each row's `accept`); the forward returns precomputed logits. Its
  sampler's ops run here on the CPU at tiny's vocabulary (288): on a GPU they would be launches, and each of its
  syncs a drained queue, which no CPU run shows;
- after: `EngineCore.step` (schedule, launch, read the previous iteration's tokens, each row's `confirm`) with the
  decode step replaced by writing its precomputed (token, flags) into the output buffer, as a CUDA graph's replay
  would leave them (labelled: on a GPU the replay itself is one launch, ~10-30 us, not counted here); and `eager`:
  the decode step itself run eagerly at `tiny`'s dims on this CPU (host dispatch of every op, plus tiny's compute),
  what the host pays where no graph is captured.
Then a second table: the LLM's in-flight loop (`InflightLlm`) at `tiny`'s dims on this CPU, its rows decoding long
answers, while 8 new duplex seconds are admitted together (each one's mel and streaming Whisper on the device
engine, `audio_engine=paged`): the engine thread's wall ms per pass (admission + iteration) and the decoding rows'
iterations per second over the admission, before (the encoding on the engine thread, `off_thread=False`: what the
loop did before) and after (on the preparation thread), in one run.
Both sides' syncs per iteration are counted by the same ledger (engine/syncs.py), over one iteration after the
timed ones (its hooks cost time per op). The roofline: the decode
iteration's device time at MiniCPM-o 4.5's dims on an H200 (weights and each row's 60 s of KV read once, 75% of
4.8 TB/s; bf16, 50% of 989 TFLOP/s), what the host work hides behind with overlap.

    python -m bench.engine_host [--rows 32 128 256] [--iterations 12] [--main main] [--admitted 8]

Last line: `host ms per iteration at 128 rows: X (before: Y)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
BEFORE_REV = "d990554"  # the last commit with the paged engine the core replaced (minicpmo_triton/paged)
WARMUP = 2

# Run by the subprocess over main's tree (its own minicpmo_triton and export on sys.path first).
BEFORE = r'''
import json, statistics, sys, time
import numpy as np, torch
from export.presets import TINY_SEED, tiny
from export.stages import build_modules
from minicpmo_triton.paged.engine import Forward, PagedLlmEngine
from minicpmo_triton.paged.protocol import Prefill
from minicpmo_triton.stage_io import LlmRequest
from minicpmo_triton.stages.llm import LlmStage, _DeviceRows
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.tokenizer import load_tokenizer
from syncs_ledger import SyncLedger
rows, iterations, repo, token = json.loads(sys.argv[1])
torch.set_num_threads(1)
preset = tiny()
w = build_modules(preset, TINY_SEED)["llm"].state_dict()
eng = PagedLlmEngine.build(w, preset.llm, pool_size=0.05, attention="gather", max_tokens=8192, max_sessions=rows + 1)
stage = LlmStage(eng, preset, load_tokenizer(preset, repo + "/duplex/1"), 600.0)
items, decoders, params = [], [], []
for r in range(rows):
    call = StageCall(LlmRequest(input_ids=np.array([preset.tokens.unit], np.int64), max_new_tokens=40, seed=r + 1),
                     r + 1, start=True)
    sess = stage.enter(call)
    sess.history = list(np.random.default_rng(r).integers(32, 127, 600))
    pre, dec, par = stage.prepare(call.request, sess, np.zeros((0, preset.llm.hidden), np.float32))
    items.append((call.request, sess)); decoders.append(dec); params.append(par)
driver = _DeviceRows(stage, items, decoders, params, [[] for _ in items])
logits = torch.full((rows, preset.llm.vocab), -5.0)
logits[:, token] = 10.0
out = Forward(logits, torch.zeros(rows, preset.llm.hidden), list(range(rows)))
stamps, syncs = [], []
ledger = SyncLedger()
def forward(seqs, pasts, feeds):
    # timed without the ledger (its hooks cost per op); the last iteration counted with it
    stamps.append(time.perf_counter())
    if len(stamps) == iterations + 1:
        ledger.__enter__()
    if len(stamps) == iterations + 2:
        ledger.__exit__(None, None, None)
        syncs.append(ledger.total)
        raise StopIteration
    return Forward(out.logits[: len(seqs)], out.hidden[: len(seqs)], list(range(len(seqs))))
eng.forward = forward
seqs = [s.cache.seq for _, s in items]
try:
    eng.run(seqs, [0] * rows, [Prefill(np.array([preset.tokens.unit]), np.zeros((0, preset.llm.hidden), np.float32),
                                       np.zeros(1, bool)) for _ in items], driver)
except StopIteration:
    pass
gaps = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:iterations + 1])][2:]
print(json.dumps({"ms": statistics.median(gaps), "syncs": syncs[0]}))
'''


def before(rows: int, iterations: int, main: str, token: int) -> dict[str, float]:
    """The paged engine of `main`, in a subprocess over that tree (git archive of its minicpmo_triton and export)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", main, "minicpmo_triton", "export"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        (Path(tmp) / "syncs_ledger.py").write_text((ROOT / "minicpmo_triton" / "engine" / "syncs.py").read_text())
        out = subprocess.run([sys.executable, "-c", BEFORE, json.dumps([rows, iterations,
                                                                        str(ROOT / "model_repository"), token])],
                             cwd=tmp, env={"PYTHONPATH": tmp, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the before run failed: {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def _core(rows: int, admitted: list[float] | None = None) -> tuple[Any, Any]:
    """A core of `rows` decoding rows; `admitted`: each row's admission host ms appended."""
    from export.presets import TINY_SEED, tiny
    from export.stages import build_modules
    from minicpmo_triton.engine.protocol import PagedCache
    from minicpmo_triton.media.tokenizer import load_tokenizer
    from minicpmo_triton.stage_io import LlmRequest
    from minicpmo_triton.stages.base import StageCall
    from minicpmo_triton.stages.llm import LlmStage
    from minicpmo_triton.stages.pool_kv import llm_kv

    preset = tiny()
    tokenizer = load_tokenizer(preset, ROOT / "model_repository" / "duplex" / "1")
    kv = llm_kv(build_modules(preset, TINY_SEED)["llm"].state_dict(), preset, tokenizer, pool_size=0.05,
                attention="gather", rows=rows, max_sessions=rows + 1)
    stage = LlmStage(kv, preset, tokenizer, 600.0)
    unit = np.array([preset.tokens.unit] + [preset.tokens.audio_placeholder] * 10, np.int64)
    for r in range(rows):
        call = StageCall(LlmRequest(input_ids=unit, embeds=np.zeros((10, preset.llm.hidden), np.float32),
                                    max_new_tokens=40, seed=r + 1), r + 1, start=True)
        history = list(np.random.default_rng(r).integers(32, 127, 600))
        t0 = time.perf_counter()
        sess = stage.enter(call)
        assert sess is not None and isinstance(sess.cache, PagedCache)
        sess.history = history
        prefill, rules = stage.prepare(call.request, sess, call.request.embeds)
        kv.core.add(kv.request(r + 1, sess.cache, prefill, rules))
        if admitted is not None:
            admitted.append((time.perf_counter() - t0) * 1000)
    return kv.core, preset


def after(rows: int, iterations: int, token: int, eager: bool) -> dict[str, float]:
    from minicpmo_triton.engine.protocol import DREW_SECOND
    from minicpmo_triton.engine.syncs import SyncLedger

    core, _ = _core(rows)
    runner = core.runner
    if not eager:  # the decode step as its graph's replay leaves it: the chosen (token, flags) in the output buffer
        picks = torch.tensor([[token, DREW_SECOND]] * runner.capacity, dtype=torch.int64)

        def replayed(b: int, *_: Any) -> None:
            runner.state.out[:b].copy_(picks[:b])

        runner._decode = replayed
        # keep the device's rows live as the real step would (the host's rules decide when they end)
    core.step()
    times = []
    for i in range(iterations):  # timed without the ledger (its hooks cost per op); then one iteration counted
        t0 = time.perf_counter()
        core.step()
        if i >= WARMUP:
            times.append((time.perf_counter() - t0) * 1000)
    with SyncLedger() as ledger:
        core.step()
    return {"ms": statistics.median(times), "syncs": ledger.total}


def admission_ms(rows: int = 64) -> dict[str, float]:
    """Host ms per admitted request, outside the iteration: the LLM stage's enter (state, checks, the pool's
    reservation), prepare (its prefill and rules) and its request (the rules drawn ahead) -- and, apart, the duplex
    second's mel: its host share with the device mel (the stream's bookkeeping and the samples it stages:
    engine/mel.py), and the whole mel on the host (`MelStream.push`, the host path's)."""
    from minicpmo_triton.media.audio_mel import MelStream, frame_samples, mel_filterbank

    admitted: list[float] = []
    _core(rows, admitted)
    filters = mel_filterbank(80)
    rng = np.random.default_rng(0)
    chunks = [(rng.standard_normal(16_000) * 0.1).astype(np.float32) for _ in range(23)]
    out = {"request_ms": statistics.median(admitted)}
    for key in ("mel_ms", "mel_host_path_ms"):
        stream = MelStream()
        for chunk in chunks[:3]:
            stream.push(chunk, filters)
        t0 = time.perf_counter()
        for chunk in chunks[3:]:
            if key == "mel_ms":
                plan = stream.advance(chunk)
                frame_samples(stream.kept, plan.lo, plan.total).astype(np.float32)
            else:
                stream.push(chunk, filters)
        out[key] = (time.perf_counter() - t0) * 1000 / 20
    return out


def admission_hold(off_thread: bool, decoding: int = 8, admitted: int = 8, rounds: int = 4) -> dict[str, float]:
    """`decoding` rows decode long teacher-forced answers in the LLM's in-flight loop while `admitted` sessions'
    duplex seconds join together (`rounds` times, each session's next second; the first round, which builds the
    sessions and warms the encoder, not counted): the engine thread's wall ms per pass over the admissions (median
    and max) and the iterations per second the decoding rows made then."""
    from export.presets import TINY_SEED, tiny
    from export.stages import build_modules
    from minicpmo_triton.engine.whisper import load_paged_whisper
    from minicpmo_triton.media.tokenizer import load_tokenizer
    from minicpmo_triton.stage_io import LlmRequest
    from minicpmo_triton.stages.audio_encoder import AudioStreamEncoder
    from minicpmo_triton.stages.base import StageCall
    from minicpmo_triton.stages.llm import LlmStage
    from minicpmo_triton.stages.llm_inflight import InflightLlm
    from minicpmo_triton.stages.pool_kv import llm_kv

    preset = tiny()
    tokenizer = load_tokenizer(preset, ROOT / "model_repository" / "duplex" / "1")
    kv = llm_kv(build_modules(preset, TINY_SEED)["llm"].state_dict(), preset, tokenizer, pool_size=0.05,
                attention="gather", rows=64, max_sessions=decoding + admitted + 1)
    whisper = load_paged_whisper(ROOT / "model_repository" / "audio_encoder" / "1", preset.audio, "cpu",
                                 pool_size=0.01, attention="gather", dtype=torch.float32)
    stage = LlmStage(kv, preset, tokenizer, 600.0,
                     AudioStreamEncoder(whisper, preset.audio, preset.samples_per_audio_token))
    passes: list[tuple[float, float]] = []  # (start, end) of each pass of the engine thread

    class Timed(InflightLlm):
        def _admit(self) -> None:
            passes.append((time.perf_counter(), 0.0))
            super()._admit()

        def _step(self) -> None:
            super()._step()
            passes[-1] = (passes[-1][0], time.perf_counter())

    import queue

    answers: queue.Queue[Any] = queue.Queue()
    loop = Timed(stage, 5.0, off_thread=off_thread)
    tk = preset.tokens
    text = np.frombuffer(b"a long forced answer that keeps its row decoding through it all. " * 40, np.uint8)
    unit = np.array([tk.unit] + [tk.audio_placeholder] * 10, np.int64)
    rng = np.random.default_rng(0)
    try:
        for r in range(decoding):
            loop.submit(StageCall(LlmRequest(input_ids=unit[:1], chat=True, forced_ids=text.astype(np.int64),
                                             max_new_tokens=len(text), temperature=0.0), 1000 + r, start=True),
                        answers.put)
        while loop.core.iterations < 5:
            time.sleep(0.005)
        out: dict[str, list[float]] = {"pass_ms": [], "max_ms": [], "its": []}
        for step in range(rounds):
            t0, it0, n0 = time.perf_counter(), loop.core.iterations, len(passes)
            for s in range(admitted):
                audio = (rng.standard_normal(16_000) * 0.1).astype(np.float32)
                loop.submit(StageCall(LlmRequest(input_ids=unit, audio=audio, max_new_tokens=4, temperature=0.0,
                                                 seed=s + 1), s + 1, start=step == 0), answers.put)
            for _ in range(admitted):
                res = answers.get(timeout=120)
                assert not isinstance(res, Exception), res
            t1, it1 = time.perf_counter(), loop.core.iterations
            assert loop.core.scheduler.running, "the decoding rows ran out during the admission"
            if step:
                spans = [(b - a) * 1000 for a, b in passes[n0:] if b]
                out["pass_ms"].append(statistics.median(spans))
                out["max_ms"].append(max(spans))
                out["its"].append((it1 - it0) / (t1 - t0))
        return {k: statistics.median(v) for k, v in out.items()}
    finally:
        loop.close()


def roofline_ms(rows: int) -> float:
    """One decode iteration's device time at MiniCPM-o 4.5's dims on an H200: weights once, each row's 60 s of KV,
    the head, at 75% of HBM bandwidth (or 50% of bf16 FLOPs, whichever is longer)."""
    from bench.device_bill import BF16, HISTORY, decode_bill, roofline
    from export.presets import minicpmo45

    return roofline(decode_bill(minicpmo45().llm, rows, HISTORY, BF16)) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--main", default=BEFORE_REV, help="the git revision whose paged engine is the before")
    parser.add_argument("--admitted", type=int, default=8, help="duplex seconds admitted together (second table)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    token = 97  # "a": a text token, one character: every row keeps decoding through the iterations measured
    print("host ms per decode iteration, the forward replaced by its precomputed result (tiny's rules and tokenizer; "
          "medians of the iterations after the first two); H200 roofline of the same iteration at MiniCPM-o 4.5's "
          "dims, 60 s of history a row")
    print(f"{'rows':>5} {'before ms':>10} {'syncs':>6} {'after ms':>9} {'syncs':>6} {'after eager ms':>15} "
          f"{'GPU roofline ms':>16}")
    results = {}
    for rows in args.rows:
        b = before(rows, args.iterations + WARMUP, args.main, token)
        a = after(rows, args.iterations, token, eager=False)
        e = after(rows, args.iterations, token, eager=True)
        results[rows] = (b, a)
        print(f"{rows:>5} {b['ms']:>10.2f} {b['syncs']:>6} {a['ms']:>9.2f} {a['syncs']:>6} {e['ms']:>15.2f} "
              f"{roofline_ms(rows):>16.2f}", flush=True)
    adm = admission_ms()
    print(f"per admitted step, outside the iterations above: its request {adm['request_ms']:.2f} ms (enter, prepare, "
          f"its rules drawn ahead); its second's mel: {adm['mel_ms']:.2f} ms of host work with the device mel "
          f"(the host path's whole mel: {adm['mel_host_path_ms']:.2f} ms)")
    print(f"\nthe LLM's in-flight loop at tiny's dims on this CPU, 8 rows decoding, {args.admitted} duplex seconds "
          "admitted together (mel + streaming Whisper on the device engine); medians of 3 rounds")
    print(f"{'admission encoded on':>24} {'engine pass ms':>15} {'longest pass ms':>16} {'decode iterations/s':>20}")
    for name, off in (("engine thread (before)", False), ("preparation thread", True)):
        h = admission_hold(off, admitted=args.admitted)
        print(f"{name:>24} {h['pass_ms']:>15.2f} {h['max_ms']:>16.2f} {h['its']:>20.1f}", flush=True)
    if 128 in results:
        b, a = results[128]
        print(f"host ms per iteration at 128 rows: {a['ms']:.2f} (before: {b['ms']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

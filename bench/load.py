"""Gateway load generator: N real-time WebSocket sessions vs a baseline shaped like the official demo.

    python bench/load.py [--sessions 1 4 8 16 32 48 64] [--seconds 10] [--baseline-workers 2]
                         [--variants default MINICPMO_LLM_BATCH_WINDOW_MS=0]
    python bench/load.py --endpoints 2 --gateways 2 --sessions 8     (bench/fleet.py: placement, per dialect)
    python bench/load.py --metrics-cost --sessions 8 16 24 [--scrape]  (bench/metrics_cost.py: the gateway's
                                                                        metrics recorded vs off, MINICPMO_METRICS=0)

Every session streams espeak-ng speech at real-time pace (1 s appends) through gateway + Triton, each
starting at a random point of the first second (callers' seconds do not line up). The sweep runs once
per `--variants` entry (`default`, or the entry model's settings as MINICPMO_<KEY>=VALUE[,...] in
tritonserver's environment), each on a fresh tritonserver; the first is plotted.
Per N: chunk latency (append -> first delta of that step) p50/p95, first-audio latency of each
spoken turn, late chunks (over the 1 s chunk period) and dropped ones (never answered), Triton's
per-stage mean batch size, queue and compute time, and tritonserver's resident memory.
The baseline, in the same run: one session per worker process, the PyTorch modules called
in process, steps unbatched (the MiniCPM-o demo's shape). Prints tables; writes docs/load_latency.png.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, make_speech, pct, serving_stack

from gateway.triton import DEFAULT_MODEL_REPOSITORY
from minicpmo_client.backend import ConversationResult, converse

CHUNK_MS = 1000.0
STAGES = ("duplex", "audio_encoder", "llm", "tts", "token2wav")


@dataclass
class LoadResult:
    sessions: int
    p50: float
    p95: float
    first_audio_p50: float
    first_audio_p95: float
    late: int
    dropped: int
    sent: int
    latencies: list[float] = field(default_factory=list)  # each chunk's (ms), when asked for

    @property
    def real_time(self) -> bool:
        return self.p95 < CHUNK_MS and self.dropped == 0


def metrics(url: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    with urllib.request.urlopen(url, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            m = re.match(r'^(nv_inference_\w+)\{model="(\w+)"[^}]*\} ([\d.e+-]+)$', line)
            if m:
                out[(m.group(1), m.group(2))] = float(m.group(3))
            own = re.match(r'^minicpmo_(\w+?)_(live_sequences) ([\d.e+-]+)$', line)  # a stage's own gauge
            if own:
                out[(f"minicpmo_{own.group(2)}", own.group(1))] = float(own.group(3))
    return out


def tree_rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory of a process and its children (tritonserver + its Python stubs). `field`: a line of
    /proc/PID/status, e.g. RssAnon (the heap and stacks: what a leak grows), without RssFile (mapped libraries'
    pages, which the kernel drops and reads back as the machine's memory comes and goes)."""
    pids = [pid]
    try:
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        pids += [int(p) for p in children]
    except OSError:
        pass
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, tree_rss_mib(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def gateway_load(url: str, n: int, speech: list[np.ndarray], latencies: bool = False) -> LoadResult:
    rng = random.Random(n)

    async def caller(i: int) -> ConversationResult:
        await asyncio.sleep(rng.random() * CHUNK_MS / 1000)  # a phase of its own within the chunk period
        return await converse(url, speech[i % len(speech)], realtime=True, config={"do_sample": False})

    results = await asyncio.gather(*(caller(i) for i in range(n)), return_exceptions=True)
    ok = [r for r in results if not isinstance(r, BaseException)]
    lat = [x for r in ok for x in r.chunk_latencies_ms()]
    fa = [s * 1000 for r in ok for s in r.first_audio_latency_s]
    sent = sum(len(speech[i % len(speech)]) // 16_000 for i in range(n))
    return LoadResult(n, pct(lat, 50), pct(lat, 95), pct(fa, 50), pct(fa, 95),
                      late=sum(x > CHUNK_MS for x in lat), dropped=sent - len(lat), sent=sent,
                      latencies=lat if latencies else [])


def _baseline_worker(repository: str, audio: np.ndarray, queue: mp.Queue) -> None:
    """One demo-shaped worker: one session, PyTorch modules in process, one step at a time, real time."""
    import torch

    from export.torch_engine import torch_stages
    from minicpmo_triton.rules.duplex_options import DuplexOptions
    from minicpmo_triton.serving.pipeline import StepEvent, StepInput

    torch.set_num_threads(1)
    pipeline = torch_stages(Path(repository)).pipeline()
    options = DuplexOptions.from_config({"do_sample": False})
    latencies: list[float] = []

    async def run() -> None:
        n = len(audio) // 16_000
        start = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i - time.perf_counter()))
            t0 = time.perf_counter()
            first: list[float] = []

            async def emit(ev: StepEvent, first: list[float] = first) -> None:
                first.append(first[0] if first else time.perf_counter())

            await pipeline.step(1, i == 0, i == n - 1, StepInput(audio=audio[i * 16_000:(i + 1) * 16_000],
                                                                 options=options), emit)
            latencies.append(((first[0] if first else time.perf_counter()) - t0) * 1000)

    asyncio.run(run())
    queue.put(latencies)


def baseline(repository: Path, workers: int, speech: list[np.ndarray]) -> LoadResult:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_baseline_worker, args=(str(repository), speech[i % len(speech)], queue))
             for i in range(workers)]
    for p in procs:
        p.start()
    lat = [x for _ in procs for x in queue.get(timeout=600)]
    for p in procs:
        p.join()
    sent = sum(len(speech[i % len(speech)]) // 16_000 for i in range(workers))
    return LoadResult(workers, pct(lat, 50), pct(lat, 95), float("nan"), float("nan"),
                      late=sum(x > CHUNK_MS for x in lat), dropped=sent - len(lat), sent=sent)


def state_bytes(repository: Path, audio: np.ndarray) -> dict[str, int]:
    """Per-session state of each stage after one session's worth of steps (in process, same code)."""
    from minicpmo_triton.engine.kv_batch import KvCache
    from minicpmo_triton.rules.duplex_options import DuplexOptions
    from minicpmo_triton.serving.inprocess import InProcessStages
    from minicpmo_triton.serving.pipeline import StepEvent, StepInput

    stages = InProcessStages(repository)
    pipeline = stages.pipeline()
    options = DuplexOptions.from_config({"do_sample": False})

    async def emit(ev: StepEvent) -> None:
        return None

    async def run() -> None:
        for i in range(len(audio) // 16_000):
            await pipeline.step(1, i == 0, False, StepInput(audio=audio[i * 16_000:(i + 1) * 16_000],
                                                            options=options), emit)

    asyncio.run(run())
    tts_session = stages.tts_stage.store.get_or_none(1)
    llm, tts = stages.llm_stage.store.get(1).cache, tts_session.cache if tts_session else None
    # in process the stages run their ONNX graphs: dense caches (a paged cache's blocks are the pool's)
    assert isinstance(llm, KvCache) and (tts is None or isinstance(tts, KvCache))
    out = {"llm": llm.nbytes, "tts": tts.nbytes if tts is not None else 0}
    t2w = stages.t2w_stage.store.get_or_none(1)
    out["token2wav"] = t2w.stream.nbytes if t2w and t2w.stream else 0
    return out


def plot(rows: list[LoadResult], base: LoadResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    n = [r.sessions for r in rows]
    ax.plot(n, [r.p50 for r in rows], "o-", label="gateway + Triton p50")
    ax.plot(n, [r.p95 for r in rows], "s-", label="gateway + Triton p95")
    ax.plot([base.sessions], [base.p95], "x", markersize=10,
            label=f"demo-shaped baseline p95 ({base.sessions} workers)")
    ax.axhline(CHUNK_MS, color="grey", linestyle="--", label="chunk period (real time)")
    ax.set_xlabel("concurrent real-time sessions")
    ax.set_ylabel("chunk latency (ms)")
    ax.set_yscale("log")
    ax.set_title("tiny preset on 2 CPU cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--baseline-workers", type=int, default=2, help="one session each (default: the cores)")
    parser.add_argument("--soak-rounds", type=int, default=3, help="rounds at --soak-sessions to check memory")
    parser.add_argument("--soak-sessions", type=int, default=16)
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "load_latency.png")
    parser.add_argument("--variants", nargs="+", default=["default", "MINICPMO_LLM_BATCH_WINDOW_MS=0"],
                        help="one sweep each: default, or MINICPMO_<KEY>=VALUE[,...] for the entry model")
    parser.add_argument("--endpoints", type=int, default=1, help="tritonservers (more than 1: bench/fleet.py)")
    parser.add_argument("--gateways", type=int, default=1, help="gateway processes (more than 1: bench/fleet.py)")
    parser.add_argument("--metrics-cost", action="store_true",
                        help="a gateway with its metrics and one without (MINICPMO_METRICS=0), alternating "
                             "(bench/metrics_cost.py)")
    parser.add_argument("--rounds", type=int, default=2, help="--metrics-cost: alternating rounds per session count")
    parser.add_argument("--scrape", action="store_true", help="--metrics-cost: /metrics read every second meanwhile")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="load-"))
    speech = make_speech(work, args.seconds)
    if args.metrics_cost:
        import metrics_cost

        metrics_cost.run(args.model_repository, work / "metrics", speech, args.sessions, args.rounds, args.scrape)
        return 0
    if args.endpoints > 1 or args.gateways > 1:
        import fleet

        for n in args.sessions:
            fleet.run(args.model_repository, work / f"fleet{n}", speech, args.seconds, args.endpoints, args.gateways, n)
        return 0
    base = baseline(args.model_repository, args.baseline_workers, speech)
    bytes_per_stage = state_bytes(args.model_repository, speech[0])
    print(f"\nload: tiny preset, {args.seconds} s of espeak-ng speech per session, real-time pace, random phases, "
          f"2 CPU cores")
    print(f"state per session after {args.seconds} s: " +
          ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in bytes_per_stage.items()))
    for i, variant in enumerate(args.variants):
        settings = dict(kv.split("=", 1) for kv in variant.split(",") if "=" in kv)
        # tritonserver's environment, for this sweep only: the entry model reads MINICPMO_<KEY>
        with mock.patch.dict(os.environ, settings):
            sweep(args, work / f"variant{i}", speech, base, variant, plot_it=i == 0)
    return 0


def sweep(args: argparse.Namespace, work: Path, speech: list[np.ndarray], base: LoadResult, variant: str,
          plot_it: bool) -> None:
    rows: list[tuple[LoadResult, dict[str, tuple[float, float, float]], float]] = []
    soak: list[float] = []
    work.mkdir(parents=True)
    with serving_stack(args.model_repository, work, max(args.sessions) + 8) as stack:
        server, url = stack.triton, stack.ws_url
        assert server.process is not None
        idle_rss = tree_rss_mib(server.process.pid)
        for n in args.sessions:
            before = metrics(server.ports.metrics_url)
            with RssSampler(server.process.pid) as rss:
                result = asyncio.run(gateway_load(url, n, speech))
            after = metrics(server.ports.metrics_url)
            per_stage = {}
            for m in STAGES:
                d = {k: after.get((k, m), 0) - before.get((k, m), 0) for k in (
                    "nv_inference_count", "nv_inference_exec_count", "nv_inference_queue_duration_us",
                    "nv_inference_compute_infer_duration_us", "nv_inference_request_success")}
                reqs = max(d["nv_inference_request_success"], 1)
                per_stage[m] = (d["nv_inference_count"] / max(d["nv_inference_exec_count"], 1),
                                d["nv_inference_queue_duration_us"] / reqs / 1000,
                                d["nv_inference_compute_infer_duration_us"] / reqs / 1000)
            rows.append((result, per_stage, rss.peak))
            print(f"{variant}, {n} sessions: p95 {result.p95:.0f} ms, dropped {result.dropped}",
                  file=sys.stderr)
        for _ in range(args.soak_rounds):
            asyncio.run(gateway_load(url, args.soak_sessions, speech))
            soak.append(tree_rss_mib(server.process.pid))
        live = {m: metrics(server.ports.metrics_url).get(("minicpmo_live_sequences", m), -1)
                for m in ("duplex", "llm", "tts", "token2wav")}

    results = [r for r, _, _ in rows]
    if plot_it:
        plot(results, base, args.plot)
    best = max((r.sessions for r in results if r.real_time), default=0)
    base_capacity = base.sessions if base.real_time else 0
    print(f"\n## {variant}\n")
    print("| path | sessions | chunk p50 ms | chunk p95 ms | first audio p50 ms | first audio p95 ms "
          "| late | dropped | tritonserver RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| demo-shaped baseline (1 session/worker, PyTorch, unbatched) | {base.sessions} | {base.p50:.1f} | "
          f"{base.p95:.1f} | - | - | {base.late} | {base.dropped} | - |")
    for r, _, peak in rows:
        print(f"| gateway + Triton | {r.sessions} | {r.p50:.1f} | {r.p95:.1f} | {r.first_audio_p50:.1f} | "
              f"{r.first_audio_p95:.1f} | {r.late} | {r.dropped} | {peak:.0f} |")
    print("\n| sessions | " + " | ".join(f"{m} batch / queue ms / compute ms" for m in STAGES) + " |")
    print("|---:|" + "---|" * len(STAGES))
    for r, per_stage, _ in rows:
        cells = " | ".join(f"{b:.2f} / {q:.1f} / {c:.1f}" if b else "-" for b, q, c in (per_stage[m] for m in STAGES))
        print(f"| {r.sessions} | {cells} |")
    print(f"tritonserver RSS: idle {idle_rss:.0f} MiB; after each soak round of {args.soak_sessions} sessions: "
          + ", ".join(f"{x:.0f}" for x in soak) + f" MiB; live sequences after: {live}")
    ratio = best / base_capacity if base_capacity else float("inf")
    print(f"\nlargest real-time session count (p95 < {CHUNK_MS:.0f} ms, none dropped): {best}; "
          f"baseline: {base_capacity} ({args.baseline_workers} workers); ratio {ratio:.1f}x")
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    sys.exit(main())

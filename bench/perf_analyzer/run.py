"""perf_analyzer against the local Triton: the entry model and every stage, at several concurrencies.

    python bench/perf_analyzer/run.py [--triton-grpc 127.0.0.1:8001] [--concurrency 1 4 16]

Writes realistic --input-data JSON (espeak-ng speech, 1 s of 16 kHz audio per step; the stages' own
intermediate tensors for the stages), starts tritonserver unless --triton-grpc is given, runs each
configuration in configs.json and prints one markdown table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.audio import read_wav  # noqa: E402 (after the sys.path line: run as a file)
from gateway.triton import DEFAULT_MODEL_REPOSITORY, TritonServer  # noqa: E402 (after the sys.path line: run as a file)
from minicpmo_triton.serving.inprocess import InProcessStages  # noqa: E402 (after the sys.path line: run as a file)
from minicpmo_triton.stage_io import AudioEncoderRequest, LlmRequest  # noqa: E402 (after the sys.path line: run as a file)
from minicpmo_triton.stages.base import StageCall  # noqa: E402 (after the sys.path line: run as a file)

HERE = Path(__file__).resolve().parent
STEPS = 8
STREAMS = 4
TEXT = ("Good morning. Could you please tell me what the weather will be like tomorrow in Paris? "
        "I am planning a long walk along the river and I need to know whether to bring an umbrella.")


def tensor(value: np.ndarray) -> dict:
    return {"content": np.asarray(value).reshape(-1).tolist(), "shape": list(np.asarray(value).shape)}


def speech_chunks(work: Path) -> list[np.ndarray]:
    wav = work / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), TEXT], check=True, capture_output=True)
    audio = read_wav(wav)
    need = STEPS * STREAMS * 16_000
    audio = np.tile(audio, -(-need // len(audio)))[:need]
    return [audio[i * 16_000:(i + 1) * 16_000] for i in range(STEPS * STREAMS)]


def input_data(repository: Path, chunks: list[np.ndarray]) -> dict[str, dict]:
    """One stream of STEPS steps per sequence; stage inputs are what the pipeline really sends them."""
    stages = InProcessStages(repository)
    tk, h = stages.preset.tokens, stages.preset.llm.hidden
    rng = np.random.default_rng(0)
    streams: dict[str, list] = {k: [] for k in ("duplex", "llm", "tts", "token2wav", "audio_encoder")}
    for s in range(STREAMS):
        steps: dict[str, list[dict[str, dict]]] = {k: [] for k in streams}
        for i in range(STEPS):
            chunk = chunks[s * STEPS + i].astype(np.float32)
            steps["duplex"].append({"audio": tensor(chunk)})
            steps["audio_encoder"].append({"audio": tensor(chunk)})
            encoded = stages.encoder.run([AudioEncoderRequest(chunk)])[0]
            if isinstance(encoded, Exception):
                raise encoded
            embeds = encoded.embeds
            ids = np.array([tk.unit] + [tk.audio_placeholder] * len(embeds), np.int64)
            steps["llm"].append({"input_ids": tensor(ids), "embeds": tensor(embeds),
                                 "temperature": tensor(np.zeros(1, np.float32))})
            n = 6
            steps["tts"].append({"text_ids": tensor(rng.integers(32, 127, n)),
                                 "tts_hidden": tensor(rng.standard_normal((n, h)).astype(np.float32)),
                                 "turn_start": tensor(np.array([i == 0]))})
            steps["token2wav"].append({"speech_tokens": tensor(rng.integers(0, 6000, 25)),
                                       "turn_start": tensor(np.array([i == 0]))})
        for k in streams:
            streams[k].append(steps[k])
    # a sanity check that the LLM data is valid for the stage
    stages.llm_stage.run([StageCall(LlmRequest(input_ids=ids, embeds=embeds), 1, start=True)])
    return {k: {"data": v} for k, v in streams.items()}


def perf_analyzer_env() -> dict[str, str]:
    cudart = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cuda_runtime" / "lib"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(cudart), env.get("LD_LIBRARY_PATH")]))
    return env


def run_one(binary: str, url: str, run: dict, common: list[str], data: Path, concurrency: int,
            out: Path) -> dict[str, str] | str:
    cmd = [binary, "-m", run["model"], "-u", url, *common, *run["flags"], "--input-data", str(data),
           "--concurrency-range", f"{concurrency}:{concurrency}", "-f", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=perf_analyzer_env(), timeout=300)
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"failed: {tail[0][:120]}"
    with open(out) as f:
        return next(csv.DictReader(f))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-grpc", help="a running Triton's gRPC address; else one is started")
    parser.add_argument("--concurrency", type=int, nargs="+")
    parser.add_argument("--models", nargs="+", help="only these models")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    args = parser.parse_args()
    config = json.loads((HERE / "configs.json").read_text())
    concurrencies = args.concurrency or config["concurrency"]
    binary = str(Path(sys.executable).parent / "perf_analyzer")
    work = Path(tempfile.mkdtemp(prefix="perf-analyzer-"))
    datasets = input_data(args.model_repository, speech_chunks(work))
    for name, data in datasets.items():
        (work / f"{name}.json").write_text(json.dumps(data))

    server = None
    url = args.triton_grpc
    if url is None:
        server = TritonServer(args.model_repository, work_dir=work / "triton", log_path=work / "triton.log")
        server.start()
        server.wait_ready()
        url = server.ports.grpc_url
    rows = []
    try:
        for run in config["runs"]:
            if args.models and run["model"] not in args.models:
                continue
            for c in concurrencies:
                result = run_one(binary, url, run, config["common"], work / f"{run['inputs']}.json", c,
                                 work / f"{run['model']}-{c}.csv")
                rows.append((run["model"], c, result))
                print(f"{run['model']} concurrency {c}: {'ok' if isinstance(result, dict) else result}",
                      file=sys.stderr)
    finally:
        if server is not None:
            server.stop()

    print("\nperf_analyzer (tiny preset, 1 s of 16 kHz speech per duplex step; latencies in ms)\n")
    print("| model | concurrency | infer/s | p50 | p95 | server queue | server compute |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for model, c, r in rows:
        if isinstance(r, str):
            print(f"| {model} | {c} | {r} | | | | |")
            continue
        us = lambda key, r=r: float(r.get(key, "nan")) / 1000  # noqa: E731 (a one-line helper)
        compute = us("Server Compute Input") + us("Server Compute Infer") + us("Server Compute Output")
        print(f"| {model} | {c} | {float(r['Inferences/Second']):.1f} | {us('p50 latency'):.1f} | "
              f"{us('p95 latency'):.1f} | {us('Server Queue'):.1f} | {compute:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

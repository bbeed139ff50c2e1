"""Triton hops of a speaking duplex step on the device path: the tts and token2wav models hops of their own, the TTS in
the llm model's process (`tts_in_llm`), and token2wav there too (`token2wav_in_llm`: one request), measured on the tiny
export over real tritonservers (the device engines on the CPU; token2wav on its host path in every mode).

Each mode gets a fresh tritonserver and gateway (its health probes held off: they are requests too); the same
greedy sessions (espeak-ng speech, sent as fast as answered) run through it, one after another. From Triton's own
`nv_inference_request_success` per model, and the steps' metrics: requests each stateful stage served per speaking
step (its END excluded), and from a speaking step's text to its audio (`cost_tts_ms` + `cost_token2wav_ms`: the hops
with their batchers' queue delays, or the in-process stages' wait), p50 / p95.

    python bench/step_hops.py [--sessions 2] [--seconds 8]

Last line: `Triton requests per speaking step: X (before: Y)`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import urllib.request
from pathlib import Path
from typing import Any
from unittest import mock

from common import ROOT, make_speech, pct, serving_stack

from minicpmo_client.backend import converse

STAGES = ("llm", "tts", "token2wav")
DEVICE = {"MINICPMO_LLM_ENGINE": "paged", "MINICPMO_TTS_ENGINE": "paged"}
MODES = {"tts hop": {**DEVICE, "MINICPMO_TTS_IN_LLM": "0"},
         "tts in llm": {**DEVICE, "MINICPMO_TTS_IN_LLM": "1", "MINICPMO_TOKEN2WAV_IN_LLM": "0"},
         "one request": {**DEVICE, "MINICPMO_TTS_IN_LLM": "1", "MINICPMO_TOKEN2WAV_IN_LLM": "1"}}


def requests(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(STAGES, 0.0)
    for line in text.splitlines():
        for m in STAGES:
            if line.startswith(f'nv_inference_request_success{{model="{m}"'):
                out[m] += float(line.rsplit(" ", 1)[1])
    return out


def run(mode: str, env: dict[str, str], sessions: int, seconds: int, work: Path) -> dict[str, Any]:
    with mock.patch.dict(os.environ, env), serving_stack(  # tritonserver's environment is this process's
            ROOT / "model_repository", work / mode.replace(" ", "_"), sessions,
            env={"MINICPMO_HEALTH_PERIOD_S": "3600"}) as stack:
        before = requests(stack.triton.ports.metrics_url)
        speech = make_speech(work, seconds)
        events: list[dict[str, Any]] = []
        for i in range(sessions):
            result = asyncio.run(converse(stack.ws_url, speech[i % len(speech)], realtime=False,
                                          config={"do_sample": False}))
            events += result.events
        after = requests(stack.triton.ports.metrics_url)
    served = {m: after[m] - before[m] for m in STAGES}
    spoken = [e["metrics"] for e in events if e.get("kind") == "audio" and "cost_tts_ms" in e.get("metrics", {})]
    speaking = len(spoken)  # each voiced step's audio event
    per_step = {m: (served[m] - sessions) / speaking if served[m] else 0.0 for m in ("tts", "token2wav")}  # less END
    return {"speaking": speaking, "served": served, "hops": 1 + per_step["tts"] + per_step["token2wav"],
            "audio_ms": [m["cost_tts_ms"] + (m.get("cost_token2wav_ms") or 0.0) for m in spoken]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--seconds", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(mode, env, args.sessions, args.seconds, Path(tmp)) for mode, env in MODES.items()}
    print("| mode | speaking steps | llm / tts / token2wav requests | Triton requests per speaking step "
          "| text -> audio ms p50 | p95 |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        s = r["served"]
        print(f"| {mode} | {r['speaking']} | {s['llm']:.0f} / {s['tts']:.0f} / {s['token2wav']:.0f} | {r['hops']:.2f} "
              f"| {pct(r['audio_ms'], 50):.1f} | {pct(r['audio_ms'], 95):.1f} |")
    before, after = results["tts in llm"], results["one request"]
    print(f"text -> audio ms p50: {pct(after['audio_ms'], 50):.1f} (before: {pct(before['audio_ms'], 50):.1f})")
    print(f"Triton requests per speaking step: {after['hops']:.2f} (before: {before['hops']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

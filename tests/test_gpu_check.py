"""bench/gpu_check.py (scripts/gpu_check.sh: run once on a GPU) runs its own code on the CPU at small dims, so a
broken stage shows here and not first on a lent GPU: each stage ends with its results in gpu_check.json and no
error, a stage's or one size's (on the CPU the decode step runs eagerly: no CUDA graphs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.gpu_check as gpu_check  # a dotted import: the 3.12 subset (no torch) leaves the module out

pytestmark = pytest.mark.engines  # the device engines on the CPU: a .ci/run step of its own


@pytest.mark.parametrize("stages", ["parity,speed,step", "tts,whisper"])
def test_the_gpu_check_runs_its_stages_on_the_cpu(tmp_path: Path, stages: str) -> None:
    assert gpu_check.main(["--device", "cpu", "--quick", "--stages", stages, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert gpu_check.errors(report) == []
    for stage in stages.split(","):
        if stage == "parity":
            assert report[stage]["failed"] == [] and report[stage]["graph_token_agreement"] == 1.0
            assert report[stage]["syncs_per_iteration"] == 1
            continue
        sizes = report[stage] if stage in ("speed", "step") else report[stage]["speed"]
        assert sorted({s["sessions"] for s in sizes}) == [2, 4]
        assert all("skipped" not in s for s in sizes)
        if stage == "speed":
            assert all(s["llm_iteration_ms"] > 0 and s["tts_iteration_ms"] > 0 for s in sizes)
        elif stage == "step":
            assert sum(s["speaking_steps"] for s in sizes) > 0 and all(s["speaking_p95_ms"] >= 0 for s in sizes)
        else:
            assert all(s["pool_gib"] > 0 for s in sizes)
    for stage in ("tts", "whisper"):
        if stage in report:
            assert report[stage]["parity"]["decode" if stage == "tts" else "flex"]
    whisper = report.get("whisper")
    if whisper is not None:  # the fixed-shape chunk is the varlen forward's; timed (eagerly: no graphs on the CPU)
        assert whisper["parity"]["padded"]["max_abs_diff"] < 1e-4
        assert all(s["chunk_ms_eager"] > 0 and s["chunk_ms_graphs"] is None for s in whisper["speed"])
    tts = report.get("tts")
    if tts is not None:
        assert tts["parity"]["sampler_greedy_agreement"] == 1.0
        assert tts["parity"]["decode"]["flex"]["greedy_agreement"] == 1.0
        assert all(s["decode_iteration_ms"] > 0 and s["chunk_ms"] > s["decode_iteration_ms"] for s in tts["speed"])


def test_the_gpu_check_runs_token2wav_s_stage_on_the_cpu(tmp_path: Path) -> None:
    """token2wav's device path at tiny's dims: its parity with the CPU's fp32 in both cache dtypes (bf16's
    difference measured, under its bound), and each size's iteration timed."""
    assert gpu_check.main(["--device", "cpu", "--quick", "--stages", "token2wav", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())["token2wav"]
    assert gpu_check.errors(report) == []
    parity = report["parity"]
    assert parity["fp32"]["max_abs_diff"] == 0.0  # the same path on the same CPU
    assert 0 < parity["bf16"]["max_abs_diff"] < parity["bf16"]["bound"]
    assert [s["sessions"] for s in report["speed"]] == [2, 4]
    assert all(s["iteration_ms"] > 0 and s["slot_mib"] > 0 and "skipped" not in s for s in report["speed"])


def test_a_size_that_fails_is_an_error_of_the_report() -> None:
    assert gpu_check.errors({"tts": {"speed": [{"sessions": 2}, {"sessions": 4, "error": "PoolFull: x"}]}}) == \
        ["PoolFull: x"]
    assert gpu_check.errors({"whisper": {"error": "boom", "traceback": "..."}}) == ["boom"]

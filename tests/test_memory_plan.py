"""The device's memory as one plan (`engine/memory_plan.py`): the KV pools' bytes from the device's total less every
stage's weights and workspace and a margin, shared by the settings' ratios (GB settings taken first), the same
whatever order the models load in; weights read from the model repository's files. Memory figures faked."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from safetensors.numpy import load_file

from minicpmo_triton.engine.memory_plan import (
    GIB,
    MARGIN,
    PlanError,
    StageMemory,
    plan_pools,
    repository_stages,
    safetensors_bytes,
)
from minicpmo_triton.model_config import load_stage_config

from .conftest import MODEL_REPOSITORY, ensure_exported

H200 = 141 * GIB
STAGES = [StageMemory("llm", 16 * GIB, 2 * GIB), StageMemory("whisper", GIB, GIB // 2),
          StageMemory("tts", GIB, GIB // 4), StageMemory("token2wav", GIB // 2, GIB // 2)]
SHARES = {"kv": 0.65, "audio": 0.15, "tts": 0.15}


def test_the_pools_share_what_every_stage_leaves_whatever_the_load_order() -> None:
    plans = [plan_pools(H200, list(order), SHARES) for order in itertools.permutations(STAGES)]
    assert all(p == plans[0] for p in plans), "the same plan whatever order the stages come in"
    plan = plans[0]
    left = H200 - int(MARGIN * H200) - sum(s.weights + s.workspace for s in STAGES)
    assert plan.budget == left
    assert plan.pools == {pool: int(share * left) for pool, share in SHARES.items()}
    assert sum(plan.pools.values()) <= left
    assert any("pool kv" in line for line in plan.lines())


def test_a_pool_set_in_gb_is_taken_first_and_the_others_share_the_rest() -> None:
    plan = plan_pools(H200, STAGES, {**SHARES, "tts": 20})
    left = plan.budget - 20 * GIB
    assert plan.pools == {"kv": int(0.65 * left), "audio": int(0.15 * left), "tts": 20 * GIB}


def test_stages_that_leave_no_room_fail_the_load_saying_so() -> None:
    with pytest.raises(PlanError, match="no room"):
        plan_pools(16 * GIB, STAGES, SHARES)
    assert plan_pools(16 * GIB, STAGES, {"kv": 2.0}).pools == {"kv": 2 * GIB}, "explicit sizes are the operator's"


def test_weights_are_read_from_the_repositorys_files_at_the_devices_width() -> None:
    ensure_exported()
    preset = load_stage_config(MODEL_REPOSITORY / "llm" / "1")
    path = MODEL_REPOSITORY / "llm/1/weights.safetensors"
    tensors = load_file(str(path))
    assert safetensors_bytes(path) == sum(t.nbytes for t in tensors.values())
    assert safetensors_bytes(path, 2) == sum(int(np.prod(t.shape)) * 2 for t in tensors.values())
    on_gpu = repository_stages(MODEL_REPOSITORY, preset, {"llm", "tts", "whisper"}, 256, 2, cuda=True)
    assert [s.name for s in on_gpu] == ["llm", "tts", "whisper"]
    assert on_gpu[0].weights == safetensors_bytes(path, 2) and all(s.workspace > 0 for s in on_gpu)
    # the TTS in the llm model's process: no CUDA context of its own
    moved = repository_stages(MODEL_REPOSITORY, preset, {"tts"}, 256, 2, cuda=True, tts_in_llm=True)
    assert moved[0].workspace < on_gpu[1].workspace

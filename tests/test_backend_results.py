"""What a /backend step result says, as MiniCPM-o's own worker says it (OpenBMB/MiniCPM-o-Demo @28b60cf):

- `kv_cache_length` is the LLM's KV cache as the step leaves it: the worker reads its duplex decoder's
  `get_cache_length()` after `duplex_generate`, before the deferred finalize (worker.py:1641-1643, through
  core/processors/unified.py:1496), so the sliding window's slides shrink it, and the demo's page hangs up at 8192
  (static/duplex/lib/duplex-session.js:16, 428-431). The count from the call's start is `kv_tokens_total`;
- a listen says no `end_of_turn` (`_make_generate_result`'s default, modeling_minicpmo_unified.py:4928, 5130).

The same values, per chunk, against the demo's own loop run: tests/test_duplex_reference_loop.py (the stage's
`LlmResult`) and tests/test_duplex_reference_omni.py (these metrics)."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.dialects.backend import BackendState
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import StepEvent, StepInput

from .conftest import MODEL_REPOSITORY, ensure_exported

pytestmark = pytest.mark.asyncio(loop_scope="function")
HIGH, LOW = 100, 70  # the basic window's watermarks: a short call slides it
STEPS = 10


async def test_kv_cache_length_is_the_live_cache_and_a_listen_ends_no_turn() -> None:
    ensure_exported()
    pipeline = InProcessStages(MODEL_REPOSITORY).pipeline()
    pipeline.default_ref_audio = None  # a short system prompt, so the window has units to drop
    options = DuplexOptions.from_config({"do_sample": False, "system_prompt": "Hi.", "sliding_window_mode": "basic",
                                         "basic_window_high_tokens": HIGH, "basic_window_low_tokens": LOW})
    backend = BackendState("sess_kv")
    steps: list[list[dict]] = []  # each step's deltas
    forced = -1  # the step whose listen the caller forced while the model spoke

    async def emit(ev: StepEvent) -> None:
        steps[-1].append(backend.delta(f"in_{len(steps) - 1}", ev).encode())

    for i in range(STEPS):
        spoke = bool(steps) and steps[-1][0]["kind"] != "listen" and not steps[-1][-1].get("end_of_turn")
        if spoke and forced < 0:
            forced = i
        steps.append([])
        inp = StepInput(audio=np.zeros(16_000, np.float32), options=options if i == 0 else None,
                        force_listen=i == forced)
        await pipeline.step(1, i == 0, i == STEPS - 1, inp, emit)
    first = [deltas[0] for deltas in steps]  # a step's decision and its metrics
    live = [r["metrics"]["kv_cache_length"] for r in first]
    total = [r["metrics"]["kv_tokens_total"] for r in first]
    print(f"\nkv_cache_length {live}\nkv_tokens_total {total}\nforced listen mid-turn at step {forced}")
    assert total[-1] > HIGH + 60 and all(b > a for a, b in zip(total, total[1:], strict=False))  # it slid, and more
    assert max(live) <= HIGH + 40  # a unit's worth over the high watermark at most, never the call's count
    assert any(t > v for t, v in zip(total, live, strict=True))
    assert forced > 0 and first[forced]["kind"] == "listen"
    assert not any(r.get("end_of_turn") for r in first if r["kind"] == "listen")

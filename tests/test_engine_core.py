"""The engine core's decode iteration, on the CPU, held to what a GPU needs of it:
- it makes the host wait for the device once: the download of the chosen tokens (a `TorchDispatchMode` ledger,
  engine/syncs.py, counts every op that would sync a CUDA stream: `nonzero`, `item`, boolean-mask indexing, tensors
  made from Python objects, pageable uploads, `.cpu()` / `.numpy()`), with the next iteration launched before this
  one's tokens are read (overlap);
- its decode step reads and writes the same storages every iteration of a bucket (what a CUDA graph replays);
for the LLM's rows (duplex greedy and sampled, chat, forced) and the TTS's. The same ledger over the engine this
core replaced counted 29 per iteration (27 uploads from Python objects, the logits' download, its numpy)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minicpmo_triton.engine.request import Status
from minicpmo_triton.engine.syncs import SyncLedger
from minicpmo_triton.stage_io import LlmRequest, TtsRequest
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.tts import TtsStage

from .test_engine_llm import chunk, paged_engine, preset, stage, weights
from .test_engine_tts import paged as tts_kv
from .test_engine_tts import weights as tts_weights

__all__ = ["preset", "tts_weights", "weights"]  # the fixtures, used by name
pytestmark = pytest.mark.engines  # the device engine on the CPU: a .ci/run step of its own (-m engines)

ROWS = {1: {"temperature": 0.0}, 2: {}, 3: {"temperature": 0.0, "length_penalty": 1.3},
        4: {"chat": True, "repetition_penalty": 1.3}, 5: {"forced_ids": np.arange(40, 80)}, 6: {}}


def llm_core(preset, weights) -> Any:
    """Six LLM rows admitted into a core (each a 40-token budget, so none ends within the iterations measured)."""
    kv = paged_engine(preset, weights)
    st = stage(preset, kv)
    for corr, settings in ROWS.items():
        call = StageCall(chunk(preset, corr, 0, max_new_tokens=40, **settings), corr, start=True)
        sess = st.enter(call)
        embeds, _ = st.encode([(call.request, sess)])
        prefill, rules = st.prepare(call.request, sess, embeds[0])
        kv.core.add(kv.request(corr, sess.cache, prefill, rules))
    return kv.core


def tts_core(preset, weights) -> Any:
    kv = tts_kv(preset, weights)
    st = TtsStage(kv, preset, 600.0)
    rng = np.random.default_rng(0)
    for corr, temperature in ((1, 0.0), (2, 0.8), (3, 0.8)):
        req = TtsRequest(text_ids=rng.integers(0, 200, 6), tts_hidden=rng.standard_normal((6, preset.llm.hidden))
                         .astype(np.float32), turn_start=True, n_tokens=60, temperature=temperature)
        sess = st.enter(StageCall(req, corr, start=True))
        prefill, rules = st.begin(req, sess)
        kv.core.add(kv.request(corr, sess.cache, prefill, rules))
    return kv.core


@pytest.fixture(params=["llm", "tts"])
def core(request, preset, weights, tts_weights) -> Any:
    if request.param == "llm":
        return llm_core(preset, weights)
    from minicpmo_triton.model_config import load_stage_config

    from .conftest import MODEL_REPOSITORY

    return tts_core(load_stage_config(MODEL_REPOSITORY / "tts" / "1"), tts_weights)


def test_a_decode_iteration_waits_for_the_device_once(core) -> None:
    core.step()  # the prefills (their rows choose their first tokens)
    core.step()  # the first decode iteration launched; the prefill's tokens read
    for _ in range(5):
        with SyncLedger() as ledger:
            ended = core.step()  # launch iteration n + 1, then read n's tokens
        assert not ended and ledger.total == 1, dict(ledger.counts)
        assert ledger.counts["download.numpy"] == 1
    assert all(r.status is Status.RUNNING for r in core.scheduler.running.values())


class Storages(TorchDispatchMode):
    """The storages an op reads or writes that existed before the step (made by nothing inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.used: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in _tensors(args, kwargs):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.made:
                self.used.add(ptr)
        for t in _tensors(out, None):
            self.made.add(t.untyped_storage().data_ptr())
        return out


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    flat = list(args) if isinstance(args, (list, tuple)) else [args]
    flat += list((kwargs or {}).values())
    out = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [x for x in a if isinstance(x, torch.Tensor)]
    return out


def test_the_decode_step_reads_and_writes_the_same_storages(core) -> None:
    """Each iteration's decode step in one bucket touches the same persistent storages (the batch's rows, the
    rules' buffers, the pool, the weights): nothing it reads or writes is made anew per iteration by the host."""
    runner = core.runner
    step = runner._decode
    seen: list[tuple[Any, set[int]]] = []

    def recorded(*key: Any) -> None:
        mode = Storages()
        with mode:
            step(*key)
        seen.append((key, mode.used))

    runner._decode = recorded
    for _ in range(12):
        core.step()
    by_key: dict[Any, list[set[int]]] = {}
    for key, used in seen:
        by_key.setdefault(key, []).append(used)
    assert max(len(v) for v in by_key.values()) >= 4, by_key.keys()  # a bucket (rows, table width) seen often
    persistent = {t.untyped_storage().data_ptr() for t in _persistent(runner)}
    for used in by_key.values():
        assert all(u == used[0] for u in used[1:])
        assert used[0] <= persistent, "the step read a storage that is not one of the runner's persistent buffers"
        assert {runner.state.ids.untyped_storage().data_ptr(),
                runner.state.out.untyped_storage().data_ptr()} <= used[0]


def _persistent(runner: Any) -> list[torch.Tensor]:
    """Every tensor the runner owns for the life of the batch (the network's weights included)."""
    owners = [runner.state, runner.head, runner.pool, runner.model]
    out: list[torch.Tensor] = []
    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, torch.nn.Module):
                out += [*value.parameters(), *value.buffers()]
            elif isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out += [v for v in value if isinstance(v, torch.Tensor)]
            elif isinstance(value, dict):
                out += [v for v in value.values() if isinstance(v, torch.Tensor)]
    return out


def test_a_row_the_host_ends_runs_once_more_wasted_and_its_rng_is_as_the_host_left_it(preset, weights) -> None:
    """Overlap's cost, and its bound: the 28-character cut is the host's alone; a sampled duplex row it ends ran
    one iteration more on the device, which the host discards: the session's tokens, KV length and rng equal the
    same steps run without overlap."""
    texts, retired = {}, []
    for overlap in (False, True):
        kv = paged_engine(preset, weights, overlap=overlap)
        release = kv.core.scheduler.release

        def counted(req: Any, retire: bool, release: Any = release) -> None:
            retired.append(retire)
            release(req, retire)

        kv.core.scheduler.release = counted  # type: ignore[method-assign]
        st = stage(preset, kv)
        out = []
        for step in range(4):
            calls = [StageCall(chunk(preset, 1, step, max_new_tokens=40, temperature=1.0, top_k=0, top_p=1.0), 1,
                               start=step == 0)]
            out += st.run(calls)
        texts[overlap] = ([r.generated.tolist() for r in out], [r.kv_length for r in out],
                          st.store.get(1).rng.random())
    assert texts[True] == texts[False]
    assert any(retired), "a row the host's rules ended while the device ran on"


def test_a_prefill_only_request_and_a_long_prefill_in_chunks(preset, weights) -> None:
    """The scheduler's prefill budget: a 300-token prefill goes in chunks of at most `prefill_tokens` beside the
    decoding rows; its logits and the decoding row's tokens are those of the whole prefill run at once."""
    ids = np.random.default_rng(0).integers(0, 250, 300)
    got = {}
    for budget in (2048, 64):
        kv = paged_engine(preset, weights)
        kv.core.scheduler.prefill_tokens = budget
        st = stage(preset, kv)
        res = st.run([StageCall(LlmRequest(input_ids=ids, decode=False), 1, start=True),
                      StageCall(chunk(preset, 2, 0, temperature=0.0, max_new_tokens=10), 2, start=True)])
        got[budget] = [r.kv_length for r in res], res[1].generated.tolist()
        follow = st.run([StageCall(chunk(preset, 1, 1, temperature=0.0), 1)])[0]
        got[budget] += (follow.generated.tolist(),)
    assert got[64] == got[2048] and got[64][0][0] == 300

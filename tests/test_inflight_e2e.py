"""Over a real tritonserver, the `llm` model on the paged engine (decoupled, one engine thread): calls join the
running decode loop between its iterations and each is answered in the iteration its row finishes.

What the loop did is read from each answer's `join_iteration` / `done_iteration` (the engine's forward count when
the row joined, and when it left), and the pool's room from the `minicpmo_<model>_kv_free_blocks` gauge: no wall-clock
window is assumed anywhere; the only waits are for an event (a gauge reaching a value, an answer)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import torch  # noqa: F401 (the llm model serves the paged engine, torch, in tritonserver: the torch-less subset leaves this module out)
import tritonclient.grpc.aio as grpcclient

from minicpmo_triton.errors import from_wire
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import LlmRequest, LlmResult

from .conftest import MODEL_REPOSITORY, RunningTriton, triton_with
from .test_isolation_e2e import llm_call

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.engines]  # engines: a .ci/run step of its own

PAGED = {"MINICPMO_LLM_ENGINE": "paged"}
# a long row: 1500 teacher-forced text tokens, decoded one per iteration (tiny's sampling mask: printable ASCII)
STORY = np.frombuffer(b"Once upon a time a small model told a long story. " * 30, np.uint8).astype(np.int64)
SYSTEM_PROMPT = np.frombuffer(b"You are a helpful, kind and brief voice assistant. " * 6, np.uint8).astype(np.int64)


@pytest.fixture(scope="module")
def paged_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with(PAGED, tmp_path_factory.mktemp("triton_paged"))


def long_row() -> LlmRequest:
    return LlmRequest(input_ids=np.frombuffer(b"Tell me a story.", np.uint8).astype(np.int64), chat=True,
                      forced_ids=STORY, max_new_tokens=len(STORY), temperature=0.0)


async def until(triton: RunningTriton, name: str, holds: object, timeout_s: float = 60) -> float:
    """Waits for the `llm` model's gauge `name` to satisfy `holds` (an event: a call admitted, blocks freed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not holds(value := await asyncio.to_thread(triton.stage_metric, name, "llm")):  # type: ignore[operator]
        assert loop.time() < deadline, f"{name} stayed at {value}"
        await asyncio.sleep(0.01)
    return value


def ok(result: LlmResult | Exception) -> LlmResult:
    assert isinstance(result, LlmResult), result
    return result


async def test_a_session_that_starts_joins_the_running_decode_and_is_answered_first(paged_triton) -> None:
    client = grpcclient.InferenceServerClient(paged_triton.grpc_url)
    try:
        live = await asyncio.to_thread(paged_triton.stage_metric, "live_sequences", "llm")
        talking = asyncio.create_task(llm_call(client, long_row(), 101, start=True))
        await until(paged_triton, "live_sequences", lambda n: n > live)  # admitted: it is in the loop
        joining = ok(await llm_call(client, LlmRequest(input_ids=SYSTEM_PROMPT, decode=False), 102, start=True))
        assert not talking.done(), "the new session's prompt was answered while the long row went on"
        long = ok(await talking)
        assert long.generated.tolist() == STORY.tolist(), "the row that had a session join it decoded undisturbed"
        # it joined the loop mid-decode, its whole prompt in one iteration, and left at once
        assert long.join_iteration < joining.join_iteration < long.done_iteration, (long, joining)
        assert joining.done_iteration == joining.join_iteration + 1, joining
        assert joining.n_prefill == len(SYSTEM_PROMPT) and joining.kv_length == len(SYSTEM_PROMPT)
    finally:
        await client.close()


async def test_end_gives_the_sessions_blocks_back(paged_triton) -> None:
    client = grpcclient.InferenceServerClient(paged_triton.grpc_url)
    try:
        free = await asyncio.to_thread(paged_triton.stage_metric, "kv_free_blocks", "llm")
        ok(await llm_call(client, LlmRequest(input_ids=SYSTEM_PROMPT, decode=False), 201, start=True))
        held = await asyncio.to_thread(paged_triton.stage_metric, "kv_free_blocks", "llm")
        assert held < free, (held, free)
        ok(await llm_call(client, LlmRequest(decode=False), 201, end=True))  # an END-only call: nothing to decode
        assert await asyncio.to_thread(paged_triton.stage_metric, "kv_free_blocks", "llm") == free
    finally:
        await client.close()


async def test_a_row_that_fails_is_answered_with_its_code_and_the_others_run_on(paged_triton) -> None:
    """A rollback past the kept system prompt passes the checks at the door and fails in the loop, as the row is
    prepared: that call alone gets `invalid_input` while another row decodes, which finishes as if alone."""
    client = grpcclient.InferenceServerClient(paged_triton.grpc_url)
    try:
        unit = load_stage_config(MODEL_REPOSITORY / "llm" / "1").tokens.unit
        prompt = np.concatenate([SYSTEM_PROMPT, [unit]])  # the first <unit> ends the kept prompt
        ok(await llm_call(client, LlmRequest(input_ids=prompt, decode=False), 301, start=True))
        live = await asyncio.to_thread(paged_triton.stage_metric, "live_sequences", "llm")
        talking = asyncio.create_task(llm_call(client, long_row(), 302, start=True))
        await until(paged_triton, "live_sequences", lambda n: n > live)
        failed = await llm_call(client, LlmRequest(rollback_to=5, decode=False), 301)
        assert isinstance(failed, Exception) and from_wire(failed.message(), "llm").code == "invalid_input", failed
        assert not talking.done()
        long = ok(await talking)
        assert long.generated.tolist() == STORY.tolist()
        # the failed call left its session as it was: the next one continues from the prompt
        after = ok(await llm_call(client, LlmRequest(input_ids=np.array([65]), decode=False), 301, end=True))
        assert after.cached_tokens == len(prompt), after
    finally:
        await client.close()

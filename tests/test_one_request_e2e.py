"""Over real servers, the device path with the TTS in the llm model's process (`tts_in_llm`): a speaking duplex step
is one llm request (its text, then its codes on the same stream) and one token2wav request, where the tts model's
own path makes three hops; the caller hears and reads exactly what that path says (greedy). The TTS's sequence
follows the LLM's: a session's END gives its TTS blocks back (`minicpmo_llm_tts_kv_free_blocks`), and a TTS pool
with no room refuses the session's first spoken chunk `pool_full` (retryable) as the tts model does, its state freed.
A turn-based reply's voice goes to the llm model's TTS too: the tts model serves nothing and holds no pool.

Hops are counted from Triton's own `nv_inference_request_success` per model, before and after the conversation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch  # noqa: F401 (the llm model serves the paged engine, torch, in tritonserver: the torch-less subset leaves this module out)

from gateway.audio import decode_f32_base64, encode_f32_base64
from minicpmo_client.backend import ConversationResult, converse

from .conftest import RunningTriton, start_gateway, stop_gateway, triton_with
from .helpers import GREEDY, SPEAKING_TEXT, append_message, deltas, open_session, recv_until

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.engines]  # engines: a .ci/run step of its own

DEVICE = {"MINICPMO_LLM_ENGINE": "paged", "MINICPMO_TTS_ENGINE": "paged"}  # on the CPU here
STAGES = ("llm", "tts", "token2wav")


@pytest.fixture(scope="module")
def hops_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """The device path as it was: the tts model a hop of its own."""
    yield from triton_with({**DEVICE, "MINICPMO_TTS_IN_LLM": "0"}, tmp_path_factory.mktemp("triton_hops"))


@pytest.fixture(scope="module")
def one_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """`tts_in_llm` = auto: on, as both engines are the device ones."""
    yield from triton_with(DEVICE, tmp_path_factory.mktemp("triton_one"))


# a TTS pool of one block (16 positions, under the 46 a TTS session is admitted with): every TTS START is refused
NO_TTS_ROOM = {"MINICPMO_TTS_POOL_SIZE": "1e-9"}


@pytest.fixture(scope="module")
def full_hops_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with({**DEVICE, **NO_TTS_ROOM, "MINICPMO_TTS_IN_LLM": "0"}, tmp_path_factory.mktemp("full_hops"))


@pytest.fixture(scope="module")
def full_one_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with({**DEVICE, **NO_TTS_ROOM}, tmp_path_factory.mktemp("full_one"))


def requests(triton: RunningTriton) -> dict[str, float]:
    return {m: triton.metric("nv_inference_request_success", m) for m in STAGES}


async def conversation(triton: RunningTriton, audio: np.ndarray, log: Path
                       ) -> tuple[ConversationResult, dict[str, float]]:
    """A greedy session over the gateway, and the requests each stage served for it (the gateway's health probes,
    requests too, once at its start and then not within the hour)."""
    gw = start_gateway(triton.endpoint, log, health_period_s="3600")
    try:
        before = await asyncio.to_thread(requests, triton)
        result = await converse(gw.ws, audio, realtime=False, config=GREEDY)
    finally:
        stop_gateway(gw)
    await asyncio.to_thread(triton.wait_live, lambda live: live["llm"] == 0)  # its END went through
    after = await asyncio.to_thread(requests, triton)
    return result, {m: after[m] - before[m] for m in STAGES}


def heard(result: ConversationResult) -> tuple[list[str], list[bytes]]:
    """The reply's text deltas and its audio, sample for sample."""
    texts = [e["text"] for e in deltas(result.events, "text")]
    audio = [decode_f32_base64(e["audio"], 1 << 30).tobytes() for e in deltas(result.events, "audio")]
    return texts, audio


async def says_the_same(speech: Any, tmp_path: Path, before_triton: RunningTriton, after_triton: RunningTriton
                        ) -> tuple[ConversationResult, dict[str, float], ConversationResult, dict[str, float]]:
    """The same greedy spoken session over each server: it speaks, and both say the same words and the same voice,
    sample for sample; each one's result and the requests each stage served for it."""
    audio = speech(SPEAKING_TEXT)
    audio = audio[: min(8, len(audio) // 16_000) * 16_000]
    before, before_served = await conversation(before_triton, audio, tmp_path / "gateway_before.log")
    after, after_served = await conversation(after_triton, audio, tmp_path / "gateway_after.log")
    texts, voice = heard(before)
    assert voice, "the tiny model speaks on this input"
    assert heard(after) == (texts, voice), "the same words and the same voice, sample for sample"
    return before, before_served, after, after_served


async def test_a_speaking_step_is_one_llm_request_and_says_what_the_tts_hop_says(hops_triton, one_triton,
                                                                                    speech, tmp_path) -> None:
    _, hops, _, one = await says_the_same(speech, tmp_path, hops_triton, one_triton)
    # the tts model served each speaking step and the END; the one-request path, none: its llm requests are the
    # same ones, token2wav's too, so a speaking step makes two hops where it made three
    assert hops["tts"] >= 2 and hops["token2wav"] == hops["tts"], hops
    assert one == {"llm": hops["llm"], "tts": 0, "token2wav": hops["token2wav"]}, (one, hops)
    # the TTS's session went with the LLM's END: its blocks back, no TTS session left
    assert await asyncio.to_thread(one_triton.stage_metric, "tts_live_sequences", "llm") == 0


async def test_end_gives_the_sessions_tts_blocks_back(one_triton, speech, tmp_path) -> None:
    free = await asyncio.to_thread(one_triton.stage_metric, "tts_kv_free_blocks", "llm")
    audio = speech(SPEAKING_TEXT)
    result, _ = await conversation(one_triton, audio[: min(8, len(audio) // 16_000) * 16_000],
                                   tmp_path / "gateway_end.log")
    assert deltas(result.events, "audio")
    assert await asyncio.to_thread(one_triton.stage_metric, "tts_kv_free_blocks", "llm") == free


async def voiced_chat(triton: RunningTriton, log: Path, voices: tuple[np.ndarray | None, ...] = (None,),
                      max_new_tokens: int = 24) -> tuple[list[dict], dict[str, float]]:
    """A greedy turn-based session of voiced replies, one per entry of `voices` (a turn's own reference, else the
    session's voice), over the gateway; its events and the requests each stage served."""
    gw = start_gateway(triton.endpoint, log, health_period_s="3600")
    events: list[dict] = []
    try:
        before = await asyncio.to_thread(requests, triton)
        ws, _ = await open_session(gw.ws, mode="turn_based", config=GREEDY)
        messages = [{"role": "user", "content": "Hello! Who are you?"}]
        for turn, ref in enumerate(voices):
            extra = {} if ref is None else {"tts_ref_audio": encode_f32_base64(ref)}
            await ws.send(json.dumps({"type": "input.append", "input": {
                "input_id": f"t{turn}", "messages": messages, "max_new_tokens": max_new_tokens,
                "generate_audio": True, **extra}}))
            got = await recv_until(ws, lambda e: e["type"] in ("response.done", "error", "session.closed"), 120)
            events += got
            if got[-1]["type"] != "response.done":
                break
            said = "".join(e["text"] for e in deltas(got, "text"))
            messages = [*messages, {"role": "assistant", "content": said},
                        {"role": "user", "content": f"Tell me more, part {turn}."}]
        await ws.close()
    finally:
        stop_gateway(gw)
    await asyncio.to_thread(triton.wait_live, lambda live: live["llm"] == 0)
    after = await asyncio.to_thread(requests, triton)
    return events, {m: after[m] - before[m] for m in STAGES}


async def test_a_turn_based_voice_goes_to_the_llm_models_tts_and_the_tts_model_holds_no_pool(
        hops_triton, one_triton, tmp_path) -> None:
    before, hops = await voiced_chat(hops_triton, tmp_path / "gateway_hops.log")
    after, one = await voiced_chat(one_triton, tmp_path / "gateway_one.log")
    assert before[-1]["type"] == "response.done" and deltas(before, "audio"), before[-1]
    said = lambda events: ([e["text"] for e in deltas(events, "text")], [e["audio"] for e in deltas(events, "audio")])  # noqa: E731
    assert said(after) == said(before), "the same words and the same voice, sample for sample"
    assert hops["tts"] >= 1 and one["tts"] == 0, (hops, one)
    # each of the tts model's calls is one to the llm model here, but its END: the llm's END ends the TTS
    assert one["llm"] == hops["llm"] + hops["tts"] - 1, (hops, one)
    # one TTS pool on the machine: the llm model's; the tts model loaded none, and holds no session
    assert await asyncio.to_thread(hops_triton.stage_metric, "kv_free_blocks", "tts") > 0
    with pytest.raises(KeyError):
        await asyncio.to_thread(one_triton.stage_metric, "kv_free_blocks", "tts")
    assert await asyncio.to_thread(one_triton.stage_metric, "tts_live_sequences", "llm") == 0
    # ... its bytes the llm model's memory plan's (engine/memory_plan.py), published beside the other pools'
    plan = await asyncio.to_thread(one_triton.metrics_text)
    assert all(f'minicpmo_llm_memory_plan_bytes{{item="pool_{pool}"}}' in plan for pool in ("kv", "audio", "tts"))


async def until_refused(triton: RunningTriton, audio: np.ndarray, log: Path) -> list[dict]:
    """A greedy session's seconds, one at a time, until a step is refused; its events."""
    gw = start_gateway(triton.endpoint, log, health_period_s="3600")
    events: list[dict] = []
    try:
        ws, _ = await open_session(gw.ws)
        try:
            for second in range(len(audio) // 16_000):
                await ws.send(append_message(audio[second * 16_000:(second + 1) * 16_000], f"in_{second}"))
                events += await recv_until(ws, lambda e: e.get("chunk_usage") is not None or e["type"] in (
                    "error", "session.closed"), 60)
                if events[-1]["type"] != "response.output.delta":
                    break
        finally:
            await ws.close()
    finally:
        stop_gateway(gw)
    return events


async def test_a_full_tts_pool_refuses_the_first_spoken_chunk_as_the_tts_model_does(full_hops_triton, full_one_triton,
                                                                                    speech, tmp_path) -> None:
    audio = speech(SPEAKING_TEXT)
    hops = await until_refused(full_hops_triton, audio, tmp_path / "gateway_hops.log")
    one = await until_refused(full_one_triton, audio, tmp_path / "gateway_one.log")
    said = lambda events: [(e["type"], e.get("kind"), e.get("text")) for e in events if e["type"] != "error"]  # noqa: E731
    assert said(one) == said(hops) and deltas(one, "text"), "the same steps, the text said before the refusal"
    for events in (hops, one):
        errors = [e["error"] for e in events if e["type"] == "error"]
        assert errors and errors[0]["code"] == "pool_full" and errors[0]["retryable"], json.dumps(events[-3:])
    # no state is left of the refused sequence, nor of the session
    await asyncio.to_thread(full_one_triton.wait_live, lambda live: live["llm"] == 0)
    assert await asyncio.to_thread(full_one_triton.stage_metric, "tts_live_sequences", "llm") == 0

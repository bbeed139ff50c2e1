"""One caller never hurts another, over the real servers: the `llm` model called directly with gRPC (past the
gateway on purpose: the gateway refuses these inputs itself), and the gateway's own refusals."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
import websockets
from tritonclient.utils import InferenceServerException

from gateway.audio import encode_f32_base64
from gateway.triton.decoupled import infer_decoupled
from minicpmo_triton.errors import from_wire
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import STAGE_IO, LlmRequest, LlmResult, decode, encode

from .conftest import MODEL_REPOSITORY
from .helpers import GREEDY, OTHER_TEXT, append_message, deltas, init_message, open_session, recv_until

pytestmark = pytest.mark.asyncio(loop_scope="function")
_DTYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.bool_): "BOOL"}
NAN, INF = float("nan"), float("inf")


def _inputs(request: Any) -> list[grpcclient.InferInput]:
    out = []
    with np.errstate(over="ignore"):  # a temperature of 1e39 is inf once float32, as a client's would be
        tensors = encode(request)
    for name, value in tensors.items():
        if value.size == 0:
            continue  # optional: the stage's default
        t = grpcclient.InferInput(name, [1, *value.shape], _DTYPES[value.dtype])
        t.set_data_from_numpy(value[None])
        out.append(t)
    return out


async def stage_call(client: grpcclient.InferenceServerClient, model: str, request: Any, corr: int,
                     start: bool = False, end: bool = False) -> Any:
    """One call of a decoupled stage model: its result (the model's `stage_io` result), or the server's error."""
    try:
        result = await infer_decoupled(client, model, _inputs(request), sequence_id=corr, sequence_start=start,
                                       sequence_end=end)
    except InferenceServerException as exc:
        return exc
    return decode(STAGE_IO[model][1], lambda name: None if (v := result.as_numpy(name)) is None else v[0])


async def llm_call(client: grpcclient.InferenceServerClient, request: LlmRequest, corr: int,
                   start: bool = False, end: bool = False) -> LlmResult | Exception:
    return await stage_call(client, "llm", request, corr, start, end)  # type: ignore[no-any-return]


# The cases that once got through: settings the init let through, and enormous audio with default settings.
HOSTILE_ROWS: dict[str, tuple[dict[str, Any], str]] = {
    "nan_temperature": ({"temperature": NAN}, "invalid_config"),
    "temperature_overflowing_float32": ({"temperature": 1e39}, "invalid_config"),  # inf once float32
    "repetition_penalty_0": ({"repetition_penalty": 0.0}, "invalid_config"),
    "negative_length_penalty": ({"length_penalty": -1.0}, "invalid_config"),
    "enormous_audio_default_settings": ({"audio_scale": 1e30}, "bad_audio"),
}


def _chunk(preset: Any, audio: np.ndarray, **settings: Any) -> LlmRequest:
    tk = preset.tokens
    ids = np.array([tk.unit] + [tk.audio_placeholder] * preset.audio_tokens(len(audio)), np.int64)
    scale = settings.pop("audio_scale", 1.0)
    return LlmRequest(input_ids=ids, audio=(audio * np.float32(scale)).astype(np.float32), seed=7, **settings)


def _outputs(res: LlmResult) -> tuple:
    return (res.generated.tolist(), res.text_ids.tolist(), res.kv_length, res.tts_hidden.tobytes())


async def test_a_hostile_sequence_never_changes_a_clean_one_batched_beside_it(triton, speech) -> None:
    """Two sequences step together, one hostile: the hostile one gets its code, the clean one bit for bit
    its solo output, whether or not the batcher put them in one execute() (counted from Triton's metrics)."""
    preset = load_stage_config(MODEL_REPOSITORY / "llm" / "1")
    audio = speech(OTHER_TEXT)
    seconds = [audio[i * 16_000:(i + 1) * 16_000] for i in range(3)]
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        solo = []
        for step, second in enumerate(seconds):  # the reference: the clean sequence alone (default settings)
            res = await llm_call(client, _chunk(preset, second), 5000, start=step == 0)
            assert not isinstance(res, Exception), res
            solo.append(_outputs(res))
        await llm_call(client, LlmRequest(decode=False), 5000, end=True)
        assert any(out[0] for out in solo), "the clean sequence decodes"

        batched = pairs = 0
        for i, (name, (settings, code)) in enumerate(HOSTILE_ROWS.items()):
            clean_id, hostile_id = 5100 + i, 5200 + i
            for step, second in enumerate(seconds):
                before = triton.metric("nv_inference_exec_count", "llm")
                clean, hostile = await asyncio.gather(
                    llm_call(client, _chunk(preset, second), clean_id, start=step == 0),
                    llm_call(client, _chunk(preset, second, **settings), hostile_id, start=step == 0))
                pairs += 1
                batched += triton.metric("nv_inference_exec_count", "llm") - before == 1
                assert isinstance(hostile, InferenceServerException), (name, hostile)
                assert from_wire(hostile.message(), "llm").code == code, (name, hostile.message())
                assert not isinstance(clean, Exception), (name, clean)
                assert _outputs(clean) == solo[step], (name, step)
            for corr in (clean_id, hostile_id):
                await llm_call(client, LlmRequest(decode=False), corr, end=True)
        print(f"{pairs} hostile/clean pairs, {batched} of them run in one execute()")
        assert batched > 0, "no pair was batched: the test showed nothing about batches"
        live = triton.wait_live(lambda live: live["llm"] == 0)
        assert live["llm"] == 0, live
    finally:
        await client.close()


HOSTILE_CONFIGS = [
    {"temperature": NAN}, {"temperature": 1e39}, {"temperature": INF}, {"repetition_penalty": 0},
    {"length_penalty": -1}, {"top_k": 10**20}, {"seed": -1}, {"seed": 2**63}, {"top_p": 0},
    {"force_listen_count": 10**20}, {"tts_temperature": NAN},
]


@pytest.mark.parametrize("config", HOSTILE_CONFIGS, ids=[json.dumps(c) for c in HOSTILE_CONFIGS])
async def test_out_of_range_settings_are_refused_at_init(gateway, config: dict[str, Any]) -> None:
    async with websockets.connect(gateway.ws) as ws:
        await ws.send(init_message(config))  # json.dumps writes NaN / Infinity, which Python's json reads
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["type"] == "error" and err["error"]["code"] == "invalid_config", err
        assert next(iter(config)) in err["error"]["message"]
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
        assert info.value.rcvd.code == 1008


async def test_audio_outside_the_bound_is_bad_audio_and_the_session_goes_on(gateway, speech) -> None:
    """Finite but enormous samples (they made NaN logits with default settings) are refused at the door."""
    second = speech(OTHER_TEXT)[:16_000]
    solo_ws, _ = await open_session(gateway.ws, config=GREEDY)
    await solo_ws.send(append_message(second, "ok"))
    solo = await recv_until(solo_ws, lambda e: e.get("input_id") == "ok" and e.get("chunk_usage"))
    await solo_ws.close()

    ws, _ = await open_session(gateway.ws, config=GREEDY)
    hostile = [second * np.float32(1e30), np.full(16_000, 2.5, np.float32), np.full(16_000, -3.4e38, np.float32),
               np.concatenate([second[:-1], [np.float32(np.inf)]])]
    for i, audio in enumerate(hostile):
        await ws.send(json.dumps({"type": "input.append",
                                  "input": {"input_id": f"bad_{i}", "audio": encode_f32_base64(audio)}}))
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["type"] == "error" and err["error"]["code"] == "bad_audio", err
    await ws.send(append_message(second, "ok"))
    events = await recv_until(ws, lambda e: e.get("input_id") == "ok" and e.get("chunk_usage"))
    await ws.close()
    strip = lambda evs: [(e["kind"], e.get("text"), e["metrics"]["kv_cache_length"]) for e in deltas(evs)]  # noqa: E731 (a one-line helper)
    assert strip(events) == strip(solo)  # the refused appends left no trace


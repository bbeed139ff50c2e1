"""Full-duplex sessions end to end: real tritonserver, real gateway process, real WebSockets, espeak-ng speech."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import websockets

from gateway.audio import decode_f32_base64
from minicpmo_client.backend import converse
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import StepEvent, StepInput

from .conftest import MODEL_REPOSITORY
from .helpers import (
    GREEDY,
    OTHER_TEXT,
    SPEAKING_TEXT,
    append_message,
    audio_of,
    default_ref_tokens,
    deltas,
    open_session,
    recv_until,
    transcript,
)

pytestmark = pytest.mark.asyncio(loop_scope="function")
MAX_CHUNKS = 8  # within the gateway's queue of pending appends when sent at once


def chunks_of(audio: np.ndarray) -> np.ndarray:
    """Whole seconds only, so every step brings exactly 10 audio tokens."""
    return audio[: min(MAX_CHUNKS, len(audio) // 16_000) * 16_000]


async def test_health_reports_ready(gateway_factory) -> None:
    """A gateway of its own: the shared one may still hold an earlier test's session (a realtime session outlives
    its socket for the resume grace), so its count would depend on which tests ran before."""
    health = gateway_factory().health()
    assert health["status"] == "ready"
    assert health["backend"] == "triton"
    assert health["active_sessions"] == 0


async def test_websocket_compression_is_off_unless_asked(gateway_factory) -> None:
    """The client offers permessage-deflate (websockets does by default); it costs ms per 1 s append.
    Gateways of its own: a realtime session outlives its socket for the resume grace."""
    for gw, negotiated in ((gateway_factory(), False), (gateway_factory(ws_deflate="1"), True)):
        for url in (gw.ws, gw.realtime):
            async with websockets.connect(url) as ws:
                extensions = ws.response.headers.get("Sec-WebSocket-Extensions") or ""
                assert ("permessage-deflate" in extensions) is negotiated, (url, extensions)


async def test_listen_and_speak_deltas_and_audio_shape(gateway, speech) -> None:
    result = await converse(gateway.ws, chunks_of(speech(SPEAKING_TEXT)), realtime=False, config=GREEDY)
    kinds = {e["kind"] for e in deltas(result.events)}
    assert {"listen", "text", "audio"} <= kinds, transcript(result.events)
    # The first 3 chunks are always listened to (force_listen_count), as MiniCPM-o does.
    assert [e["kind"] for e in deltas(result.events)[:3]] == ["listen"] * 3
    audio_deltas = deltas(result.events, "audio")
    for ev in audio_deltas:
        wav = decode_f32_base64(ev["audio"], 1 << 30)
        assert ev["sample_rate"] == 24_000
        assert wav.dtype == np.float32 and len(wav) == ev["audio_samples"]
        assert np.isfinite(wav).all() and 0 < np.abs(wav).max() <= 1.0
    # Mid-turn deltas are exactly one second at 24 kHz (25 speech tokens x 960 samples).
    assert all(e["audio_samples"] == 24_000 for e in audio_deltas)
    spoken = {e["response_id"] for e in deltas(result.events) if e["kind"] in ("text", "audio")}
    assert len(spoken) >= 1 and all(r.startswith("resp_") for r in spoken)
    usage = [e["usage"] for e in result.events if "usage" in e]
    # 10 audio tokens per second, and the system prompt's default voice reference
    assert usage[-1]["input_audio_tokens"] == 10 * len(result.timings) + default_ref_tokens(MODEL_REPOSITORY)
    assert usage[-1]["output_speech_tokens"] == 25 * len(audio_deltas)


async def test_force_listen_ends_the_spoken_turn(gateway, speech) -> None:
    audio = chunks_of(speech(SPEAKING_TEXT))
    first = await converse(gateway.ws, audio, realtime=False, config=GREEDY)
    speaking = [int(e["input_id"][3:]) for e in deltas(first.events, "audio")]
    assert speaking, "the tiny model should speak on this input"
    k = speaking[0] + 1
    assert k < len(first.timings), "need a chunk after the model starts speaking"
    second = await converse(gateway.ws, audio, realtime=False, config=GREEDY, force_listen_chunks={k})
    at_k = [e for e in deltas(second.events) if e["input_id"] == f"in_{k}"]
    assert [e["kind"] for e in at_k] == ["listen"]
    # a listen result ends no turn, as the reference's (`_make_generate_result`'s default): the model's turn is
    # closed all the same (<|turn_eos|> fed first, modeling_minicpmo_unified.py:5003-5011), which kv_cache_length
    # counts, and what it says next is a new response
    assert "end_of_turn" not in at_k[0]
    later = [e for e in deltas(second.events, "text") if int(e["input_id"][3:]) > k]
    before_k = {e["response_id"] for e in deltas(second.events, "text") if int(e["input_id"][3:]) < k}
    assert not later or later[0]["response_id"] not in before_k
    # everything before the forced listen is what the model did unforced (greedy decoding)
    before = [t for t in transcript(first.events) if int(t[0][3:]) < k]
    assert [t for t in transcript(second.events) if int(t[0][3:]) < k] == before


async def test_concurrent_sessions_keep_their_own_state(gateway, triton, speech) -> None:
    a, b = chunks_of(speech(SPEAKING_TEXT)), chunks_of(speech(OTHER_TEXT))
    alone_a = await converse(gateway.ws, a, realtime=False, config=GREEDY)
    alone_b = await converse(gateway.ws, b, realtime=False, config=GREEDY)
    assert transcript(alone_a.events) != transcript(alone_b.events), "inputs must differ for this test to mean much"
    counters = lambda: (triton.metric("nv_inference_count", "llm"), triton.metric("nv_inference_exec_count", "llm"))  # noqa: E731 (a one-line helper)
    before = counters()
    both = await asyncio.gather(*(converse(gateway.ws, x, realtime=False, config=GREEDY) for x in (a, b, a, b)))
    for alone, together in zip((alone_a, alone_b, alone_a, alone_b), both, strict=True):
        assert transcript(together.events) == transcript(alone.events)
        np.testing.assert_allclose(audio_of(together.events), audio_of(alone.events), atol=1e-4)
    inferences, executions = (after - was for after, was in zip(counters(), before, strict=True))
    assert executions < inferences, "the four sessions' LLM steps should share execute() calls"


async def test_triton_path_matches_the_stages_called_in_process(gateway, speech) -> None:
    audio = chunks_of(speech(SPEAKING_TEXT))
    served = await converse(gateway.ws, audio, realtime=False, config=GREEDY)
    stages = InProcessStages(MODEL_REPOSITORY)
    pipeline = stages.pipeline()
    events: list[tuple[int, StepEvent]] = []
    n = len(audio) // 16_000 + (len(audio) % 16_000 > 0)
    options = DuplexOptions.from_config(GREEDY)
    for i in range(n):
        async def emit(ev: StepEvent, i: int = i) -> None:
            events.append((i, ev))
        await pipeline.step(1, i == 0, i == n - 1, StepInput(audio=audio[i * 16_000:(i + 1) * 16_000],
                                                             options=options), emit)
    assert [(f"in_{i}", e.kind, e.text) for i, e in events] == transcript(served.events)
    direct = np.concatenate([e.audio for _, e in events if e.kind == "audio"])
    np.testing.assert_allclose(audio_of(served.events), direct, atol=1e-4)
    assert stages.llm_stage.live_sequences == 0 and stages.tts_stage.live_sequences == 0


async def test_http_close_ends_the_triton_sequence(gateway, triton, speech) -> None:
    audio = speech(SPEAKING_TEXT)
    ws, created = await open_session(gateway.ws)
    session_id = created["session_id"]
    for i in range(2):
        await ws.send(append_message(audio[i * 16_000:(i + 1) * 16_000], f"in_{i}"))
    await recv_until(ws, lambda e: e.get("input_id") == "in_1")
    live = triton.live()
    assert live["duplex"] >= 1 and live["llm"] >= 1
    assert gateway.health()["active_sessions"] == 1
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"{gateway.http}/sessions/{session_id}/close", json={"reason": "test_done"})
    assert resp.status_code == 200 and resp.json() == {"ok": True, "session_id": session_id, "closed": True}
    closed = await recv_until(ws, lambda e: e["type"] == "session.closed")
    assert closed[-1]["reason"] == "test_done"
    assert closed[-1]["usage"]["input_audio_tokens"] == 20 + default_ref_tokens(MODEL_REPOSITORY)
    with pytest.raises(websockets.ConnectionClosed) as info:
        await ws.recv()
    assert info.value.rcvd.code == 1000
    # freed before the HTTP reply: no waiting needed
    assert triton.live() == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}
    async with httpx.AsyncClient() as http:
        again = await http.post(f"{gateway.http}/sessions/{session_id}/close")
    assert again.status_code == 404


async def test_client_disconnect_ends_the_triton_sequence(gateway, triton, speech) -> None:
    audio = speech(SPEAKING_TEXT)
    ws, _ = await open_session(gateway.ws)
    for i in range(5):
        await ws.send(append_message(audio[i * 16_000:(i + 1) * 16_000], f"in_{i}"))
    await recv_until(ws, lambda e: e.get("input_id") == "in_0")
    assert triton.live()["llm"] >= 1
    await ws.close()  # with steps still queued and in flight
    live = triton.wait_live(lambda lv: not any(lv.values()))
    assert live == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}
    assert gateway.health()["active_sessions"] == 0


async def test_gateway_shutdown_ends_sequences(gateway_factory, triton, speech) -> None:
    gw = gateway_factory()
    ws, _ = await open_session(gw.ws)
    await ws.send(append_message(speech(SPEAKING_TEXT)[:16_000], "in_0"))
    await recv_until(ws, lambda e: e.get("input_id") == "in_0")
    assert triton.live()["duplex"] >= 1
    gw.process.terminate()
    closed = await recv_until(ws, lambda e: e["type"] == "session.closed")
    assert closed[-1]["reason"] == "server_shutdown"
    with pytest.raises(websockets.ConnectionClosed) as info:
        await ws.recv()
    assert info.value.rcvd.code == 1001
    assert triton.wait_live(lambda lv: not any(lv.values())) == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}


async def test_not_ready_is_answered_with_1013(gateway_factory) -> None:
    gw = gateway_factory(triton_url="127.0.0.1:9", wait_ready=False)  # nothing listens there
    assert gw.health()["status"] == "loading"
    async with websockets.connect(gw.ws) as ws:
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["type"] == "error" and err["error"]["code"] == "not_ready"
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
        assert info.value.rcvd.code == 1013


async def test_session_limit_is_enforced(gateway_factory, speech) -> None:
    gw = gateway_factory(max_sessions="2")
    first, _ = await open_session(gw.ws)
    second, _ = await open_session(gw.ws)
    async with websockets.connect(gw.ws) as third:
        await third.send(json.dumps({"type": "session.init", "payload": {}}))
        err = json.loads(await asyncio.wait_for(third.recv(), 10))
        assert err["type"] == "error" and err["error"]["code"] == "too_many_sessions"
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(third.recv(), 10)
        assert info.value.rcvd.code == 1013
    assert gw.health()["active_sessions"] == 2
    await first.close()
    for _ in range(50):
        if gw.health()["active_sessions"] == 1:
            break
        await asyncio.sleep(0.1)
    fourth, _ = await open_session(gw.ws)  # a freed slot is usable again
    await fourth.send(append_message(speech(OTHER_TEXT)[:16_000], "in_0"))
    events = await recv_until(fourth, lambda e: e.get("input_id") == "in_0")
    assert deltas(events)[0]["kind"] == "listen"
    await second.close()
    await fourth.close()


@pytest.mark.parametrize(
    ("first_message", "code", "close_code"),
    [
        ("not json at all", "invalid_json", 1003),
        (json.dumps({"type": "input.append", "input": {}}), "invalid_first_message", 1008),
        (json.dumps({"type": "session.init"}), "missing_field", 1008),
        (json.dumps({"type": "session.init", "payload": {"mode": "half_duplex"}}), "invalid_mode", 1008),
        (json.dumps({"type": "session.init", "payload": {"config": {"temperature": "hot"}}}), "invalid_config", 1008),
        (json.dumps(["session.init"]), "invalid_payload", 1008),
    ],
)
async def test_bad_first_message_is_answered_with_an_error(gateway, first_message, code, close_code) -> None:
    async with websockets.connect(gateway.ws) as ws:
        await ws.send(first_message)
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["type"] == "error" and err["error"]["code"] == code, err
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
        assert info.value.rcvd.code == close_code
    assert gateway.health()["active_sessions"] == 0


async def test_bad_inputs_mid_session_are_rejected_and_the_session_goes_on(gateway, speech) -> None:
    ws, _ = await open_session(gateway.ws)
    bad = [
        ({"type": "input.append", "input": {"audio": "***not base64***"}}, "bad_audio"),
        ({"type": "input.append", "input": {"audio": "AAAAAAA="}}, "bad_audio"),  # 5 bytes: not float32s
        ({"type": "input.append", "input": {}}, "missing_field"),
        ({"type": "input.wiggle"}, "unknown_event"),
        ({"type": "session.init", "payload": {}}, "already_initialized"),
    ]
    for message, code in bad:
        await ws.send(json.dumps(message))
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["type"] == "error" and err["error"]["code"] == code, (message, err)
    await ws.send(append_message(speech(OTHER_TEXT)[:16_000], "ok_0"))
    events = await recv_until(ws, lambda e: e.get("input_id") == "ok_0")
    assert deltas(events)[-1]["kind"] == "listen"
    await ws.close()


async def test_input_context_is_accepted(gateway, speech) -> None:
    ws, _ = await open_session(gateway.ws)
    await ws.send(append_message(speech(OTHER_TEXT)[:16_000], "in_0"))
    await ws.send(json.dumps({"type": "input.context", "input_id": "ctx_1",
                              "context": {"text": "the table is booked", "kind": "tool_result",
                                          "operation_id": "op_7", "respond": False}}))
    events = await recv_until(ws, lambda e: e["type"] == "input.context.accepted")
    accepted = events[-1]
    assert accepted["operation_id"] == "op_7" and accepted["respond"] is False
    assert accepted["context_kind"] == "tool_result" and accepted["input_id"] == "ctx_1"
    ctx_deltas = [e for e in deltas(events) if e["input_id"] == "ctx_1"]
    assert [e["kind"] for e in ctx_deltas] == ["listen"]  # respond: false keeps the model listening
    assert ctx_deltas[0]["chunk_usage"]["input_text_tokens"] > 0
    await ws.close()


async def test_a_context_injection_changes_what_the_model_is_conditioned_on(gateway, speech) -> None:
    audio = chunks_of(speech(SPEAKING_TEXT))

    async def run(context: str | None) -> list[dict]:
        ws, _ = await open_session(gateway.ws)
        if context is not None:
            await ws.send(json.dumps({"type": "input.context", "input_id": "ctx",
                                      "context": {"text": context, "respond": False}}))
            await recv_until(ws, lambda e: e["type"] == "input.context.accepted")
        for i in range(len(audio) // 16_000):
            await ws.send(append_message(audio[i * 16_000:(i + 1) * 16_000], f"in_{i}"))
        last = f"in_{len(audio) // 16_000 - 1}"
        events = await recv_until(ws, lambda e: e.get("input_id") == last, 60)
        await ws.close()
        return [e for e in deltas(events) if e["input_id"] != "ctx"]

    plain, informed = await run(None), await run("The user's name is Ada and she is booking a trip to Lisbon.")
    grown = informed[0]["metrics"]["kv_cache_length"] - plain[0]["metrics"]["kv_cache_length"]
    assert grown > 40  # the context's tokens are in the LLM's cache before the first chunk
    assert [(e["kind"], e.get("text")) for e in informed] != [(e["kind"], e.get("text")) for e in plain]

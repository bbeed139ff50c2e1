"""turn_based mode on /backend over the real server: multi-turn chat with the KV cache reused."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import websockets

from gateway.audio import decode_f32_base64, encode_f32_base64

from .conftest import MODEL_REPOSITORY
from .helpers import GREEDY, default_ref_tokens, deltas, open_session, recv_until, utterance_audio_tokens

pytestmark = pytest.mark.asyncio(loop_scope="function")


async def turn(ws: websockets.ClientConnection, messages: list[dict], **options) -> list[dict]:
    await ws.send(json.dumps({"type": "input.append", "input": {"input_id": "t", "messages": messages, **options}}))
    return await recv_until(ws, lambda e: e["type"] in ("response.done", "error", "session.closed"), 60)


async def test_multi_turn_chat_reuses_the_context(gateway, triton) -> None:
    ws, created = await open_session(gateway.ws, mode="turn_based")
    assert created["mode"] == "turn_based"
    history = [{"role": "user", "content": "Hello! Who are you?"}]
    first = await turn(ws, history, max_new_tokens=24)
    done1 = first[-1]
    assert done1["type"] == "response.done" and done1["reason"] in ("turn_end", "length")
    assert done1["text"] == "".join(e["text"] for e in deltas(first, "text")) and done1["text"]
    assert done1["metrics"]["cached_tokens"] == 0
    assert {e["response_id"] for e in deltas(first)} == {done1["response_id"]}
    history += [{"role": "assistant", "content": done1["text"]}, {"role": "user", "content": "Tell me more."}]
    second = (await turn(ws, history, max_new_tokens=16))[-1]
    # turn two sees turn one: its context is reused from the LLM stage's cache, only the new messages prefilled
    assert second["metrics"]["cached_tokens"] == done1["metrics"]["kv_cache_length"]
    assert second["metrics"]["n_prefill"] < done1["metrics"]["n_prefill"]
    assert second["usage"]["output_text_tokens"] == (done1["chunk_usage"]["output_text_tokens"]
                                                     + second["chunk_usage"]["output_text_tokens"])
    # a client that rewrites the past gets a rebuilt context, not a wrong one
    edited = [{"role": "user", "content": "Something else entirely."}]
    third = (await turn(ws, edited, max_new_tokens=8))[-1]
    assert third["metrics"]["cached_tokens"] == 0
    assert triton.live()["llm"] >= 1
    await ws.close()
    assert triton.wait_live(lambda lv: not any(lv.values())) == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}


async def test_streaming_and_non_streaming_agree(gateway) -> None:
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    streamed_ws, _ = await open_session(gateway.ws, mode="turn_based", config=GREEDY)
    whole_ws, _ = await open_session(gateway.ws, mode="turn_based", config=GREEDY)
    streamed, whole = await asyncio.gather(turn(streamed_ws, messages, max_new_tokens=40, streaming=True),
                                           turn(whole_ws, messages, max_new_tokens=40, streaming=False))
    assert deltas(streamed, "text") and not deltas(whole)
    assert whole[-1]["text"] == streamed[-1]["text"] == "".join(e["text"] for e in deltas(streamed, "text"))
    await streamed_ws.close()
    await whole_ws.close()


async def test_audio_in_and_out(gateway, speech) -> None:
    ws, _ = await open_session(gateway.ws, mode="turn_based")
    question = speech("What time does the museum open tomorrow?")
    messages = [{"role": "user", "content": [{"type": "audio", "audio": encode_f32_base64(question)}]}]
    streamed = await turn(ws, messages, max_new_tokens=32, generate_audio=True)
    done = streamed[-1]
    # the question, and the system prompt's default voice reference (a first turn's prefix, as in duplex)
    assert done["chunk_usage"]["input_audio_tokens"] == (utterance_audio_tokens(len(question))
                                                         + default_ref_tokens(MODEL_REPOSITORY))
    audio = [decode_f32_base64(e["audio"], 1 << 30) for e in deltas(streamed, "audio")]
    assert audio and all(len(a) == e["audio_samples"] for a, e in zip(audio, deltas(streamed, "audio"), strict=True))
    assert done["chunk_usage"]["output_speech_tokens"] > 0 and done.get("audio") is None  # streamed already
    ws2, _ = await open_session(gateway.ws, mode="turn_based")
    whole = (await turn(ws2, messages, max_new_tokens=32, generate_audio=True, streaming=False))[-1]
    wav = decode_f32_base64(whole["audio"], 1 << 30)
    assert len(wav) > 24_000 and np.isfinite(wav).all()
    await ws.close()
    await ws2.close()


async def test_bad_turns_are_rejected_and_the_session_goes_on(gateway) -> None:
    ws, _ = await open_session(gateway.ws, mode="turn_based")
    for messages, code in [
        ([{"role": "user", "content": [{"type": "image", "image": "AAAA"}]}], "bad_image"),  # not an image
        ([{"role": "robot", "content": "hi"}], "invalid_payload"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "invalid_chat"),
        ([], "missing_field"),
    ]:
        err = (await turn(ws, messages))[-1]
        assert err["type"] == "error" and err["error"]["code"] == code, (messages, err)
    ok = (await turn(ws, [{"role": "user", "content": "Still there?"}], max_new_tokens=4))[-1]
    assert ok["type"] == "response.done"
    await ws.close()


async def test_a_turn_can_bring_its_own_voice(gateway, speech) -> None:
    ws, _ = await open_session(gateway.ws, mode="turn_based")
    ask = [{"role": "user", "content": "Say something, please."}]
    plain = (await turn(ws, ask, max_new_tokens=16, generate_audio=True, streaming=False))[-1]
    ref = encode_f32_base64(speech("This is how I sound when I speak.", voice="en+f3")[:32_000])
    voiced = (await turn(ws, ask, max_new_tokens=16, generate_audio=True, streaming=False,
                         tts={"enabled": True, "ref_audio_data": ref}))[-1]
    assert voiced["text"] == plain["text"]  # the same words (greedy, the same context) ...
    a, b = decode_f32_base64(voiced["audio"], 1 << 30), decode_f32_base64(plain["audio"], 1 << 30)
    assert len(a) == len(b) > 0 and not np.allclose(a, b, atol=1e-3)  # ... in another voice
    bad = await turn(ws, ask, tts_ref_audio=encode_f32_base64(np.zeros(800, np.float32)))
    assert bad[-1]["type"] == "error" and bad[-1]["error"]["code"] == "invalid_voice"
    again = (await turn(ws, ask, max_new_tokens=16, generate_audio=True, streaming=False))[-1]
    assert again["text"] == plain["text"]  # the session goes on, in its own voice again
    np.testing.assert_allclose(decode_f32_base64(again["audio"], 1 << 30), b, atol=1e-4)
    await ws.close()

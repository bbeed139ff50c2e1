"""Over the real servers: past token2wav's bound on new voices being prepared (`voice_prep_queue`, here 0: every new
reference is past it) a session bringing a new voice is refused `queue_full` when its first spoken step reaches
token2wav, told it may retry (`retryable`, close 1013), and leaves no stage state behind; a session with the default
voice beside it speaks on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import numpy as np
import pytest
import websockets

from gateway.audio import encode_f32_base64
from minicpmo_client.backend import converse

from .conftest import RunningTriton, start_gateway, stop_gateway, triton_with
from .helpers import GREEDY, SPEAKING_TEXT, audio_of, open_session


@pytest.fixture(scope="module")
def no_new_voices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with({"MINICPMO_VOICE_PREP_QUEUE": "0"}, tmp_path_factory.mktemp("triton_voice_queue"))


async def voiced_session(url: str, audio: np.ndarray, voice: np.ndarray) -> tuple[list[dict], int | None]:
    ws, _ = await open_session(url, voice={"tts_ref_audio": encode_f32_base64(voice)})
    for i in range(len(audio) // 16_000):
        await ws.send(json.dumps({"type": "input.append", "input": {
            "input_id": f"in_{i}", "audio": encode_f32_base64(audio[i * 16_000:(i + 1) * 16_000])}}))
    events: list[dict] = []
    with pytest.raises(websockets.ConnectionClosed):
        async with asyncio.timeout(120):
            while True:
                events.append(json.loads(await ws.recv()))
    return events, ws.close_code


async def test_a_new_voice_past_the_queue_bound_is_refused_as_retryable(no_new_voices, tmp_path, speech) -> None:
    gw = start_gateway(no_new_voices.endpoint, tmp_path / "gateway.log")
    audio = speech(SPEAKING_TEXT)[: 8 * 16_000]
    voice = speech("This is how I sound when I speak.", voice="en+f3")[: 2 * 16_000]
    try:
        (events, code), plain = await asyncio.gather(voiced_session(gw.ws, audio, voice),
                                                     converse(gw.ws, audio, realtime=False, config=GREEDY))
        errors = [e for e in events if e["type"] == "error"]
        assert errors and errors[0]["error"]["code"] == "queue_full" and errors[0]["error"]["retryable"], events
        assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "queue_full" and code == 1013
        assert len(audio_of(plain.events)) > 0  # the default voice's session beside it spoke
        live = await asyncio.to_thread(no_new_voices.wait_live, lambda lv: not any(lv.values()), 20)
        assert not any(live.values()), live
    finally:
        stop_gateway(gw)

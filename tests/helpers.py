"""Small client-side helpers shared by the end-to-end tests."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import websockets

from gateway.audio import decode_f32_base64, encode_f32_base64

GREEDY = {"do_sample": False}


def default_ref_tokens(repository: Any) -> int:
    """Audio tokens of the duplex system prompt's default voice reference (10 a second on tiny): they count in
    a session's input audio, as a reference the caller sends does."""
    from minicpmo_triton.stages.voice_prompt import default_ref_audio

    ref = default_ref_audio(repository / "duplex" / "1")
    return 0 if ref is None else utterance_audio_tokens(len(ref))


SPEAKING_TEXT = ("Good morning. Could you please tell me what the weather will be like tomorrow in Paris? "
                 "I am planning a long walk along the river.")
OTHER_TEXT = "One two three four five six seven eight nine ten. Eleven twelve thirteen fourteen fifteen."


def utterance_audio_tokens(n_samples: int) -> int:
    """The LLM tokens MiniCPM-o makes of a whole utterance (up to 30 s) at 16 kHz: ceil(n / 160) mel frames,
    halved by the stride-2 conv (rounding up), pooled by 5 (rounding down); OpenBMB/MiniCPM-o-Demo
    MiniCPMO45/processing_minicpmo.py:1043-1046 `get_audio_placeholder`, modeling_minicpmo_unified.py:1327."""
    return ((-(-n_samples // 160) - 1) // 2 + 1 - 5) // 5 + 1


def init_message(config: dict[str, Any] | None = None, **payload: Any) -> str:
    return json.dumps({"type": "session.init", "payload": {"mode": "full_duplex", "config": config or GREEDY,
                                                           **payload}})


def append_message(audio: np.ndarray, input_id: str, **extra: Any) -> str:
    return json.dumps({"type": "input.append", "input": {"input_id": input_id, "audio": encode_f32_base64(audio),
                                                         **extra}})


async def open_session(url: str, **init: Any) -> tuple[websockets.ClientConnection, dict[str, Any]]:
    ws = await websockets.connect(url, max_size=32 * 1024 * 1024)
    await ws.send(init_message(**init))
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created", created
    return ws, created


async def recv_until(ws: websockets.ClientConnection, predicate: Any, timeout_s: float = 30.0) -> list[dict]:
    """Receive events until one satisfies `predicate`; return all of them."""
    import asyncio

    events = []
    async with asyncio.timeout(timeout_s):
        while True:
            ev = json.loads(await ws.recv())
            events.append(ev)
            if predicate(ev):
                return events


def deltas(events: list[dict], kind: str | None = None) -> list[dict]:
    return [e for e in events if e.get("type") == "response.output.delta" and (kind is None or e["kind"] == kind)]


def transcript(events: list[dict]) -> list[tuple[str, str, str]]:
    """(input_id, kind, text) per delta: what a session said and when, comparable across runs."""
    return [(e["input_id"], e["kind"], e.get("text", "")) for e in deltas(events)]


def audio_of(events: list[dict]) -> np.ndarray:
    parts = [decode_f32_base64(e["audio"], 1 << 30) for e in deltas(events, "audio")]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def ring_streamer(model: Any, d: Any, device: str = "cpu", causal: Any = None, **kw: Any) -> Any:
    """token2wav's device path (`DeviceStreamer`: the ring caches, batched) over a `Token2WavModel`'s flow and HiFT
    (copies: a CUDA run must not move the host path's modules), its tables; `device` cpu here, cuda on a GPU."""
    import copy

    from minicpmo_triton.stages.token2wav_device import DeviceStreamer

    return DeviceStreamer(copy.deepcopy(model.flow).to(device), copy.deepcopy(model.hift).to(device), model.tables(),
                          d, device, causal=causal, **kw)

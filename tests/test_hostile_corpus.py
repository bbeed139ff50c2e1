"""A table of hostile inputs over every dialect (/backend, OpenAI's /v1/realtime, MiniCPM-o's ?mode=audio|video),
each answered with its documented code and close code (or the session staying open: a probe event is still
answered), while a clean /backend session runs beside them and says exactly what it says alone.

The clean session's solo transcript (greedy) is taken once; the cases then run in chunks, each chunk
concurrently beside one clean session, whose transcript must equal the solo one. At the end nothing is
left: no live sequence in any stage, no active session.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import websockets
from PIL import Image

from gateway.audio import encode_f32_base64
from gateway.dialects.realtime_events import MAX_EVENT_BYTES
from gateway.limits import Limits
from gateway.wire import JSON_MAX_NUMBER_CHARS

from .helpers import GREEDY, OTHER_TEXT, append_message, init_message
from .test_isolation_e2e import HOSTILE_CONFIGS
from .test_session_exits import settled

STAYS = None  # the session stays open: the probe after the error is answered
PROBE = json.dumps({"type": "probe.nothing"})  # every dialect answers it with unknown_event, no model work
CHUNK = 32  # hostile cases beside one clean session
LIMITS = Limits.default()
OVER_PROMPT = "p" * (LIMITS.prompt_bytes + 1)  # one byte past the bound: refused before any model work
OVER_TEXT = "t" * (LIMITS.text_bytes + 1)


# ---- hostile payloads ----

def _png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (PIL refuses it before decoding: a decompression bomb)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _jpeg() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="JPEG")
    return _b64(buf.getvalue())


BOMB = _b64(_png(20_000, 20_000))  # 400 Mpixels: PIL's DecompressionBombError
HUGE = _b64(_png(5000, 5000))  # over the stage's 16 Mpixel bound
NOT_AN_IMAGE = _b64(b"this is not an image at all")
EPS = _b64(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")  # a format no stage opens
SECOND = np.sin(np.linspace(0, 440 * 2 * np.pi, 16_000)).astype(np.float32) * 0.3
DEEP = "[" * 100_000 + "]" * 100_000
LONG_NUMBER = '{"type": "x", "n": ' + "7" * 20_000 + "}"
LONG_FLOAT = '{"type": "x", "n": 1.' + "5" * (JSON_MAX_NUMBER_CHARS + 1) + "}"
BINARY = b"\xff\xfe\x00\x9c garbage \x80"
LONE = "\\ud800"  # a lone surrogate, as JSON escapes it


def samples(*values: float, base: np.ndarray = SECOND) -> str:
    audio = base.copy()
    audio[: len(values)] = values
    return encode_f32_base64(audio)


def backend_append(audio: str | None = None, **extra: Any) -> str:
    inp = {"input_id": "h", **({"audio": audio} if audio is not None else {}), **extra}
    return json.dumps({"type": "input.append", "input": inp})


# ---- the table ----

@dataclass(frozen=True)
class Case:
    name: str
    path: str  # /backend, /v1/realtime, /v1/realtime?mode=audio|video
    setup: tuple[str, ...]  # valid frames first (their answers awaited): session.init / session.update
    frames: tuple[str | bytes, ...]
    code: str
    close: int | None  # the close code, or STAYS


INIT = init_message(GREEDY)
TURN_INIT = init_message(GREEDY, mode="turn_based")
MINI_UPDATE = json.dumps({"type": "session.update", "session": {"config": GREEDY}})


def _cases() -> list[Case]:
    cases: list[Case] = []

    def add(name: str, path: str, setup: tuple[str, ...], frames: tuple[str | bytes, ...], code: str,
            close: int | None) -> None:
        cases.append(Case(name, path, setup, frames, code, close))

    not_json = {"binary": BINARY, "deep": DEEP, "long_int": LONG_NUMBER, "long_float": LONG_FLOAT,
                "garbage": "not json at all", "truncated": '{"type": "session.init", "payload": {'}

    # /backend, first frame
    for name, frame in not_json.items():
        add(f"backend_first_{name}", "/backend", (), (frame,), "invalid_json", 1003)
    add("backend_first_surrogate_type", "/backend", (), ('{"type": "' + LONE + '"}',), "invalid_json", 1003)
    add("backend_first_surrogate_prompt", "/backend", (),
        ('{"type": "session.init", "payload": {"config": {"system_prompt": "hi ' + LONE + '"}}}',),
        "invalid_json", 1003)
    for i, frame in enumerate(["[]", '"session.init"', "1", "null", '{"type": 5}', "{}"]):
        add(f"backend_first_not_an_event_{i}", "/backend", (), (frame,), "invalid_payload", 1008)
    add("backend_first_append", "/backend", (), (backend_append(encode_f32_base64(SECOND)),),
        "invalid_first_message", 1008)
    add("backend_init_no_payload", "/backend", (), (json.dumps({"type": "session.init"}),), "missing_field", 1008)
    add("backend_init_bad_mode", "/backend", (), (init_message(GREEDY, mode="half_duplex"),), "invalid_mode", 1008)
    add("backend_init_config_type", "/backend", (), (init_message({"temperature": "hot"}),), "invalid_config", 1008)
    for i, config in enumerate(HOSTILE_CONFIGS):
        add(f"backend_init_range_{i}", "/backend", (), (init_message(config),), "invalid_config", 1008)
    add("backend_init_voice_not_base64", "/backend", (), (init_message(GREEDY, ref_audio_base64="%%%"),),
        "invalid_voice", 1008)
    add("backend_init_voice_too_short", "/backend", (),
        (init_message(GREEDY, ref_audio_base64=encode_f32_base64(SECOND[:800])),), "invalid_voice", 1008)
    # the cost model's bounds (gateway/limits.py)
    add("backend_init_prompt_too_long", "/backend", (), (init_message(GREEDY, system_prompt=OVER_PROMPT),),
        "input_too_large", 1008)
    add("backend_init_voice_name_a_path", "/backend", (), (init_message(GREEDY, voice={"name": "../x"}),),
        "invalid_voice", 1008)
    add("backend_context_too_long", "/backend", (INIT,), (json.dumps(
        {"type": "input.context", "input_id": "c", "context": {"text": OVER_TEXT}}),), "input_too_large", STAYS)

    # /backend, after session.init
    for name, frame in not_json.items():
        add(f"backend_{name}", "/backend", (INIT,), (frame,), "invalid_json", 1003)
    add("backend_surrogate_input_id", "/backend", (INIT,),
        ('{"type": "input.append", "input": {"input_id": "' + LONE + '", "audio": ""}}',),
        "invalid_json", 1003)
    add("backend_surrogate_context", "/backend", (INIT,),
        ('{"type": "input.context", "input_id": "c", "context": {"text": "' + LONE + '"}}',),
        "invalid_json", 1003)
    add("backend_unknown_type", "/backend", (INIT,), (json.dumps({"type": "input.explode"}),), "unknown_event", STAYS)
    add("backend_second_init", "/backend", (INIT,), (INIT,), "already_initialized", STAYS)
    add("backend_missing_audio", "/backend", (INIT,), (backend_append(),), "missing_field", STAYS)
    for name, audio in {"not_base64": "%%%", "odd_bytes": _b64(b"\0" * 7), "nan": samples(float("nan")),
                        "inf": samples(float("inf")), "beyond_bound": samples(3.0), "enormous": samples(1e30),
                        "over_5_s": encode_f32_base64(np.zeros(16_000 * 6, np.float32))}.items():
        add(f"backend_audio_{name}", "/backend", (INIT,), (backend_append(audio),), "bad_audio", STAYS)
    good = encode_f32_base64(SECOND)
    for name, frame in {"not_base64": "%%%", "not_an_image": NOT_AN_IMAGE, "bomb": BOMB, "huge": HUGE,
                        "eps": EPS}.items():
        add(f"backend_image_{name}", "/backend", (INIT,), (backend_append(good, video_frames=[frame]),),
            "bad_image", STAYS)
    add("backend_too_many_frames", "/backend", (INIT,), (backend_append(good, video_frames=[_jpeg()] * 5),),
        "invalid_payload", STAYS)

    # /backend turn_based
    def turn(messages: Any) -> str:
        return json.dumps({"type": "input.append", "input": {"input_id": "t", "messages": messages}})
    add("turn_no_messages", "/backend", (TURN_INIT,), (turn([]),), "missing_field", STAYS)
    add("turn_ends_with_assistant", "/backend", (TURN_INIT,),
        (turn([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),), "invalid_chat", STAYS)
    add("turn_bad_role", "/backend", (TURN_INIT,), (turn([{"role": "robot", "content": "hi"}]),),
        "invalid_payload", STAYS)
    add("turn_surrogate", "/backend", (TURN_INIT,),
        ('{"type": "input.append", "input": {"input_id": "t", "messages": [{"role": "user", '
         '"content": "' + LONE + '"}]}}',), "invalid_json", 1003)
    for name, image in {"bomb": BOMB, "not_an_image": NOT_AN_IMAGE, "eps": EPS}.items():
        add(f"turn_image_{name}", "/backend", (TURN_INIT,),
            (turn([{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "?"}]}]),),
            "bad_image", STAYS)

    # OpenAI dialect: a frame that is not an event is an error, the session goes on
    rt = "/v1/realtime"
    for name, frame in not_json.items():
        add(f"openai_{name}", rt, (), (frame,), "invalid_json", STAYS)
    add("openai_surrogate_instructions", rt, (),
        ('{"type": "session.update", "session": {"instructions": "' + LONE + '"}}',), "invalid_json", STAYS)
    add("openai_surrogate_item_text", rt, (),
        ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
         '[{"type": "input_text", "text": "' + LONE + '"}]}}',), "invalid_json", STAYS)
    for i, frame in enumerate(["[]", '{"type": 5}', "{}"]):
        add(f"openai_not_an_event_{i}", rt, (), (frame,), "invalid_event", STAYS)
    add("openai_unknown_type", rt, (), (json.dumps({"type": "response.explode"}),), "unknown_event", STAYS)
    for i, config in enumerate(HOSTILE_CONFIGS):
        add(f"openai_update_range_{i}", rt, (), (json.dumps({"type": "session.update", "session": config}),),
            "invalid_config", STAYS)
    # (An append of 6 s was refused here once: OpenAI takes appends up to its 15 MiB event cap, and so do we now;
    # past the cap is openai_event_too_large below.)
    for name, audio in {"not_base64": "%%%", "odd_bytes": _b64(b"\0" * 7)}.items():
        add(f"openai_audio_{name}", rt, (), (json.dumps({"type": "input_audio_buffer.append", "audio": audio}),),
            "bad_audio", STAYS)
    add("openai_audio_format", rt, (), (json.dumps({"type": "session.update", "session": {"audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 8000}}}}}),), "unsupported_audio_format", STAYS)
    add("openai_cancel_nothing", rt, (), (json.dumps({"type": "response.cancel"}),), "response_cancel_not_active",
        STAYS)
    add("openai_commit_empty", rt, (), (json.dumps({"type": "input_audio_buffer.commit"}),),
        "input_audio_buffer_commit_empty", STAYS)
    add("openai_delete_unknown_item", rt, (), (json.dumps({"type": "conversation.item.delete", "item_id": "nope"}),),
        "item_not_found", STAYS)
    add("openai_event_too_large", rt, (), ('{"type": "x", "pad": "' + "a" * (MAX_EVENT_BYTES + 10) + '"}',),
        "event_too_large", STAYS)
    manual = json.dumps({"type": "session.update", "session": {"turn_detection": None}})
    for name, image in {"bomb": BOMB, "not_an_image": NOT_AN_IMAGE, "eps": EPS}.items():  # refused at the door
        add(f"openai_image_{name}", rt, (manual,), (
            json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
                {"type": "input_image", "image_url": f"data:image/png;base64,{image}"},
                {"type": "input_text", "text": "what is this?"}]}}),), "bad_image", STAYS)
    add("openai_voice_a_payload", rt, (), (json.dumps(
        {"type": "session.update", "session": {"voice": "v" * 100_000}}),), "invalid_value", STAYS)
    add("openai_instructions_too_long", rt, (), (json.dumps(
        {"type": "session.update", "session": {"instructions": OVER_PROMPT}}),), "input_too_large", STAYS)
    add("openai_item_too_many_images", rt, (manual,), (json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": f"data:image/jpeg;base64,{_jpeg()}"}] * 9}}),),
        "input_too_large", STAYS)
    user_item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    add("openai_duplicate_item_id", rt, (), tuple(json.dumps({"type": "conversation.item.create",
                                                              "item": {**user_item, "id": "item_1"}})
                                                  for _ in range(2)), "item_create_duplicate_item_id", STAYS)
    add("openai_item_id_too_long", rt, (), (json.dumps({"type": "conversation.item.create",
                                                        "item": {**user_item, "id": "i" * 65}}),),
        "invalid_value", STAYS)
    add("openai_item_after_unknown", rt, (), (json.dumps({"type": "conversation.item.create", "item": user_item,
                                                          "previous_item_id": "item_nope"}),), "item_not_found", STAYS)
    add("openai_metadata_not_strings", rt, (), (json.dumps({"type": "response.create", "response": {
        "metadata": {"n": 1}}}),), "invalid_value", STAYS)
    add("openai_duplex_not_opted_in", rt, (), (json.dumps({"type": "session.update", "session": {"duplex": True}}),),
        "invalid_value", STAYS)
    add("openai_unknown_extension", rt + "?extensions=duplex,telepathy", (), (), "invalid_value", 1008)
    add("openai_bad_mode", rt + "?mode=audio_only", (), (), "invalid_mode", 1008)
    add("openai_resume_first_not_resume", rt + "?resume=1", (), (json.dumps({"type": "session.update"}),),
        "invalid_first_message", 1008)
    add("openai_resume_unknown", rt + "?resume=1", (),
        (json.dumps({"type": "session.resume", "session_id": "sess_nope", "resume_token": "x"}),),
        "session_resume_expired", 1008)

    # MiniCPM-o's dialect: bad JSON closes 1003 (as its own gateway does)
    for mode in ("audio", "video"):
        path = f"{rt}?mode={mode}"
        for name, frame in not_json.items():
            add(f"{mode}_first_{name}", path, (), (frame,), "invalid_json", 1003)
            add(f"{mode}_{name}", path, (MINI_UPDATE,), (frame,), "invalid_json", 1003)
        add(f"{mode}_surrogate_instructions", path, (),
            ('{"type": "session.update", "session": {"instructions": "' + LONE + '"}}',), "invalid_json", 1003)
        add(f"{mode}_append_before_update", path, (),
            (json.dumps({"type": "input_audio_buffer.append", "audio": encode_f32_base64(SECOND)}),),
            "not_ready", STAYS)
        add(f"{mode}_second_update", path, (MINI_UPDATE,), (MINI_UPDATE,), "invalid_payload", STAYS)
        add(f"{mode}_unknown_type", path, (MINI_UPDATE,), (json.dumps({"type": "response.explode"}),),
            "unknown_event", STAYS)
        for name, audio in {"not_base64": "%%%", "nan": samples(float("nan")), "beyond_bound": samples(-2.5),
                            "over_5_s": encode_f32_base64(np.zeros(16_000 * 6, np.float32))}.items():
            add(f"{mode}_audio_{name}", path, (MINI_UPDATE,),
                (json.dumps({"type": "input_audio_buffer.append", "audio": audio}),), "bad_audio", STAYS)
    for i, config in enumerate(HOSTILE_CONFIGS):
        add(f"audio_update_range_{i}", f"{rt}?mode=audio", (),
            (json.dumps({"type": "session.update", "session": {"config": config}}),), "invalid_config", STAYS)
    add("audio_frames_in_audio_mode", f"{rt}?mode=audio", (MINI_UPDATE,), (json.dumps(
        {"type": "input_audio_buffer.append", "audio": encode_f32_base64(SECOND), "video_frames": [_jpeg()]}),),
        "invalid_payload", STAYS)
    add("audio_instructions_too_long", f"{rt}?mode=audio", (),
        (json.dumps({"type": "session.update", "session": {"instructions": OVER_PROMPT}}),), "input_too_large", STAYS)
    add("audio_voice_not_base64", f"{rt}?mode=audio", (),
        (json.dumps({"type": "session.update", "session": {"ref_audio": "%%%"}}),), "invalid_voice", 1008)
    for name, frame in {"not_base64": "%%%", "not_an_image": NOT_AN_IMAGE, "bomb": BOMB, "huge": HUGE,
                        "eps": EPS}.items():
        add(f"video_frame_{name}", f"{rt}?mode=video", (MINI_UPDATE,), (json.dumps(
            {"type": "input_audio_buffer.append", "audio": encode_f32_base64(SECOND), "video_frames": [frame]}),),
            "bad_image", STAYS)
    add("video_too_many_frames", f"{rt}?mode=video", (MINI_UPDATE,), (json.dumps(
        {"type": "input_audio_buffer.append", "audio": encode_f32_base64(SECOND), "video_frames": [_jpeg()] * 5}),),
        "invalid_payload", STAYS)
    return cases


CASES = _cases()


# ---- running a case ----

async def _recv(ws: websockets.ClientConnection, timeout_s: float = 60.0) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout_s))


async def _until(ws: websockets.ClientConnection, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    while not match(ev := await _recv(ws)):
        pass
    return ev


async def _close_code(ws: websockets.ClientConnection) -> int:
    try:
        async with asyncio.timeout(30):
            while True:
                await ws.recv()
    except websockets.ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd else 1006


async def run_case(base: str, case: Case) -> None:
    """The case's code, then its close code (or the probe answered: the session stayed)."""
    ws = await websockets.connect(base + case.path, max_size=64 << 20)
    try:
        refused_at_once = ("resume=1", "audio_only", "telepathy")
        if case.path.startswith("/v1/realtime") and not any(x in case.path for x in refused_at_once):
            first = await _recv(ws)
            assert first["type"] in ("session.created", "session.queue_done"), first
        for frame in case.setup:
            await ws.send(frame)
            await _until(ws, lambda e: e["type"] in ("session.created", "session.updated"))
        for frame in case.frames:
            await ws.send(frame)
        err = await _until(ws, lambda e: e["type"] == "error")
        assert err["error"]["code"] == case.code, (case.name, err)
        if case.close is STAYS:
            await ws.send(PROBE)
            probe = await _until(ws, lambda e: e["type"] == "error")
            unconfigured = "?mode=" in case.path and not case.setup  # it answers everything with not_ready
            assert probe["error"]["code"] == ("not_ready" if unconfigured else "unknown_event"), (case.name, probe)
        else:
            assert await _close_code(ws) == case.close, case.name
    finally:
        with contextlib.suppress(Exception):
            if case.path.startswith("/v1/realtime?mode="):  # end the session, not only the socket (no resume grace)
                await ws.send(json.dumps({"type": "session.close"}))
                await _until(ws, lambda e: e["type"] == "session.closed")
        await ws.close()  # a stock OpenAI client's session ends with its socket (it cannot resume)


# ---- the clean session beside them ----

STEPS = 3


async def clean_transcript(url: str, speech: np.ndarray) -> list[tuple[Any, ...]]:
    """What a greedy /backend session says to three seconds of speech: every delta's text and audio."""
    ws = await websockets.connect(url, max_size=64 << 20)
    try:
        await ws.send(init_message(GREEDY))
        assert (await _recv(ws))["type"] == "session.created"
        for i in range(STEPS):
            await ws.send(append_message(speech[i * 16_000:(i + 1) * 16_000], f"clean_{i}"))
        out, ended = [], 0
        while ended < STEPS:
            ev = await _recv(ws, 120)
            assert ev["type"] == "response.output.delta", ev
            out.append((ev["input_id"], ev["kind"], ev.get("text", ""), ev.get("audio", "")))
            ended += ev.get("chunk_usage") is not None
        return out
    finally:
        await ws.close()


async def test_hostile_corpus_beside_a_clean_session(gateway, triton, speech) -> None:
    assert len(CASES) >= 120 and len({c.name for c in CASES}) == len(CASES)
    audio = speech(OTHER_TEXT)
    solo = await clean_transcript(gateway.ws, audio)
    assert any(kind == "text" and text for _, kind, text, _ in solo) or solo, solo
    failures: list[str] = []
    for start in range(0, len(CASES), CHUNK):
        chunk = CASES[start:start + CHUNK]
        results = await asyncio.gather(clean_transcript(gateway.ws, audio),
                                       *(run_case(gateway.ws.removesuffix("/backend"), c) for c in chunk),
                                       return_exceptions=True)
        beside, outcomes = results[0], results[1:]
        assert not isinstance(beside, BaseException), beside
        assert beside == solo, f"the clean session beside cases {start}..{start + len(chunk)} changed"
        failures += [f"{c.name}: {r!r}" for c, r in zip(chunk, outcomes, strict=True) if isinstance(r, BaseException)]
    assert not failures, "\n".join(failures)
    await settled(gateway, triton)
    print(f"{len(CASES)} hostile cases in {len(range(0, len(CASES), CHUNK))} chunks, each beside a clean session")


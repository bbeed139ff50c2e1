"""The cost model per caller (gateway/limits.py, docs/security.md), in each dialect's pure code: every input that
costs the server work or memory is bounded at the edge with a client code, and the fair-sharing rules
(gateway/fairness.py): per-address and per-key session counts, heartbeats that are not activity, a per-event
step budget, resumes refused only for the caller that fails them; keys redacted from logged request lines."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
from typing import Any

import numpy as np
import pytest
from PIL import Image

from gateway.audio import encode_f32_base64
from gateway.auth import ANONYMOUS, redact
from gateway.dialects import backend, minicpm
from gateway.dialects.openai import OpenAIRealtimeState
from gateway.dialects.openai_extensions import ALL
from gateway.fairness import Activity, ByteBudgets, ByteRate, EventRate, Quotas, ResumeFailures, paced
from gateway.inputs import image_bytes
from gateway.limits import Limits
from gateway.settings import Settings
from gateway.wire import ProtocolError

from .test_realtime_protocol import state as openai_state
from .test_realtime_protocol import types

AUDIO = encode_f32_base64(np.zeros(16_000, np.float32))
EPS = base64.b64encode(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n").decode()


def png(width: int = 8, height: int = 8) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def refused(call: Any, *args: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call(*args)
    return info.value


def update_refused(st: OpenAIRealtimeState, session: dict[str, Any]) -> list[dict[str, Any]]:
    """The fields a `session.update` refused (each on its own: the others apply): their error objects."""
    return [e.error for e in st.on_client({"type": "session.update", "session": session}).events
            if e.type == "error"]


def backend_msg(kind: str, **payload: Any) -> dict[str, Any]:
    return {"type": kind, **payload}


# ---- text: prompts, contexts, messages, texts to say ----

def limits(**changes: Any) -> Limits:
    return dataclasses.replace(Limits.default(), **changes)


def test_limits_come_from_the_settings() -> None:
    got = Limits.of(Settings.from_env({"MINICPMO_MAX_PROMPT_BYTES": "10", "MINICPMO_MAX_ITEM_AUDIO_S": "2.5"}))
    assert (got.prompt_bytes, got.item_audio_s, got.text_bytes) == (10, 2.5, Settings().max_text_bytes)


def test_a_long_system_prompt_is_refused_at_the_door_in_every_dialect() -> None:
    long = "é" * (Limits.default().prompt_bytes // 2 + 1)  # bytes, not characters, bound the tokens
    err = refused(backend.parse_init, {"type": "session.init", "payload": {"system_prompt": long}}, Limits.default())
    assert (err.code, err.close_code) == ("input_too_large", 1008)
    st, _ = openai_state()
    assert [e["code"] for e in update_refused(st, {"instructions": long})] == ["input_too_large"]
    assert st.config.instructions != long
    mini = minicpm.MiniCPMRealtimeState("s")
    assert refused(mini.on_client, {"type": "session.update", "session": {"instructions": long}}).code == \
        "input_too_large"
    ok = "x" * Limits.default().prompt_bytes
    init = backend.parse_init({"type": "session.init", "payload": {"system_prompt": ok}}, Limits.default())
    assert init.system_prompt == ok


def test_long_texts_and_odd_context_kinds_are_refused() -> None:
    long = "y" * (Limits.default().text_bytes + 1)
    err = refused(backend.parse_client_message, backend_msg("input.context", context={"text": long}))
    assert err.code == "input_too_large"
    err = refused(backend.parse_client_message, backend_msg("input.context", context={"text": "hi", "kind": "k" * 65}))
    assert err.code == "invalid_value"
    turn = backend_msg("input.append", input={"messages": [{"role": "user", "content": long}]})
    assert refused(backend.parse_client_message, turn, "turn_based").code == "input_too_large"
    st, _ = openai_state(turn_detection=None)
    for event in ({"type": "conversation.item.create", "item": {"role": "assistant", "content": [
                      {"type": "output_text", "text": long}]}},  # a text to say
                  {"type": "conversation.item.create", "item": {"role": "user", "content": [
                      {"type": "input_text", "text": long}]}}):
        assert refused(st.on_client, event).code == "input_too_large"
    duplex, _ = openai_state()
    assert refused(duplex.on_client, {"type": "response.create", "response": {"instructions": long}}).code == \
        "input_too_large"


def test_the_voice_is_a_name_not_a_payload() -> None:
    """OpenAI's `voice` is echoed in every response.created / response.done: a 12 MB voice amplified echoes."""
    st, _ = openai_state()
    for voice in ("v" * 100_000, {"id": "voice_1"}, "../etc/passwd", 7):
        [err] = update_refused(st, {"voice": voice})
        assert err["code"] == "invalid_value" and err["param"] == "session.audio.output.voice"
        assert st.config.voice != voice
    fx = st.on_client({"type": "session.update", "session": {"voice": "alloy"}})
    assert fx.events[0].session["audio"]["output"]["voice"] == "alloy"


# ---- images: formats, how many, how many pixels ----

def test_only_image_formats_the_server_decodes_pass() -> None:
    assert refused(image_bytes, EPS).code == "bad_image"  # PIL would hand it to Ghostscript
    assert image_bytes(png())[:4] == b"\x89PNG"
    err = refused(backend.parse_client_message, backend_msg("input.append", input={"audio": AUDIO, "frames": [EPS]}))
    assert err.code == "bad_image"
    st, _ = openai_state(turn_detection=None)
    item = {"role": "user", "content": [{"type": "input_image", "image_url": f"data:image/eps;base64,{EPS}"}]}
    assert refused(st.on_client, {"type": "conversation.item.create", "item": item}).code == "bad_image"


def test_images_per_message_and_pixels_per_request_are_bounded() -> None:
    small = png()
    nine = [{"type": "image", "image": small}] * (Limits.default().images_per_message + 1)
    turn = backend_msg("input.append", input={"messages": [{"role": "user", "content": nine}]})
    assert refused(backend.parse_client_message, turn, "turn_based").code == "input_too_large"
    st, _ = openai_state(turn_detection=None)
    item = {"role": "user", "content": [{"type": "input_image", "image_url": f"data:image/png;base64,{small}"}] * 9}
    assert refused(st.on_client, {"type": "conversation.item.create", "item": item}).code == "input_too_large"
    big = png(2048, 2048)  # 4 Mpixels each
    tight = limits(request_pixels=3 * 2048 * 2048)
    four = backend_msg("input.append", input={"audio": AUDIO, "frames": [big] * 4})
    assert refused(backend.parse_client_message, four, "full_duplex", tight).code == "input_too_large"
    assert len(backend.parse_client_message(four, "full_duplex").frames) == 4


# ---- the conversation ----

def item(text: str) -> dict[str, Any]:
    return {"type": "conversation.item.create", "item": {"role": "user", "content": [
        {"type": "input_text", "text": text}]}}


def test_a_turn_based_conversation_is_bounded_in_items_and_bytes() -> None:
    st = OpenAIRealtimeState("s", limits=limits(conversation_items=3, conversation_bytes=1000))
    st.on_client({"type": "session.update", "session": {"turn_detection": None}})
    for i in range(3):
        st.on_client(item(f"message {i}"))
    assert refused(st.on_client, item("one too many")).code == "conversation_full"
    st.on_client({"type": "conversation.item.delete", "item_id": st.conversation.items[0].id})
    st.on_client(item("room again"))
    assert refused(st.on_client, {"type": "response.create"}).code == "conversation_full"  # the reply's item
    st = OpenAIRealtimeState("s", limits=limits(conversation_bytes=1000))
    st.on_client({"type": "session.update", "session": {"turn_detection": None}})
    st.on_client(item("a" * 900))
    assert refused(st.on_client, item("b" * 200)).code == "conversation_full"
    turn = backend_msg("input.append", input={"messages": [{"role": "user", "content": "hi"}] * 4})
    assert refused(backend.parse_client_message, turn, "turn_based", limits(conversation_items=3)).code == \
        "conversation_full"


def test_a_duplex_conversation_keeps_its_latest_items() -> None:
    """In duplex the conversation is only a record (the model's context is its KV cache): the oldest items go."""
    st = OpenAIRealtimeState("s", ext=ALL, limits=limits(conversation_items=2))
    st.on_client({"type": "session.update", "session": {"duplex": True}})
    assert st.config.duplex
    first = st.on_client(item("one"))
    st.on_client(item("two"))
    third = st.on_client(item("three"))
    assert "conversation.item.deleted" in types(third) and len(st.conversation.items) == 2
    assert third.events[0].item_id == first.events[0].item["id"]


def test_the_input_buffer_holds_the_callers_audio_bound() -> None:
    """The uncommitted turn-based buffer is one conversation item's audio: `MAX_ITEM_AUDIO_S`, not a constant."""
    st = OpenAIRealtimeState("s", limits=limits(item_audio_s=2.0))
    st.on_client({"type": "session.update", "session": {"turn_detection": None, "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16_000}}}}})
    second = base64.b64encode(np.zeros(16_000, np.int16).tobytes()).decode()
    for _ in range(2):
        st.on_client({"type": "input_audio_buffer.append", "audio": second})
    err = refused(st.on_client, {"type": "input_audio_buffer.append", "audio": second})
    assert err.code == "input_audio_buffer_full" and "2 s" in err.message
    assert st.buffer.samples == 32_000  # the refused append left nothing


def test_trimming_a_duplex_conversation_keeps_the_open_response() -> None:
    st = OpenAIRealtimeState("s", ext=ALL, limits=limits(conversation_items=2))
    st.on_client({"type": "session.update", "session": {"duplex": True}})
    one = st.on_client(item("one")).events[-1].item["id"]
    st._open_response()  # the model opened a turn (as a step's first delta does)
    answer = st.active.item
    two = st.on_client(item("two"))  # three items: the oldest goes, the open response's stays
    three = st.on_client(item("three"))
    assert [i.id for i in st.conversation.items] == [answer.id, three.events[-1].item["id"]]
    deleted = [e.item_id for fx in (two, three) for e in fx.events if e.type == "conversation.item.deleted"]
    assert deleted == [one, two.events[-1].item["id"]]


# ---- fair sharing ----

def test_sessions_per_address_and_per_key() -> None:
    quotas = Quotas(per_key=1, per_address=2)
    with quotas.held(ANONYMOUS, "10.0.0.1"), quotas.held(ANONYMOUS, "10.0.0.1"):  # no keys: no per-key limit
        assert refused(quotas.held(ANONYMOUS, "10.0.0.1").__enter__).code == "address_session_limit"
        with quotas.held(ANONYMOUS, "10.0.0.2"):
            pass
    with quotas.held("key_a", "10.0.0.1"):
        err = refused(quotas.held("key_a", "10.0.0.3").__enter__)
        assert (err.code, err.close_code, err.retryable) == ("key_session_limit", 1013, True)
    with quotas.held("key_a", "10.0.0.1"), quotas.held("key_b", "10.0.0.1"):  # all given back
        pass
    with quotas.held(ANONYMOUS, "127.0.0.1"), quotas.held(ANONYMOUS, "127.0.0.1"), quotas.held(ANONYMOUS, "::1"):
        pass  # this machine: not counted per address
    d = Settings()
    assert 0 < d.max_sessions_per_key < d.max_sessions and 0 < d.max_sessions_per_address < d.max_sessions


def test_heartbeats_are_not_activity() -> None:
    now = [0.0]
    activity = Activity(10.0, clock=lambda: now[0])
    now[0] = 4.0
    activity.heard(json.dumps({"type": "session.heartbeat", "event_id": "e1"}))
    assert activity.remaining_s() == 6.0
    activity.heard(json.dumps({"type": "input_audio_buffer.append", "audio": ""}))
    assert activity.remaining_s() == 10.0
    now[0] = 30.0
    activity.heard('{"type": "session.heartbeat"}')
    assert activity.remaining_s() == 0.0


def test_a_connection_past_its_byte_rate_reads_its_next_frame_later() -> None:
    now = [0.0]
    rate = ByteRate(per_s=10 << 20, burst=32 << 20, clock=lambda: now[0])
    assert [rate.delay(15 << 20) for _ in range(2)] == [0.0, 0.0]  # two frames at once: the burst
    assert rate.delay(15 << 20) == pytest.approx(1.3)  # a third: 13 MiB past the bucket, at 10 MiB a second
    now[0] = 10.0
    assert rate.delay(1 << 20) == 0.0  # refilled (to the burst, never past it)
    assert ByteRate(per_s=0, burst=0).delay(1 << 30) == 0.0


def test_a_callers_byte_rate_is_shared_by_its_connections() -> None:
    """One that hangs up after each flooded frame and comes back gets no fresh burst; loopback's is per connection."""
    now = [0.0]
    budgets = ByteBudgets(per_s=10 << 20, burst=32 << 20, clock=lambda: now[0])
    first = budgets.of("anonymous", "10.6.6.6")
    assert first.delay(30 << 20) == 0.0
    assert budgets.of("anonymous", "10.6.6.6").delay(15 << 20) == pytest.approx(1.3)  # the same caller, reconnected
    assert budgets.of("anonymous", "10.6.6.7").delay(15 << 20) == 0.0  # another address
    assert budgets.of("anonymous", "127.0.0.1") is not budgets.of("anonymous", "127.0.0.1")
    now[0] = 100.0
    budgets.of("anonymous", "10.6.6.8")
    assert len(budgets._rates) == 1  # the quiet ones forgotten


def test_a_heartbeat_is_no_first_event() -> None:
    now = [0.0]
    activity = Activity(300.0, first_within_s=30.0, clock=lambda: now[0])
    now[0] = 20.0
    activity.heard('{"type": "session.heartbeat"}')
    assert activity.remaining_s() == 10.0 and not activity.started  # the first-event deadline still runs
    activity.heard('{"type": "session.update", "session": {}}')
    assert activity.remaining_s() == 300.0 and activity.started


async def test_a_step_budget_is_per_event() -> None:
    async def events(gaps: list[float]):
        for gap in gaps:
            await asyncio.sleep(gap)
            yield gap

    assert [e async for e in paced(events([0.05] * 8), 0.2)] == [0.05] * 8  # 0.4 s in all, no gap over 0.2
    with pytest.raises(asyncio.TimeoutError):
        _ = [e async for e in paced(events([0.05, 0.3]), 0.2)]


async def test_only_failed_resumes_count_and_a_valid_one_always_passes() -> None:
    failures = ResumeFailures(attempts=2, window_s=60)

    async def attempt(ok: bool) -> str:
        try:
            async with failures.counted(ANONYMOUS, "10.0.0.1"):
                if not ok:
                    raise ProtocolError("session_resume_expired", "no such session")
        except ProtocolError as err:
            return err.code
        return "resumed"

    assert [await attempt(False) for _ in range(3)] == ["session_resume_expired"] * 2 + ["rate_limited"]
    assert await attempt(True) == "resumed"  # another caller's real resume from the same address



async def test_a_failed_resume_is_answered_late_and_a_valid_one_at_once() -> None:
    failures = ResumeFailures(attempts=10, window_s=60, delay_s=0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ProtocolError):
        async with failures.counted(ANONYMOUS, "10.0.0.1"):
            raise ProtocolError("session_resume_expired", "no such session")
    assert loop.time() - t0 >= 0.3
    t0 = loop.time()
    async with failures.counted(ANONYMOUS, "10.0.0.1"):
        pass
    assert loop.time() - t0 < 0.1


def test_events_past_the_rate_are_refused_and_the_rate_refills() -> None:
    now = [0.0]
    rate = EventRate(per_s=10, burst=5, clock=lambda: now[0])
    answers = [rate.refusal() for _ in range(8)]
    assert answers[:5] == [None] * 5
    assert all(err is not None and err.code == "rate_limited" and err.retryable for err in answers[5:])
    now[0] = 0.25  # 2.5 events' worth
    assert [rate.refusal() is None for _ in range(3)] == [True, True, False]
    now[0] = 100.0  # never more than the burst saved up
    assert sum(rate.refusal() is None for _ in range(20)) == 5
    assert EventRate(per_s=0, burst=0).refusal() is None  # 0: no limit


# ---- logs ----

@pytest.mark.parametrize("line", [
    "GET /v1/voices/check?key=SECRET HTTP/1.1",
    '127.0.0.1:5 - "WebSocket /v1/realtime?mode=audio&%6Bey=SECRET" [accepted]',
    '"GET /?k%65%79=SECRET&x=1 HTTP/1.1" 200',
    '"GET /health?%6b%65%79=SECRET" 200',
    "GET /v1/realtime?x='&key=SECRET HTTP/1.1",  # a quote before it: Starlette still reads key=SECRET
    '127.0.0.1:5 - "WebSocket /v1/realtime?x="&key=SECRET" [accepted]',
    "GET /?x=<a>&key=SECRET&key=SECRET2 HTTP/1.1",
])
def test_keys_are_redacted_however_the_name_is_encoded(line: str) -> None:
    assert "SECRET" not in redact(line) and "***" in redact(line)


@pytest.mark.parametrize("query", ["x='&key=K1", 'x="&key=K1', "x=(&key=K1", "a=1;key=K0&key=K1", "key=K1#x",
                                   "%6Bey=K1&k%65y=K2", "x=%22&key=K1&y='", "+key=K0&key+=K0&key=K1"])
def test_redaction_reads_the_query_as_starlette_does(query: str) -> None:
    """Every value Starlette would hand the gateway as `key` is gone from the logged request line."""
    from starlette.datastructures import QueryParams

    keys = QueryParams(query).getlist("key")
    assert keys
    line = redact(f"GET /v1/realtime?{query} HTTP/1.1")
    assert not any(k in line for k in keys), (keys, line)
    assert line.endswith(" HTTP/1.1")

"""Property-based fuzzing of every dialect's codec and state machine, in process (no server).

A driver plays the shell's part: client frames (well-formed events with fuzzed fields, any JSON, any
text) go to `on_text`, the steps it plans are answered with fuzzed step events (text, audio, listen,
done, a coded error) or not at all, and the session ends with `on_close`. The properties: only a
`ProtocolError` (the refusal the shell answers with an error event) ever escapes; every effect encodes to
a JSON object with a `type`; every state left behind is legal (counters non-negative, epochs only go up,
at most one open response, nothing after the close).
"""

from __future__ import annotations

import base64
import json
from collections import deque
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.audio import (
    AudioDecodeError,
    decode_f32_base64,
    decode_pcm16_base64,
    encode_f32_base64,
    encode_pcm16_base64,
)
from gateway.dialects import backend, minicpm, openai
from gateway.dialects.openai_extensions import ALL
from gateway.dialects.realtime_events import parse_event
from gateway.dialects.state import DialectState, Effects, PlannedStep
from gateway.wire import ProtocolError, parse_json
from minicpmo_triton.duplex_contract import StepEvent

EXAMPLES = 150  # per property: the whole file runs in well under a minute
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RUN: dict[str, int] = {}  # examples run, per property (printed at the end)
STEPS: dict[str, int] = {}  # planned steps answered, per state machine


def counted(name: str) -> None:
    RUN[name] = RUN.get(name, 0) + 1


# ---- strategies ----

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10**20), 10**20),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)
audio_b64 = st.one_of(
    st.builds(lambda n, v: encode_f32_base64(np.full(n, v, np.float32)), st.integers(0, 3200),
              st.floats(-3, 3, width=32)),
    st.text(max_size=16), st.just("%%%"))

TYPES = {
    "backend": ["session.init", "input.append", "input.context", "input.cancel", "session.close", "x"],
    "openai": ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
               "conversation.item.create", "conversation.item.delete", "conversation.item.truncate",
               "response.create", "response.cancel", "session.close", "playback.ack", "x"],
    "minicpm": ["session.update", "input_audio_buffer.append", "session.close", "session.heartbeat", "x"],
}
FIELDS = ["input", "payload", "session", "audio", "item", "item_id", "event_id", "response", "context",
          "input_id", "messages", "config", "mode", "video_frames", "force_listen", "content_index",
          "audio_end_ms", "reason", "instructions"]


def _dump(doc: dict[str, Any]) -> str:
    return json.dumps(doc)


one_second = st.builds(lambda n, v: np.full(n, v, np.float32), st.sampled_from([8000, 16_000, 24_000]),
                       st.floats(-0.5, 0.5, width=32))
texts = st.text(max_size=10)
VALID = {  # events that get somewhere (a step planned), their fields fuzzed a little
    "backend": st.one_of(
        st.builds(lambda a, i, f: _dump({"type": "input.append", "input": {"input_id": i, "audio": a,
                                                                           "force_listen": f}}),
                  one_second.map(encode_f32_base64), texts, st.booleans()),
        st.builds(lambda i, t: _dump({"type": "input.append", "input": {"input_id": i, "messages": [
            {"role": "user", "content": t}]}}), texts, texts),
        st.builds(lambda t: _dump({"type": "input.context", "input_id": "c", "context": {"text": t}}), texts)),
    "openai": st.one_of(
        st.builds(lambda a: _dump({"type": "input_audio_buffer.append", "audio": a}),
                  one_second.map(lambda x: encode_pcm16_base64(x))),
        st.builds(lambda t: _dump({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                               "content": [{"type": "input_text",
                                                                                            "text": t}]}}), texts),
        st.sampled_from([_dump({"type": "response.create"}), _dump({"type": "response.cancel"}),
                         _dump({"type": "input_audio_buffer.commit"}),
                         _dump({"type": "session.update", "session": {"turn_detection": None}}),
                         _dump({"type": "session.update", "session": {"duplex": False}}),
                         _dump({"type": "response.create", "response": {"instructions": "Hi.",
                                                                        "metadata": {"k": "v"}}})])),
    "minicpm": st.one_of(
        st.just(_dump({"type": "session.update", "session": {}})),
        st.builds(lambda a, f: _dump({"type": "input_audio_buffer.append", "audio": a, "force_listen": f}),
                  one_second.map(encode_f32_base64), st.booleans())),
}


def events_of(dialect: str) -> st.SearchStrategy[str]:
    """A client frame: an event that gets somewhere, an event of the dialect with fuzzed fields, any JSON or
    any text."""
    field_values = st.one_of(json_values, audio_b64, st.dictionaries(st.sampled_from(FIELDS), json_values,
                                                                     max_size=4))
    event = st.builds(lambda t, f: json.dumps({"type": t, **f}), st.sampled_from(TYPES[dialect]),
                      st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=4))
    return st.one_of(VALID[dialect], VALID[dialect], event, json_values.map(json.dumps), st.text(max_size=30))


step_events = st.lists(st.one_of(
    st.builds(lambda t: StepEvent("text", text=t), st.text(max_size=8)),
    st.builds(lambda n: StepEvent("audio", audio=np.zeros(n, np.float32)), st.integers(0, 480)),
    st.builds(lambda e: StepEvent("listen", end_of_turn=e, metrics={"kv_cache_length": 5}), st.booleans()),
    st.builds(lambda r: StepEvent("done", text="ok", reason=r, chunk_usage={"output_text_tokens": 1}),
              st.sampled_from(["turn_end", "length"])),
    st.just(StepEvent("text", text="end", chunk_usage={"input_audio_tokens": 3, "output_text_tokens": 1})),
), max_size=4)
answers = st.one_of(step_events, st.sampled_from(["bad_image", "bad_audio", "invalid_chat"]), st.none())
frame_action = st.tuples(st.just("frame"), st.integers(0, 2**31))
step_action = st.tuples(st.just("step"), answers)
actions = st.lists(st.one_of(frame_action, step_action, step_action), max_size=16)


# ---- the driver (the shell's part, pure) ----

def encoded(fx: Effects | list[Any]) -> list[dict[str, Any]]:
    out = []
    for ev in fx.events if isinstance(fx, Effects) else fx:
        doc = ev.encode()
        assert isinstance(doc, dict) and isinstance(doc.get("type"), str), doc
        json.dumps(doc, allow_nan=False)  # what goes on the wire is strict JSON
        out.append(doc)
    return out


def legal(state: DialectState) -> None:
    assert state.epoch >= 0 and state.stale_dropped >= 0
    assert all(v >= 0 for v in state.usage.counts.values()), state.usage.counts
    if isinstance(state, openai.OpenAIRealtimeState):
        assert state.response is None or state.active in (None, state.response)


def drive(state: DialectState, frames: list[str], plan: list[tuple[str, Any]]) -> int:
    """Returns the planned steps it answered."""
    pending: deque[PlannedStep] = deque()
    answered = 0
    epoch = state.epoch
    encoded(state.created())
    for kind, value in plan:
        if kind == "frame":
            if not frames:
                continue
            try:
                fx = state.on_text(frames[value % len(frames)])
            except ProtocolError as err:  # the one refusal the shell answers (and closes on, with a close code)
                encoded([state.error_event(err)])
                if err.close_code is not None:
                    break
                continue
        elif pending:
            step = pending.popleft()
            if not state.wanted(step):
                continue
            state.prepare(step)
            answered += 1
            if value is None:
                continue  # the step never answered (the session ends with it in flight)
            if isinstance(value, str):
                fx = state.on_step_error(step, value, "refused")
            else:
                fx = Effects()
                # the contract: `done` ends chat (turn-based) steps only, `listen` is a duplex step's
                for ev in (e for e in value if e.kind != ("listen" if step.kind == "chat" else "done")):
                    fx.extend(state.on_step_event(step, ev))
                fx.extend(state.on_step_end(step))
        else:
            continue
        encoded(fx)
        assert all(isinstance(s, PlannedStep) for s in fx.steps)
        pending.extend(fx.steps)
        legal(state)
        assert state.epoch >= epoch
        epoch = state.epoch
        if fx.close:
            break
    encoded(state.on_close("closed", None))
    legal(state)
    return answered


STATES = {
    "backend": lambda: backend.BackendState("sess_fuzz"),
    "backend_turn": lambda: backend.BackendState("sess_fuzz", mode="turn_based"),
    # a stock client (turns by its commits here: no VAD model) and one that opted into duplex and the extensions
    "openai": lambda: openai.OpenAIRealtimeState("sess_fuzz", vad=None),
    "openai_extended": lambda: openai.OpenAIRealtimeState("sess_fuzz", ext=ALL, vad=None),
    "minicpm_audio": lambda: minicpm.MiniCPMRealtimeState("sess_fuzz", mode="audio"),
    "minicpm_video": lambda: minicpm.MiniCPMRealtimeState("sess_fuzz", mode="video"),
}

_SECOND = np.full(16_000, 0.1, np.float32)
_USER_TEXT = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
# Per state machine, frames that reach a planned step (then answered): each property runs this example
# besides the random ones, so "explored as far as a step" holds in any order and alone.
SEEDS = {
    "backend": [{"type": "session.init", "payload": {"mode": "full_duplex"}},
                {"type": "input.append", "input": {"input_id": "a", "audio": encode_f32_base64(_SECOND)}}],
    "backend_turn": [{"type": "session.init", "payload": {"mode": "turn_based"}},
                     {"type": "input.append", "input": {"input_id": "a", "messages": [
                         {"role": "user", "content": "hi"}]}}],
    "openai": [{"type": "conversation.item.create", "item": _USER_TEXT}, {"type": "response.create"}],
    "openai_extended": [{"type": "input_audio_buffer.append", "audio": encode_pcm16_base64(np.repeat(_SECOND, 2))},
                        {"type": "response.create"}],
    "minicpm_audio": [{"type": "session.update", "session": {}},
                      {"type": "input_audio_buffer.append", "audio": encode_f32_base64(_SECOND)}],
}
SEEDS["minicpm_video"] = SEEDS["minicpm_audio"]
SEED_PLAN = [("frame", 0), ("frame", 1), ("step", [])]


@pytest.mark.parametrize("name", STATES)
def test_state_machines(name: str) -> None:
    dialect = name.split("_")[0]

    answered = [0]

    @FUZZ
    @given(frames=st.lists(events_of(dialect), min_size=1, max_size=6), plan=actions)
    @example(frames=[_dump(f) for f in SEEDS[name]], plan=SEED_PLAN)
    def run(frames: list[str], plan: list[tuple[str, Any]]) -> None:
        counted(name)
        answered[0] += drive(STATES[name](), frames, plan)

    run()
    STEPS[name] = answered[0]
    assert answered[0] > 0, f"{name}: not even the seed example got as far as a step"


# ---- codecs ----

@FUZZ
@given(st.one_of(st.text(max_size=60), st.binary(max_size=60), json_values.map(json.dumps)))
def test_parse_json_raises_only_value_error(text: str | bytes) -> None:
    counted("parse_json")
    try:
        parse_json(text)
    except ValueError:
        pass


@FUZZ
@given(events_of("backend"))
def test_backend_codec(text: str) -> None:
    counted("backend_codec")
    try:
        msg = backend.loads(text)
        if msg["type"] == "session.init":
            init = backend.parse_init(msg)
            backend.init_options(init)
            backend.voice_refs(init)
        else:
            backend.parse_client_message(msg, "full_duplex")
    except ProtocolError:
        pass


@FUZZ
@given(st.one_of(events_of("openai"), events_of("minicpm")), st.sampled_from([None, 1003]))
def test_realtime_codec(text: str, close: int | None) -> None:
    counted("realtime_codec")
    try:
        msg = parse_event(text, close)
        assert isinstance(msg, dict) and isinstance(msg["type"], str)
    except ProtocolError as err:
        assert err.close_code in (None, close)


@FUZZ
@given(st.one_of(audio_b64, st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())))
def test_audio_codecs(data: str) -> None:
    counted("audio_codecs")
    for decode in (lambda d: decode_f32_base64(d, 16_000), lambda d: decode_pcm16_base64(d, 16_000)):
        try:
            audio = decode(data)
            assert np.isfinite(audio).all() and audio.dtype == np.float32
        except (AudioDecodeError, ProtocolError):
            pass


@pytest.fixture(scope="module", autouse=True)
def report_examples_run():
    """After the file's tests, in whatever order they ran: the examples each property ran (the report's figure)."""
    yield
    print(f"\nfuzz examples run: {sum(RUN.values())} ({', '.join(f'{k} {v}' for k, v in sorted(RUN.items()))}); "
          f"planned steps answered: {STEPS}")

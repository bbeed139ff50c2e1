"""Every server event the OpenAI dialect can emit, checked against the `openai` package's own pydantic models
(`openai.types.realtime.RealtimeServerEvent`, the discriminated union the OpenAI Agents SDK validates every
event with, and whose types LiveKit's plugin parses; `openai` is pinned in pyproject's dev extra to the
version the three frameworks resolve to).

The event types come from the dialect's event dataclasses (`openai_events` plus the envelope the two
Realtime dialects share), so a new event cannot be forgotten: each must be produced by some scenario below.
Scenarios drive the real state machine as the shell does (client frames in through `on_text`, step events
in, a refused frame answered with `error_event`), plus one real session through a gateway and tritonserver.

The rules:
- a spec event type validates, in every scenario, with the `openai` package's model;
- an event type the spec does not have (an extension) never reaches a stock client: a scenario is `stock`
  when the client sends only what OpenAI's API defines; a scenario that opts in (an extension event, a
  vendor key, a query parameter) may see extensions.

Opting in is the URL's `?extensions=duplex,events` (`gateway/dialects/openai_extensions.py`): the scenarios run
for a stock client, for one that opted into both (as the page, `talk` and minicpmo_client do), and for one that
opted into duplex alone (as a framework may: its models then meet no extension event).
"""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Annotated, Any

import numpy as np
import pydantic
import pytest
import websockets
from openai.types.realtime.realtime_server_event import RealtimeServerEvent

from gateway.audio import encode_pcm16_base64, resample
from gateway.dialects import minicpm, openai_events, realtime_events
from gateway.dialects.openai import OpenAIRealtimeState
from gateway.dialects.openai_extensions import ALL, STOCK, Extensions
from gateway.dialects.realtime_events import RealtimeEvent
from gateway.dialects.state import Effects, PlannedStep
from gateway.wire import ProtocolError
from minicpmo_triton.duplex_contract import StepEvent

from .test_realtime_protocol import Clock, LoudnessVad

# The modules whose RealtimeEvent classes the OpenAI dialect sends (its own, and the shared envelope's).
OPENAI_EVENT_MODULES = (openai_events, realtime_events)
SPEC = pydantic.TypeAdapter(Annotated[RealtimeServerEvent, pydantic.Field(discriminator="type")])
SPEC_TYPES = frozenset(typing.get_args(member.model_fields["type"].annotation)[0]
                       for member in typing.get_args(typing.get_args(RealtimeServerEvent)[0]))


def _events_of(module: Any) -> set[type[RealtimeEvent]]:
    return {v for v in vars(module).values()
            if isinstance(v, type) and issubclass(v, RealtimeEvent) and v.type}


def _all_subclasses(cls: type) -> set[type]:
    out = set(cls.__subclasses__())
    for sub in list(out):
        out |= _all_subclasses(sub)
    return out


def emittable() -> dict[str, type[RealtimeEvent]]:
    """Each server event type the OpenAI dialect can send, by its wire name."""
    classes = set().union(*(_events_of(m) for m in OPENAI_EVENT_MODULES))
    return {cls.type: cls for cls in classes}


def test_the_enumeration_misses_no_event_class() -> None:
    """A RealtimeEvent class outside these modules (a new module of the dialect) must be listed here."""
    known = set().union(*(_events_of(m) for m in OPENAI_EVENT_MODULES)) | _events_of(minicpm)
    stray = {f"{c.__qualname__} ({c.type})" for c in _all_subclasses(RealtimeEvent) if c.type} - \
        {f"{c.__qualname__} ({c.type})" for c in known}
    assert not stray, f"server event classes in no module listed in OPENAI_EVENT_MODULES: {sorted(stray)}"


# ---- the pure state machine, driven as the shell drives it ----

def pcm_samples(seconds: float, loud: bool) -> np.ndarray:
    """24 kHz audio (the session's default input rate): a tone, or silence."""
    n = int(seconds * 24_000)
    return (0.3 * np.sin(np.arange(n) * 0.05) if loud else np.zeros(n)).astype(np.float32)


def pcm24(seconds: float, loud: bool) -> str:
    """24 kHz audio/pcm: a tone, or silence."""
    return encode_pcm16_base64(pcm_samples(seconds, loud))


@dataclass
class Driver:
    """One session of the state machine: client frames as text, planned steps prepared and answered by hand."""

    scenario: str
    turn_detection: str | None = "default"  # what the client asked for (None: none, the client commits)
    ext: Extensions = STOCK  # what the URL opted into
    clock: Clock = field(default_factory=Clock)
    sent: list[tuple[str, bool, dict[str, Any]]] = field(default_factory=list)  # (scenario, stock, event)
    steps: list[PlannedStep] = field(default_factory=list)
    running: list[PlannedStep] = field(default_factory=list)  # handed out, not ended

    def __post_init__(self) -> None:
        self.stock = self.ext == STOCK
        self.state = OpenAIRealtimeState("sess_spec", ext=self.ext, vad=LoudnessVad().probabilities,
                                         clock=self.clock)
        self._emit(self.state.created())

    def _emit(self, events: list[Any]) -> None:
        self.sent += [(self.scenario, self.stock, e.encode()) for e in events]

    def _apply(self, fx: Effects) -> Effects:
        self._emit(fx.events)
        for step in fx.steps:
            if self.state.wanted(step):
                self.state.prepare(step)
                self.steps.append(step)
                self.running.append(step)
        if fx.cancel:  # the step in flight stops, and those queued run (in the new epoch): all end
            for step in list(self.running):
                self.step_end(step)
        return fx

    def send(self, event_type: str, **fields: Any) -> Effects:
        """A client frame; a refusal is answered with the dialect's error event, as the shell does."""
        try:
            return self._apply(self.state.on_text(json.dumps({"type": event_type, **fields})))
        except ProtocolError as err:
            self._emit([self.state.error_event(err)])
            return Effects()

    def opt_in(self) -> None:
        """From here on the client has sent something a stock client never sends."""
        self.stock = False

    def step_event(self, step: PlannedStep, ev: StepEvent) -> None:
        self._apply(self.state.on_step_event(step, ev))

    def step_end(self, step: PlannedStep) -> None:
        """The step's events are all in (what the shell says next)."""
        if any(s is step for s in self.running):
            self.running = [s for s in self.running if s is not step]
            self._apply(self.state.on_step_end(step))

    def speak(self, step: PlannedStep, text: str = "hello ", kv: int = 100) -> None:
        """The step says something: words, then a second of audio."""
        metrics = {"kv_cache_length": kv, "kv_tokens_total": kv}
        self.step_event(step, StepEvent("text", text=text, metrics=metrics))
        self.step_event(step, StepEvent("audio", audio=np.full(24_000, 0.1, np.float32), metrics=metrics))
        self.clock.now += 0.3

    def finish(self, step: PlannedStep) -> None:
        """The step ends its reply: a duplex turn's end, or a chat turn's."""
        usage = {"output_text_tokens": 2, "output_speech_tokens": 25}
        if step.kind == "chat":
            self.step_event(step, StepEvent("done", reason="turn_end", chunk_usage=usage,
                                            metrics={"kv_cache_length": 120}))
        else:
            self.step_event(step, StepEvent("listen", end_of_turn=True, chunk_usage=usage))
        self.step_end(step)

    def reply(self) -> PlannedStep:
        """Get a reply going, whatever the session's turn detection: the caller speaks a turn (or, with
        none, types one and asks) and the step the dialect plans for it speaks."""
        before = len(self.steps)
        if self.turn_detection is None:
            self.send("conversation.item.create", item=user_text("Hello?"))
            self.send("response.create")
        else:
            self.send("input_audio_buffer.append", audio=pcm24(1.2, loud=True))
            self.send("input_audio_buffer.append", audio=pcm24(1.0, loud=False))
        planned = self.steps[before:]
        assert planned, f"{self.scenario}: the caller's turn planned no step"
        for step in planned[:-1]:
            if step.kind != "chat":
                self.step_event(step, StepEvent("listen", metrics={"kv_cache_length": 50, "kv_tokens_total": 50}))
                self.step_end(step)
        self.speak(planned[-1])
        assert self.state.active is not None, f"{self.scenario}: no response opened"
        return planned[-1]

    def close(self, reason: str) -> None:
        self._emit(self.state.on_close(reason, None))


def user_text(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


# What a stock client sends first: the GA session shape (the Agents SDK and LiveKit ask for semantic_vad).
STOCK_SESSION = {"type": "realtime", "instructions": "You are brief.", "output_modalities": ["audio"],
                 "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24_000}},
                           "output": {"format": {"type": "audio/pcm", "rate": 24_000}, "voice": "alloy"}}}


def turn_detection(kind: str | None) -> dict[str, Any]:
    td = None if kind is None else {"type": kind}
    return {**STOCK_SESSION, "audio": {**STOCK_SESSION["audio"],
                                       "input": {**STOCK_SESSION["audio"]["input"], "turn_detection": td}}}


def conversation(d: Driver) -> None:
    """A reply completes, one is cut by the caller speaking, one by the app (cancel, clear, truncate)."""
    d.finish(d.reply())
    if d.turn_detection is not None:
        d.reply()
        d.send("input_audio_buffer.append", audio=pcm24(1.5, loud=True))  # barge-in by speech
    for cut in ("response.cancel", "output_audio_buffer.clear"):
        d.reply()
        d.send(cut)
    d.reply()
    d.send("conversation.item.truncate", item_id=d.state.response.item.id, content_index=0, audio_end_ms=200)
    d.send("conversation.item.truncate", item_id=d.state.response.item.id, content_index=0, audio_end_ms=100)


def items(d: Driver) -> None:
    """Typed messages, retrieve, delete, a prompted response, a greeting, the buffer's own events."""
    d.send("conversation.item.create", item=user_text("What is the weather like?"))
    added = next(e for _, _, e in reversed(d.sent) if e["type"] == "conversation.item.added")
    d.send("conversation.item.retrieve", item_id=added["item"]["id"])
    d.send("conversation.item.delete", item_id=added["item"]["id"])
    d.send("conversation.item.create", item={"type": "message", "role": "assistant",
                                             "content": [{"type": "output_text", "text": "Hi there."}]})
    d.send("response.create", response={"instructions": "Greet the caller."})
    d.send("input_audio_buffer.append", audio=pcm24(0.5, loud=False))
    d.send("input_audio_buffer.clear")
    d.send("input_audio_buffer.append", audio=pcm24(0.5, loud=False))
    d.send("input_audio_buffer.commit")


def refusals(d: Driver) -> None:
    """Caller mistakes, answered with error events (the session goes on)."""
    d.send("no.such.event")
    d.send("response.cancel")
    d.send("input_audio_buffer.append", audio="@@@")
    d.send("conversation.item.retrieve", item_id="item_nope")
    d.send("session.update", session=turn_detection("duplex"))  # not a spec value
    d.send("session.update", session={**STOCK_SESSION, "max_output_tokens": 0})  # one field refused, the rest taken
    d.send("conversation.item.create", item={**user_text("Hi."), "id": "item_mine"})
    d.send("conversation.item.create", item={**user_text("Hi again."), "id": "item_mine"})  # a duplicate id
    d.send("conversation.item.create", item=user_text("Where?"), previous_item_id="item_nope")


def frameworks(d: Driver) -> None:
    """What the frameworks send beyond a turn: their own item ids and places, a greeting on an empty
    conversation with instructions, response metadata they match replies by, one long recording."""
    def respond(**response: Any) -> PlannedStep:
        before = len(d.steps)
        d.send("response.create", response=response)
        step = d.steps[before:][-1]  # turn-based: the chat turn; duplex: the step that asks the model to speak
        d.speak(step)
        return step

    d.finish(respond(instructions="Greet the caller.", metadata={"client_event_id": "r1"}))
    d.send("conversation.item.create", item={**user_text("First."), "id": "item_lk_1"}, previous_item_id="root")
    d.send("conversation.item.create", item={**user_text("Second."), "id": "item_lk_2"}, previous_item_id="item_lk_1")
    respond(metadata={"client_event_id": "r2"})
    d.send("response.cancel")
    clip = np.concatenate([pcm_samples(3.0, loud=True), pcm_samples(4.0, loud=False)])
    d.send("input_audio_buffer.append", audio=encode_pcm16_base64(clip))  # a 7 s recording in one append


def run_pure(td: str | None, what: str, body: Callable[[Driver], None], close: str = "idle_timeout",
             ext: Extensions = STOCK) -> list[tuple[str, bool, dict[str, Any]]]:
    opted = {STOCK: "", ALL: " (extensions=duplex,events)"}.get(ext, " (extensions=duplex)")
    d = Driver(f"{td or 'no turn detection'}: {what}{opted}", td, ext)
    session = STOCK_SESSION if td == "default" else turn_detection(td)
    d.send("session.update", session={**session, "duplex": False} if ext.duplex and td != "default" else session)
    body(d)
    if close:
        d.reply()  # the session ends with a reply open
        d.close(close)
    return d.sent


def failing_steps(d: Driver) -> None:
    """The stages refuse a step (a client error): its response fails; a reply runs out of tokens."""
    d.send("session.update", session={"max_output_tokens": 8})
    step = d.reply()
    d._apply(d.state.on_step_error(step, "invalid_chat", "the stages refused the input"))
    step = d.reply()
    d.step_event(step, StepEvent("done", reason="length", metrics={"kv_cache_length": 90}))


def text_out(d: Driver) -> None:
    d.send("session.update", session={"output_modalities": ["text"]})
    d.finish(d.reply())


def extensions(d: Driver) -> None:
    """The extensions' own client events: a client that sends them has opted in."""
    step = d.reply()
    d.opt_in()
    d.send("playback.ack", response_id=d.state.response.id, played_ms=400)
    d.finish(step)
    d.send("session.heartbeat")
    d.send("session.close")


def shell_controls() -> list[tuple[str, bool, dict[str, Any]]]:
    """What the shell says to a socket on `session.resume` (an extension the client sent), made as
    `Session.attach` makes it; the real session below also meets two of them over a socket."""
    events = [realtime_events.Replaced("sess_spec"),
              realtime_events.ResyncRequired("sess_spec", "journal_gap", "token"),
              realtime_events.Resumed("sess_spec", "token", 3)]
    return [("resume (shell)", False, e.encode()) for e in events]


@cache
def pure_events() -> tuple[tuple[str, bool, dict[str, Any]], ...]:
    out = []
    # A stock client starts in server VAD; one that opted in starts in duplex (its "default").
    for ext in (STOCK, ALL, Extensions(duplex=True)):
        for td in ("default", "semantic_vad", None):
            out += run_pure(td, "conversation", conversation, ext=ext)
            out += run_pure(td, "items", items, close="", ext=ext)
            out += run_pure(td, "failing steps", failing_steps, close="", ext=ext)
            out += run_pure(td, "text out", text_out, close="client_disconnected", ext=ext)
            out += run_pure(td, "frameworks", frameworks, close="", ext=ext)
        out += run_pure("default", "refusals", refusals, close="", ext=ext)
        out += run_pure("default", "extensions", extensions, close="", ext=ext)
    out += shell_controls()
    return tuple(out)


# ---- one real session (gateway + tritonserver), as a stock client drives it ----

async def real_session(url: str, speech: Callable[[str], np.ndarray]) -> list[tuple[str, bool, dict[str, Any]]]:
    got: list[tuple[str, bool, dict[str, Any]]] = []
    stock = True

    async def until(ws: websockets.ClientConnection, name: str, event_type: str, timeout_s: float = 60) -> dict:
        async with asyncio.timeout(timeout_s):
            while True:
                ev = json.loads(await ws.recv())
                got.append((name, stock, ev))
                if ev["type"] == event_type:
                    return ev

    async with websockets.connect(url, max_size=64 << 20) as ws:
        created = await until(ws, "real session", "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {**turn_detection("server_vad"),
                                                                        "max_output_tokens": 12}}))
        await until(ws, "real session", "session.updated")
        audio = np.concatenate([speech("Good morning. What will the weather be like tomorrow?"),
                                np.zeros(16_000, np.float32)])
        pcm = resample(audio, 16_000, 24_000)
        for i in range(0, len(pcm), 2400):  # 100 ms appends, as the frameworks send them
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": encode_pcm16_base64(pcm[i:i + 2400])}))
        await until(ws, "real session", "response.done")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": user_text("And the day after?")}))
        await ws.send(json.dumps({"type": "response.create"}))
        await until(ws, "real session", "response.done")
    # Opted in from here (as the page does): a session that can be resumed, a resume, then the extension close.
    stock = False
    async with websockets.connect(url + "?extensions=duplex,events", max_size=64 << 20) as ws:
        created = await until(ws, "real session (extensions)", "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {**turn_detection(None), "duplex": False}}))
        await until(ws, "real session (extensions)", "session.updated")
        async with websockets.connect(url + "?resume=1", max_size=64 << 20) as again:
            await again.send(json.dumps({"type": "session.resume", "session_id": created["session"]["id"],
                                         "resume_token": created["resume_token"],
                                         "last_received_server_event_seq": got[-1][2]["server_event_seq"]}))
            await until(ws, "real session (resumed elsewhere)", "session.replaced")
            await until(again, "real session (resumed)", "session.resumed")
            await again.send(json.dumps({"type": "session.close"}))
            await until(again, "real session (resumed)", "session.closed")
    return got


@pytest.fixture(scope="module")
def emitted(gateway, speech) -> Iterator[list[tuple[str, bool, dict[str, Any]]]]:
    yield [*pure_events(), *asyncio.run(real_session(gateway.realtime, speech))]


# ---- the checks ----

MISSING = "(missing)"


def _value(event: dict[str, Any], loc: tuple[Any, ...]) -> Any:
    """The value at a validation error's location (union branches in the path skipped)."""
    value: Any = event
    for key in loc:
        if _is_branch(key):
            continue
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and isinstance(key, int) and key < len(value):
            value = value[key]
        else:
            return MISSING
    return value


def _is_branch(part: Any) -> bool:
    """A union branch in a validation error's location (a model's name, or pydantic's tag for a branch)."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part)


def _extras(value: Any, path: str) -> list[str]:
    """The fields a parsed event carries that its model does not define (kept by `extra="allow"`)."""
    if isinstance(value, pydantic.BaseModel):
        out = [f"{path}.{k}".lstrip(".") for k in sorted(value.model_extra or {})]
        for name in type(value).model_fields:
            out += _extras(getattr(value, name), f"{path}.{name}")
        return out
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _extras(v, f"{path}.{i}")]
    return []


# Fields OpenAI's own server sends in a session that the package's model does not define.
OPENAI_SENDS = frozenset({"session.id", "session.object", "session.expires_at"})
ENVELOPE = "server_event_seq"  # the shell's, on every event (resume): checked once, not per event type


def violations(event: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Each value the spec's model refuses (`path = value: why`), and (once the values conform) each field
    it does not define (its model keeps them, `extra="allow"`: the SDKs pass them over)."""
    try:
        parsed = SPEC.validate_python(event)
    except pydantic.ValidationError as exc:
        errors = [(err["loc"][1:], err) for err in exc.errors()]  # loc[0]: the discriminator's value
        # Of the top union's branches, the one the event came closest to (fewest errors) is the one it meant.
        branches: dict[Any, int] = {}
        for loc, _ in errors:
            top = next((p for p in loc if _is_branch(p)), None)
            branches[top] = branches.get(top, 0) + 1
        meant = min(branches, key=lambda b: (b is not None, branches[b]))
        merged: dict[str, list[str]] = {}
        for loc, err in errors:
            top = next((p for p in loc if _is_branch(p)), None)
            if top not in (None, meant):
                continue
            path = ".".join(str(p) for p in loc if not _is_branch(p))
            key = f"{path} = {json.dumps(_value(event, loc))[:80]}"
            if err["msg"] not in merged.setdefault(key, []):
                merged[key].append(err["msg"])
        return [f"{key}: {' | '.join(msgs)}" for key, msgs in merged.items()], []
    return [], [path for path in _extras(parsed, "") if path not in OPENAI_SENDS and path != ENVELOPE]


def report(event_type: str, seen: list[tuple[str, bool, dict[str, Any]]], extras: bool) -> list[str]:
    """What is wrong with one event type as the scenarios saw it, each problem once, with where it was seen.
    Not `extras`: refused values, and extension events sent to a stock client; `extras`: fields outside the
    spec sent to a stock client."""
    problems: dict[str, set[str]] = {}
    for scenario, stock, event in seen:
        if event_type not in SPEC_TYPES:
            if stock and not extras:
                problems.setdefault("not a spec event, sent to a stock client (no opt-in)", set()).add(scenario)
            continue
        refused, outside = violations(event)
        for problem in (outside if extras else refused):
            if stock or not extras:
                problems.setdefault(problem, set()).add(scenario)
    return [f"{event_type}: {p}  [{'; '.join(sorted(s))}]" for p, s in sorted(problems.items())]


def seen_of(event_type: str, emitted: list[tuple[str, bool, dict[str, Any]]]) -> list[tuple[str, bool, dict]]:
    seen = [s for s in emitted if s[2]["type"] == event_type]
    assert seen, f"{event_type} ({emittable()[event_type].__qualname__}): no scenario emits it; add one"
    return seen


@pytest.mark.parametrize("event_type", sorted(emittable()))
def test_every_event_type_the_dialect_can_emit_conforms(event_type: str, emitted) -> None:
    problems = report(event_type, seen_of(event_type, emitted), extras=False)
    assert not problems, "\n".join(["", *problems])


@pytest.mark.parametrize("event_type", sorted(emittable()))
def test_a_stock_client_gets_no_field_outside_the_spec(event_type: str, emitted) -> None:
    """Extensions are opt-in, fields too: listed for the events whose values conform."""
    problems = report(event_type, seen_of(event_type, emitted), extras=True)
    assert not problems, "\n".join(["", *problems])


def test_a_stock_client_gets_no_envelope_field_outside_the_spec(emitted) -> None:
    stamped = sorted({e["type"] for _, stock, e in emitted if stock and ENVELOPE in e})
    assert not stamped, f"{ENVELOPE} (a field outside the spec) on every event a stock client gets: {stamped}"


def test_the_scenarios_emit_only_known_event_types(emitted) -> None:
    """An event type the dialect sends but the enumeration does not know (built outside its classes)."""
    unknown = {e["type"] for _, _, e in emitted} - set(emittable())
    assert not unknown, sorted(unknown)


def test_the_check_passes_a_conforming_event_and_names_each_refused_value() -> None:
    """The checker itself: a spec `response.done` passes; ours names the field, the value and the enum."""
    done = {"type": "response.done", "event_id": "event_1", "response": {
        "id": "resp_1", "object": "realtime.response", "status": "cancelled",
        "status_details": {"type": "cancelled", "reason": "turn_detected"}, "output": []}}
    assert violations(done) == ([], [])
    done["response"]["status_details"]["reason"] = "barge_in"
    done["response"]["epoch"] = 3
    [refused], _ = violations(done)
    assert refused.startswith('response.status_details.reason = "barge_in": Input should be \'turn_detected\'')
    done["response"]["status_details"]["reason"] = "client_cancelled"
    assert violations(done) == ([], ["response.epoch"])

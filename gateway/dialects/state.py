"""What every dialect's session state is to the shell (pure code): client frames and step events in, `Effects`
out; the steps it asks Triton for, the epoch fence, and the first step's options.

A client frame is taken in two parts, so the state machine stays cheap enough to call inline:
1. `read_frame(text, plan)`: the frame's CPU work (JSON, base64, resampling, VAD) into a typed client input.
   It reads only `plan` (taken from the state by `frame_plan()` just before) and writes only the input
   stream's own state (a resampler, the VAD's), which nothing else touches: the shell may run it in a
   worker thread (a frame of `offload_frame_bytes` or more) while the state stays on the event loop.
2. `on_frame(read)`: the state machine; a `ProtocolError` it raises is answered with `error_event`.
`on_text(text)` is both at once (small frames, tests). Step events come in through `on_step_event`,
`on_step_error` and `on_step_end`. Nothing here does I/O; the shell (`gateway/shell.py`) does.
"""

from __future__ import annotations

import builtins
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Generic, Literal, Protocol, Self, TypeVar, dataclass_transform

import numpy as np

from minicpmo_triton.duplex_contract import ChatInput, StepEvent, StepInput, VoiceRefs
from minicpmo_triton.rules.duplex_options import DuplexOptions

from ..codes import ClientCode
from ..limits import Limits
from ..wire import LARGE_FRAME_BYTES, ProtocolError, Usage

STEP_SAMPLES = 16_000  # the caller audio of one duplex step: 1 s at 16 kHz


class ServerEvent(Protocol):
    """A typed server event; its dialect's envelope says how it goes on the wire."""

    def encode(self) -> dict[str, Any]: ...


@dataclass_transform()
class EventFields:
    """Base of a dialect's server events: each subclass is a dataclass, its event `type` given with the
    class (`class Done(EventFields, type="response.done")`); `None` fields are left out."""

    type: ClassVar[str] = ""
    __dataclass_fields__: ClassVar[dict[str, Any]]  # each subclass's, from `dataclass` (for `fields`)

    def __init_subclass__(cls, type: str = "", **kwargs: Any) -> None:  # `type`: the wire's name
        super().__init_subclass__(**kwargs)
        if type:
            cls.type = type
        dataclass(cls)

    def fields(self) -> dict[str, Any]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    @classmethod
    def retyped(cls, name: str, event_type: str) -> builtins.type[Self]:
        """The same fields under another event type (`response.done` beside `response.created`)."""
        return types.new_class(name, (cls,), {"type": event_type})


class Refusal:
    """Mixed into a dialect's `error` event: its code, which the gateway's metrics count per dialect."""

    error: Mapping[str, object]  # the event's error object, its "code" a ClientCode

    @property
    def code(self) -> str:
        return str(self.error.get("code", ""))


class Closed(EventFields, type="session.closed"):
    """What every dialect says last (each in its envelope)."""

    session_id: str
    reason: str
    usage: dict[str, int]
    diagnostic: dict[str, str] | None = None


# duplex: one second of caller audio; context: text into the model's context; chat: a turn-based turn
StepKind = Literal["duplex", "context", "chat"]
CauseT = TypeVar("CauseT")  # what a dialect keeps of the client event that asked for a step


@dataclass
class PlannedStep(Generic[CauseT]):
    kind: StepKind
    request: StepInput | ChatInput
    epoch: int
    second: int = -1  # duplex: which second of caller audio it hears (1, 2, ...)
    response_id: str | None = None  # chat: the response it makes
    cause: CauseT | None = None  # the client event that asked for it, when the dialect needs it back
    # when the input that completed it was decided: a step's latency and its queue time count from here
    planned_at: float = field(default_factory=time.monotonic, compare=False, repr=False)


@dataclass
class Effects:
    events: list[ServerEvent] = field(default_factory=list)
    steps: list[PlannedStep[Any]] = field(default_factory=list)  # each dialect knows its own steps' causes
    cancel: bool = False  # stop the Triton step in flight
    close: str | None = None  # end the session with this reason

    def extend(self, other: Effects) -> Effects:
        self.events += other.events
        self.steps += other.steps
        self.cancel = self.cancel or other.cancel
        self.close = self.close or other.close
        return self


@dataclass
class DialectState(Generic[CauseT]):
    """Epochs fence output: a step planned before a barge-in is of an older epoch, and none of its
    events reach the client, however late they arrive."""

    # A client frame of this many bytes or more (characters: JSON carrying base64 audio is ASCII) is read in a
    # worker thread by the shell, its reading holding the event loop longer than the hand-off costs (by default a
    # large one: a 16 MiB frame's parsing and base64 decoding; None: every frame is read on the loop).
    offload_frame_bytes: ClassVar[int | None] = LARGE_FRAME_BYTES
    dialect: ClassVar[str] = ""  # its name in the gateway's metrics (gateway/metrics.py DIALECTS)

    session_id: str
    epoch: int = 0
    started: bool = False  # the first step (with the session's options) has been sent
    usage: Usage = field(default_factory=Usage)
    stale_dropped: int = 0
    voice: dict[str, np.ndarray] = field(default_factory=dict)  # ref_audio / tts_ref_audio, 16 kHz
    limits: Limits = field(default_factory=Limits.default)  # the cost model per caller, checked as input comes in
    charge_voice: Callable[[np.ndarray], None] = lambda audio: None  # a new voice reference, within its budget

    # ---- what the shell asks of every dialect ----
    def options(self) -> DuplexOptions:
        raise NotImplementedError

    def created(self) -> list[ServerEvent]:
        """What a new session says first."""
        return []

    def frame_plan(self) -> Any:
        """What reading the next frame needs to know of the state (cheap; on the event loop)."""
        return None

    def read_frame(self, text: str, plan: Any) -> Any:
        """A client frame's CPU work, into the typed input `on_frame` takes; a `ProtocolError` refuses it."""
        raise NotImplementedError

    def on_frame(self, read: Any) -> Effects:
        """The state machine's answer to a frame `read_frame` read; a ProtocolError is answered with `error_event`."""
        raise NotImplementedError

    def on_text(self, text: str) -> Effects:
        """One client frame, read and answered at once."""
        return self.on_frame(self.read_frame(text, self.frame_plan()))

    def error_event(self, err: ProtocolError) -> ServerEvent:
        raise NotImplementedError

    def backpressure(self, pending: int) -> ProtocolError:
        return ProtocolError(ClientCode.INPUT_BACKPRESSURE,
                             f"{pending} inputs are already waiting; this one was dropped")

    def on_step_event(self, step: PlannedStep[CauseT], ev: StepEvent) -> Effects:
        raise NotImplementedError

    def on_step_error(self, step: PlannedStep[CauseT], code: ClientCode, message: str) -> Effects:
        """A step the stages refused for the client's input (the session goes on)."""
        return Effects([self.error_event(ProtocolError(code, message, error_type="client_error"))])

    def on_step_end(self, step: PlannedStep[CauseT]) -> Effects:
        """A step whose events all arrived without an error."""
        return Effects()

    def on_close(self, reason: str, message: str | None) -> list[ServerEvent]:
        """What the client is told as the session ends (a response still open is ended first)."""
        raise NotImplementedError

    def wanted(self, step: PlannedStep[CauseT]) -> bool:
        return True

    # ---- shared ----
    def voice_name(self) -> str:
        """A named voice for the session (the model server's voice folder); empty: none."""
        return ""

    def prepare(self, step: PlannedStep[CauseT]) -> StepInput | ChatInput:
        """The request as it goes out: the session's options and voice ride on the very first step.
        A step belongs to the epoch it is sent in: one queued before a barge-in but sent after it counts."""
        step.epoch = self.epoch
        req = step.request
        if not self.started:
            self.started = True
            req.options = self.options()
            name = self.voice_name()
            req.voice = VoiceRefs(**self.voice, name=name) if self.voice or name else None
        return req

    def is_stale(self, step: PlannedStep[CauseT], ev: StepEvent) -> bool:
        if ev.chunk_usage:
            self.usage.add(ev.chunk_usage)  # what the stages did counts, shown or not
        if step.epoch != self.epoch:
            self.stale_dropped += 1
            return True
        return False

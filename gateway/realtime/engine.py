"""What the Realtime dialects share (pure code): the steps they ask Triton for, the effects they ask the
shell to carry out, the epoch fence, and the first step's options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minicpmo_triton.duplex_options import DuplexOptions

from ..session import Usage
from ..triton_stream import StepEvent, StepRequest

UNIT = 16_000  # one duplex step: 1 s of 16 kHz audio


@dataclass
class PlannedStep:
    kind: str  # duplex | context | chat
    request: StepRequest
    epoch: int
    unit: int = -1  # duplex: which second of caller audio
    response_id: str | None = None  # chat: the response it makes


@dataclass
class Effects:
    events: list[dict[str, Any]] = field(default_factory=list)
    steps: list[PlannedStep] = field(default_factory=list)
    cancel: bool = False  # stop the Triton step in flight
    close: str | None = None  # end the session with this reason

    def extend(self, other: Effects) -> Effects:
        self.events += other.events
        self.steps += other.steps
        self.cancel = self.cancel or other.cancel
        self.close = self.close or other.close
        return self


@dataclass
class EngineState:
    """Epochs fence output: a step planned before a barge-in is of an older epoch, and none of its
    events reach the client, however late they arrive."""

    session_id: str
    epoch: int = 0
    started: bool = False  # the first step (with the session's options) has been sent
    usage: Usage = field(default_factory=Usage)
    stale_dropped: int = 0
    voice: dict[str, np.ndarray] = field(default_factory=dict)  # ref_audio / tts_ref_audio, 16 kHz

    def options(self) -> DuplexOptions:
        raise NotImplementedError

    def voice_name(self) -> str:
        """A named voice for the session (the model server's voice folder); empty: none."""
        return ""

    def prepare(self, step: PlannedStep) -> StepRequest:
        """The request as it goes out: the session's options and voice ride on the very first step.
        A step belongs to the epoch it is sent in: one queued before a barge-in but sent after it counts."""
        step.epoch = self.epoch
        req = step.request
        if not self.started:
            self.started = True
            req.options = self.options().to_dict()
            req.voice = self.voice or None
            req.voice_name = self.voice_name()
        return req

    def is_stale(self, step: PlannedStep, ev: StepEvent) -> bool:
        if ev.chunk_usage:
            self.usage.add(ev.chunk_usage)  # what the stages did counts, shown or not
        if step.epoch != self.epoch:
            self.stale_dropped += 1
            return True
        return False

    def on_client(self, msg: dict[str, Any]) -> Effects:
        raise NotImplementedError

    def on_step_event(self, step: PlannedStep, ev: StepEvent) -> Effects:
        raise NotImplementedError

    def on_step_error(self, step: PlannedStep, code: str, message: str) -> Effects:
        raise NotImplementedError

    def wanted(self, step: PlannedStep) -> bool:
        return True

    def on_close(self, reason: str) -> Effects:
        """What the client is told before `session.closed` (a response still open is ended)."""
        return Effects()

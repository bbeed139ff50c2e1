"""The caller's audio in duplex (pure code): each whole second of it is one duplex step; the next step also
carries what a barge-in asked for (the second the caller barged in is listened to; the LLM's context is taken
back to the last point the listener heard, and the seconds sent since are heard again).

Each second is a step as soon as it is whole: one long append (OpenAI takes events up to 15 MiB, minutes of audio)
is its seconds' steps at once, queued in order by the shell, whose one bound (`max_pending_steps`) refuses an
input that comes while that many wait.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic

import numpy as np

from minicpmo_triton.duplex_contract import StepInput

from .state import STEP_SAMPLES, CauseT, PlannedStep

REPLAY_SECONDS = 8  # how many seconds of caller audio a rollback may hear again


@dataclass(frozen=True)
class Mark:
    """A point in the LLM's context: its length after a step, and the second of caller audio that step heard."""

    kv: int = -1
    second: int = -1


@dataclass
class DuplexInput(Generic[CauseT]):
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # short of a whole second
    seconds: int = 0  # seconds made into steps so far
    images: list[bytes] = field(default_factory=list)  # seen with the next second
    sent: deque[tuple[int, np.ndarray]] = field(default_factory=lambda: deque(maxlen=REPLAY_SECONDS))
    last_listen: Mark = Mark()  # after the latest step that did not speak
    rollback: Mark | None = None  # where the next step takes the LLM's context back to
    listen_next: bool = False  # the next step is listened to (the second in which the caller barged in)

    def add(self, audio: np.ndarray, epoch: int) -> list[PlannedStep[CauseT]]:
        """Audio in; a step for each second it completes, in order."""
        self.pending = np.concatenate([self.pending, audio])
        steps = []
        while len(self.pending) >= STEP_SAMPLES:
            second, self.pending = self.pending[:STEP_SAMPLES], self.pending[STEP_SAMPLES:]
            steps.append(self.step(second, epoch))
        return steps

    def take_pending(self) -> np.ndarray:
        audio, self.pending = self.pending, np.zeros(0, np.float32)
        return audio

    def step(self, audio: np.ndarray, epoch: int) -> PlannedStep[CauseT]:
        self.seconds += 1
        frames, self.images = self.images, []
        req = StepInput(audio=audio, frames=frames, max_slice_nums=[1] * len(frames))
        return PlannedStep("duplex", req, epoch, second=self.seconds)

    def amend(self, step: PlannedStep[CauseT], req: StepInput) -> None:
        """A duplex step as it goes out: what the latest barge-in asked of the next one."""
        req.force_listen = req.force_listen or self.listen_next
        self.listen_next = False
        if self.rollback is not None:
            target, self.rollback = self.rollback, None
            replay = [a for s, a in self.sent if s > target.second]
            # only when the seconds since that point are all still held
            if target.kv >= 0 and (not self.sent or self.sent[0][0] <= target.second + 1):
                req.rollback_to = target.kv
                req.replay_audio = np.concatenate(replay) if replay else np.zeros(0, np.float32)
        self.sent.append((step.second, req.audio))

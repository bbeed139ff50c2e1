"""The caller's audio in duplex (pure code): each whole second of it is one duplex step; the next step also
carries what a barge-in asked for (the second the caller barged in is listened to; the LLM's context is taken
back to the last point the listener heard, and the seconds sent since are heard again).

Steps are handed out in order, at most `MAX_AHEAD` at a time: a client streaming in real time gets each second's
step at once, and one long append (OpenAI takes events up to 15 MiB, minutes of audio) waits here as seconds,
each made a step as an earlier one is answered, rather than overflowing the session's queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic

import numpy as np

from minicpmo_triton.duplex_contract import StepInput

from ..codes import ClientCode
from ..wire import ProtocolError
from .state import STEP_SAMPLES, CauseT, PlannedStep

REPLAY_SECONDS = 8  # how many seconds of caller audio a rollback may hear again
MAX_AHEAD = 4  # steps handed to the shell and not answered yet (its queue holds 8)
MAX_WAITING = 8  # steps waiting here when an append comes: more, and the caller streams faster than it is heard


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
    waiting: deque[PlannedStep[CauseT]] = field(default_factory=deque)  # in order, not handed out yet
    ahead: int = 0  # handed out, not answered yet

    def check_room(self) -> None:
        """Before an append: refused when the steps of earlier ones still wait (the model hears slower than
        the caller streams), as the shell refuses a step its queue has no room for."""
        if len(self.waiting) > MAX_WAITING:
            raise ProtocolError(ClientCode.INPUT_BACKPRESSURE,
                                f"{len(self.waiting)} seconds of audio are already waiting; "
                                "this append was dropped")

    def add(self, audio: np.ndarray, epoch: int) -> list[PlannedStep[CauseT]]:
        """Audio in; a step for each second it completes (handed out in turn)."""
        self.pending = np.concatenate([self.pending, audio])
        while len(self.pending) >= STEP_SAMPLES:
            second, self.pending = self.pending[:STEP_SAMPLES], self.pending[STEP_SAMPLES:]
            self.waiting.append(self.step(second, epoch))
        return self.release()

    def queue(self, step: PlannedStep[CauseT]) -> list[PlannedStep[CauseT]]:
        """A step (a commit's, a context's) after those waiting."""
        self.waiting.append(step)
        return self.release()

    def release(self) -> list[PlannedStep[CauseT]]:
        out = []
        while self.waiting and self.ahead < MAX_AHEAD:
            out.append(self.waiting.popleft())
            self.ahead += 1
        return out

    def answered(self) -> list[PlannedStep[CauseT]]:
        """A step handed out was answered (its events are in): the next ones waiting, if any."""
        self.ahead = max(0, self.ahead - 1)
        return self.release()

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

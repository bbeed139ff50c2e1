"""In-flight batching for token2wav on the device path: one engine thread runs iterations; in each, every open call
with a chunk ready gives its next chunk, and they run as one batch (`DeviceStreamer.chunk`: the conformer, the 5
DiT steps and the vocoder once for all of them). Calls join between iterations: a call that arrives while an
iteration runs joins the next one, and a call is answered in the iteration its last chunk is done, so a session's
chunk never waits for another's call of several chunks to finish (as the `llm` and `tts` models' loops:
stages/inflight.py).

Where things happen (all on the engine thread, so the stage's store and the streamer's slots have one user):
- a call is admitted when its session has no call open (a session's calls run in order): START creates the
  session's state, `check` refuses a bad call, the stage's `_chunks` turns its tokens into chunks (the flush
  rules, a turn's start and end);
- a turn takes a slot at its first chunk; while every slot is taken, a turn's first chunk waits for the next
  iteration (never refused: turns end within seconds and give theirs back);
- `_answer` is the one place a call is answered, and so the one place END releases its session (its slot, its
  voice: `Token2WavStage.drop_state`);
- an iteration that raises fails every call in it: each one's turn ends there (its slot released, the
  session's next call starts a new turn); a row whose audio is not finite fails alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import Code, StepError
from ..stage_io import Token2WavRequest, Token2WavResult
from .base import StageCall
from .preparer import Served
from .token2wav import Token2WavSession, Token2WavStage
from .token2wav_device import DeviceStreamer, SlotStream

Reply = Callable[[Any], None]


@dataclass(eq=False)
class _Open:
    """An admitted call: its chunks, the next one to run and the audio so far."""

    call: StageCall[Token2WavRequest]
    reply: Reply
    sess: Token2WavSession
    stream: SlotStream
    chunks: list[tuple[list[int], bool]]
    done: int = 0
    audio: list[np.ndarray] = field(default_factory=list)
    join_iteration: int = 0


class InflightToken2Wav(Served):
    """The engine thread of one `token2wav` model instance on the device path."""

    def __init__(self, stage: Token2WavStage, sweep_period_s: float,
                 on_change: Callable[[], None] = lambda: None) -> None:
        assert isinstance(stage.streamer, DeviceStreamer), "in-flight token2wav runs the device path"
        self.stage = stage
        self.streamer: DeviceStreamer = stage.streamer
        self.sweep_period_s = sweep_period_s
        self.on_change = on_change
        self.iterations = 0
        self._queue: deque[tuple[StageCall[Token2WavRequest], Reply]] = deque()
        self._open: list[_Open] = []
        self._start("token2wav-engine")

    # ---- the public side ----
    def submit(self, call: StageCall[Token2WavRequest], reply: Reply) -> None:
        self._wake(lambda: self._queue.append((call, reply)))

    # ---- the engine thread ----
    def _serve(self) -> None:
        while True:
            with self._cv:
                if not self._queue and not self._open and not self._stop:
                    self._cv.wait(self.sweep_period_s)
                if self._stop:
                    return
            try:
                with self.streamer.lock:
                    if self.stage.store.evict_expired():  # here: the slots have one user
                        self.on_change()
                    self._admit()
                    ran = self._iterate()
            except Exception as exc:  # noqa: BLE001 (a bug in the loop itself: its callers are told, it serves on)
                for o in list(self._open):
                    self._fail(o, exc)
                continue
            if self._open and not ran:  # every open turn waits for a slot: only a new call can free one
                with self._cv:
                    if not self._queue and not self._stop:
                        self._cv.wait(self.sweep_period_s)

    def _admit(self) -> None:
        """Queued calls whose session has no call open join now, in arrival order."""
        with self._cv:
            busy = {o.call.corr_id for o in self._open}
            ready: list[tuple[StageCall[Token2WavRequest], Reply]] = []
            held: deque[tuple[StageCall[Token2WavRequest], Reply]] = deque()
            for call, reply in self._queue:
                (held if call.corr_id in busy else ready).append((call, reply))
                busy.add(call.corr_id)
            self._queue = held
        for call, reply in ready:
            try:
                sess = self.stage.enter(call)
                if sess is None:
                    self._answer(call, reply, self.stage.empty_result())
                    continue
                stream, chunks = self.stage.plan(call.request, sess)
            except Exception as exc:  # noqa: BLE001 (one bad call must not fail the others)
                self._answer(call, reply, exc)
                continue
            opened = _Open(call, reply, sess, stream, chunks, join_iteration=self.iterations)
            if chunks:
                self._open.append(opened)
            else:
                self._finish(opened)
        if ready:
            self.on_change()

    def _iterate(self) -> bool:
        """One batch: every open call's next chunk (a turn that needs a slot while none is free waits). False:
        nothing could run."""
        free = self.streamer.free_slots()
        rows: list[_Open] = []
        for o in self._open:
            tokens, _ = o.chunks[o.done]
            if tokens and o.stream.slot is None:
                if free == 0:
                    continue
                free -= 1
            rows.append(o)
        if not rows:
            return False
        self.iterations += 1
        try:
            audio = self.streamer.chunk([(o.stream, *o.chunks[o.done]) for o in rows])
        except Exception as exc:  # noqa: BLE001 (the batch's forward failed: its calls fail, their turns end)
            for o in rows:
                self._fail(o, exc)
            return True
        for o, wav in zip(rows, audio, strict=True):
            if not np.isfinite(wav).all():
                self._fail(o, StepError(Code.NUMERIC_ERROR, "token2wav: the audio is not finite"))
                continue
            o.audio.append(wav)
            o.done += 1
            if o.done == len(o.chunks):
                self._open.remove(o)
                self._finish(o)
        return True

    def _finish(self, o: _Open) -> None:
        self._answer(o.call, o.reply, self.stage.result(o.call.request, o.audio))

    def _fail(self, o: _Open, exc: Exception) -> None:
        """A call that failed: its turn ends (the slot goes back; the session's next call starts a new turn)."""
        self.streamer.restart(o.stream)
        o.sess.turn_open = False
        if o in self._open:
            self._open.remove(o)
        self._answer(o.call, o.reply, exc)

    def _answer(self, call: StageCall[Token2WavRequest], reply: Reply, result: Token2WavResult | Exception) -> None:
        """The one place a call is answered, and so the one place END releases its session."""
        if call.end:
            self.stage.store.end(call.corr_id)
            self.on_change()
        reply(result)

"""New voices off the batch: a call that brings a voice reference token2wav has no prompt for waits for that
prompt (S3 tokens, CAM++, the flow's prompt pass: about a second for 30 s of reference) on a worker thread of its
own, while the other calls of its batch are answered at once; it runs, alone, when its prompt is ready.

The budget: one worker, so one preparation at a time, the others queued in arrival order, at most `max_queued` of
them (running or waiting) across sessions: past that a call with yet another new reference is refused at once,
`queue_full` (retryable), and waits for nothing; a session has at most one in flight (its next step waits for this
one's answer). Two calls with the same new reference share one preparation (the second is not counted again).
The stage's state is touched by one batch at a time (`lock`): the batches of the model's execute
and the calls answered after their preparation. ONNX Runtime and numpy's BLAS release the GIL, so a preparation
runs beside the batches. It is bulk work (`as_bulk`): on a shared CPU, the steps of the calls in progress come first.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..errors import Code, StepError
from ..stage_io import Token2WavRequest, Token2WavResult
from .base import StageCall
from .token2wav import Token2WavStage

Answer = Callable[[Token2WavResult | Exception], None]
MAX_QUEUED = 8  # the stage setting voice_prep_queue's default: 8 x ~1 s of preparation (30 s references, 2 cores)
# The CPU priority (nice) of work no call's next step waits on: a new voice's preparation and its encoding. On a shared
# CPU, 12 callers bringing new 30 s voices at once pushed the calls in progress to 7x their step latency alone.
BULK_NICE = 10


def as_bulk(whole_process: bool = False) -> None:
    """This thread (or every thread of this process, and so the threads they start) below the calls' steps on a
    shared CPU (Linux's per-thread nice). Where the OS will not, nothing changes."""
    tids = [int(t.name) for t in Path("/proc/self/task").iterdir()] if whole_process else [threading.get_native_id()]
    for tid in tids:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, tid, max(BULK_NICE, os.getpriority(os.PRIO_PROCESS, tid)))


class VoicePreparer:
    def __init__(self, stage: Token2WavStage, max_queued: int = MAX_QUEUED,
                 submit: Callable[[StageCall[Token2WavRequest], Answer], None] | None = None) -> None:
        """`submit`: the device path's in-flight loop, which answers a call itself; None: calls run here, a batch
        at a time under `lock`."""
        self.stage = stage
        self.max_queued = max_queued
        self.submit = submit
        self.lock = threading.Lock()  # the stage's state: one batch at a time
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="voice-prep", initializer=as_bulk)
        self._pending: dict[bytes, Future[None]] = {}  # preparations queued or running, by the reference's key
        self._pending_lock = threading.RLock()  # a preparation done at once runs `_forget` under it

    def serve(self, calls: list[StageCall[Token2WavRequest]], answers: Sequence[Answer],
              after: Callable[[], None] = lambda: None) -> None:
        """Answer each call through its `answers` entry: those whose voice prompt is at hand now, as one batch;
        one with a new reference once its prompt is prepared. `after`: once a batch's answers are sent."""
        now: list[int] = []
        for i, call in enumerate(calls):
            new = self.stage.new_voice(call.request)
            if new is None:
                now.append(i)
                continue
            prepared = self._prepare(*new)
            if prepared is None:
                self._refuse(call, answers[i])
            else:
                prepared.add_done_callback(functools.partial(self._run_after, call=call, answer=answers[i],
                                                             after=after))
        if now and self.submit is not None:
            for i in now:
                self.submit(calls[i], answers[i])
        elif now:
            with self.lock:
                results = self.stage.run([calls[i] for i in now])
            for i, result in zip(now, results, strict=True):
                answers[i](result)
            after()

    def _prepare(self, key: bytes, audio: np.ndarray) -> Future[None] | None:
        """The preparation of this reference, queued now or shared; None: the queue is full."""
        with self._pending_lock:
            pending = self._pending.get(key)
            if pending is None and len(self._pending) >= self.max_queued:
                return None
            if pending is None:
                pending = self._pending[key] = self._worker.submit(self.stage.prompts.prepare, key, audio)
                pending.add_done_callback(lambda _: self._forget(key))
            return pending

    def _refuse(self, call: StageCall[Token2WavRequest], answer: Answer) -> None:
        """Too many new voices queued: this call is answered now, refused."""
        self._fail(call, answer, StepError(Code.QUEUE_FULL, f"token2wav: {self.max_queued} new voices are being "
                                                            "prepared; retry later (or use a voice already in use)"))

    def _fail(self, call: StageCall[Token2WavRequest], answer: Answer, exc: Exception) -> None:
        """The call fails with `exc` (its END still ends the sequence)."""
        if call.end:
            self.stage.store.end(call.corr_id)
        answer(exc)

    def _forget(self, key: bytes) -> None:
        with self._pending_lock:
            self._pending.pop(key, None)

    def _run_after(self, prepared: Future[None], call: StageCall[Token2WavRequest], answer: Answer,
                   after: Callable[[], None]) -> None:
        """The call, once its prompt is prepared; if that failed, the call fails with it (its END still ends it)."""
        try:
            prepared.result()
        except Exception as exc:  # noqa: BLE001 (the preparation's error is this call's answer)
            self._fail(call, answer, exc)
        else:
            if self.submit is not None:
                self.submit(call, answer)
                return
            with self.lock:
                [result] = self.stage.run([call])
            answer(result)
        after()

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)

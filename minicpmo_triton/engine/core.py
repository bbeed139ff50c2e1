"""The engine core: schedule -> step -> update, one iteration at a time (vLLM v1's `EngineCore`).

`step()` plans an iteration (`Scheduler`), launches it (`ModelRunner.step`: no callback into anyone), and reads
back the previous one's picks (`update`): each decoding row's host rules confirm the token the device chose
(`Request.rules.confirm`), a row its rules end is finished, its pool length settled, its hidden rows brought back
with the next download. With `overlap` (the default) iteration n + 1 is launched before n's picks are read: the
device already holds what n + 1 feeds (the rules' state moved on there), so the host's bookkeeping of n runs while
the device computes n + 1, and the host waits only for n's download. What that costs: a row that a host-only rule
ends (the 28-character cut) runs one iteration more, wasted, and is retired; its rng's uniforms are restored to
what the host used. Without overlap each iteration is read right after its launch.

A request's one release site is here: `_finish` (finished or failed), which frees its batch row; the pool blocks
and the session's state stay the stage's to settle with the result.
"""

from __future__ import annotations

import time

import torch

from .protocol import ENDED
from .request import Request, Status
from .runner import Launched, ModelRunner
from .scheduler import Scheduler

__all__ = ["EngineCore", "Request", "Status"]


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, overlap: bool = True) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.overlap = overlap
        self.iterations = 0  # iterations launched since the core was built: the in-flight loop's clock
        self._launched: Launched | None = None  # an iteration whose picks are not read yet
        self._completing: list[Request] = []  # finished, their hidden rows coming with the next download
        self._clock = 0  # the iteration whose picks are being read

    @property
    def pool(self):
        return self.runner.pool

    def add(self, request: Request) -> None:
        request.t_admitted = time.perf_counter()
        self.scheduler.add(request)

    def busy(self, session: object) -> bool:
        return self.scheduler.busy(session) or any(r.session == session for r in self._completing)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._launched is not None or bool(self._completing)

    def step(self) -> list[Request]:
        """One iteration; the requests that ended in it (FINISHED with their results, or FAILED with their error)."""
        batch = self.scheduler.schedule()
        launched = None
        if not batch.empty:
            for p in batch.prefills:
                if p.start == 0:
                    p.request.join_iteration = self.iterations
            launched = self.runner.step(batch)
            self.iterations += 1
            launched.clock = self.iterations
        if not self.overlap and launched is not None:
            return self._update(launched)
        previous, self._launched = self._launched, launched
        if previous is not None:
            return self._update(previous)
        if launched is None and self._completing:  # nothing more to launch: their rows' download, alone
            return self._drain()
        return []

    def run(self, requests: list[Request]) -> None:
        """Every request to its end (the stages' synchronous path: a batch waited for as a whole, so nothing is
        launched ahead of its last picks: no iteration is run past its end)."""
        while self._launched is not None:
            self.step()
        overlap, self.overlap = self.overlap, False
        try:
            for req in requests:
                self.add(req)
            while any(not r.finished for r in requests) or self._completing:
                self.step()
        finally:
            self.overlap = overlap

    def abort(self) -> list[Request]:
        """After an iteration that raised: every request taken in is given up (its row freed, its rng restored),
        and returned (its session undone by its caller); queued ones stay queued."""
        self._launched = None
        taken = self.scheduler.clear() + self._completing
        self._completing, self.runner._fetches = [], []
        for req in taken:
            if req.rules is not None:
                req.rules.done()
            req.status = Status.FAILED
        return taken

    # ---- update ----
    def _update(self, launched: Launched) -> list[Request]:
        picks = launched.picks()  # the one wait of an iteration
        self._clock = launched.clock  # a request ended by these picks ended in this iteration
        ended: list[Request] = []
        self._arrived(launched.fetches, ended)
        now = time.perf_counter()
        batch = launched.batch
        for p in batch.prefills:
            req = p.request
            if not req.finished and not req.decodes and req.done_prefill == len(req.prefill):
                req.length = req.past + len(req.prefill)
                self._finish(req, ended, retire=False)
        for req in batch.results:
            if req.status is not Status.RUNNING:
                continue  # ended by an earlier iteration's picks: this one's row was wasted
            if not req.t_first:
                req.t_first = now
                req.length = req.past + len(req.prefill)
            token, flags = int(picks[req.slot, 0]), int(picks[req.slot, 1])
            try:
                goes_on = req.rules.confirm(token, flags)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 (this row's rules broke: it fails alone, the others go on)
                req.error = exc
                self._finish(req, ended, retire=True)
                continue
            if goes_on:
                req.length += 1  # the token is written by the next iteration
            else:
                self._finish(req, ended, retire=not flags & ENDED)  # the device stopped it too, or not
        return ended

    def _finish(self, req: Request, ended: list[Request], retire: bool) -> None:
        req.status = Status.FAILED if req.error is not None else Status.FINISHED
        req.done_iteration = self._clock
        req.t_done = time.perf_counter()
        if req.rules is not None:
            req.rules.done()
        n_hidden = req.rules.n_hidden if req.rules is not None and req.error is None else 0
        if n_hidden and req.rules is not None and req.rules.hidden_on_device:
            req.hidden = self.runner.copy_hidden(req, n_hidden)  # no download: the row is answered now
            ended.append(req)
        elif n_hidden:
            self.runner.fetch_hidden(req, n_hidden)
            req.status = Status.FETCHING
            self._completing.append(req)
        else:
            ended.append(req)
        self.scheduler.release(req, retire)

    def _drain(self) -> list[Request]:
        """The completing rows' hidden rows when no iteration follows to carry them: a wait of its own."""
        fetches, self.runner._fetches = self.runner._fetches, []
        if self.runner.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        ended: list[Request] = []
        self._arrived(fetches, ended)
        return ended

    def _arrived(self, fetches: list[tuple[Request, torch.Tensor]], ended: list[Request]) -> None:
        """Rows finished an iteration ago: their hidden rows are on the host now."""
        for req, host in fetches:
            req.hidden = host.float().numpy().copy()
            req.status = Status.FINISHED
            self._completing.remove(req)
            ended.append(req)

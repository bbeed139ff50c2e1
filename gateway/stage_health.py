"""Health that tells the truth: the gateway watches every stage, not only Triton's word for its entry model.

Every `health_period_s`:
- liveness: Triton's server-live and each model's readiness (its HTTP/gRPC front end answers these itself: a
  stopped or hung Triton answers nothing);
- one probe per stage model (a request its Python stub must answer: a no-op START+END for the stateful stages, a
  tenth of a second of silence for the audio encoder, no images for the vision encoder, an empty START+END step
  for the entry model). A stub killed under the server (the OOM killer's first pick) answers an error while
  Triton still calls the model ready.

Verdicts (`Verdict`, pure): `ready`; `loading` (models not ready yet); `unresponsive` (no liveness answer for
`health_timeout_s`); `broken` (a probe answered an error two rounds in a row, or none answered for
`step_timeout_s`; probes merely slow behind real work change nothing before that). Unless ready,
/health says not ready; on broken every live session is told `backend_unavailable` (retryable) and ended, once,
and the gateway heals, once until the backend is ready again: it reloads the failing stages' models through
Triton's model control API (gateway/triton/reload.py; any gateway may, Triton in explicit mode); when that is
refused, or no probe answered at all, a gateway that owns Triton restarts it (`owned`: gateway.serve kills
Triton's process group, and its supervisor starts a new one); one that does not says why on /health.
A silent server (unresponsive) is only reported here:
its sessions are ended by the one silence detector, the endpoint pool's failover (gateway/triton/pool.py,
`failover_s`), not told a second time by this watch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import aio as grpcaio

from minicpmo_triton.duplex_contract import StepInput
from minicpmo_triton.stage_io import (
    DECOUPLED_STAGES,
    AudioEncoderRequest,
    LlmRequest,
    Token2WavRequest,
    TtsRequest,
    VisionEncoderRequest,
    encode,
)

from .triton.decoupled import infer_decoupled
from .triton.reload import ReloadRefused, reload_models
from .triton.stream import ENTRY_MODEL, TritonStream, next_correlation_id

log = logging.getLogger("gateway.health")

STATEFUL_PROBES: dict[str, LlmRequest | TtsRequest | Token2WavRequest] = {
    "llm": LlmRequest(decode=False), "tts": TtsRequest(n_tokens=0), "token2wav": Token2WavRequest()}
STATELESS_PROBES: dict[str, AudioEncoderRequest | VisionEncoderRequest] = {
    "audio_encoder": AudioEncoderRequest(np.zeros(1600, np.float32)), "vision_encoder": VisionEncoderRequest()}
MODELS = (ENTRY_MODEL, *STATEFUL_PROBES, *STATELESS_PROBES)
_DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.bool_): "BOOL",
           np.dtype(np.object_): "BYTES"}


@dataclass(frozen=True)
class Report:
    """One round of checks: liveness answered (None: no answer in time), models ready, probe failures (stage ->
    why), probes all answered."""

    live: bool | None
    models_ready: bool = False
    failed: dict[str, str] = field(default_factory=dict)
    probes_answered: bool = False
    why: str = ""  # not live or not ready: what Triton said, or did not


@dataclass
class Verdict:
    """What the rounds so far say (pure: reports and times in, a state out)."""

    timeout_s: float  # no liveness answer this long: unresponsive
    hang_s: float  # no probe round answered this long while the models say ready: broken
    state: str = "loading"  # ready | loading | unresponsive | broken
    why: str = ""
    failed_rounds: int = 2  # a stage that fails this many rounds in a row is broken (one may be a fluke)
    _last_live: float = field(default_factory=time.monotonic)
    _last_probed: float = field(default_factory=time.monotonic)
    _failing: int = 0

    def observe(self, report: Report, now: float) -> str:
        if report.live:
            self._last_live = now
        if not report.models_ready or not report.live:
            self._last_probed = now  # the hang clock runs only while the models claim to be ready
        elif report.probes_answered and not report.failed:
            self._last_probed = now
        self._failing = self._failing + 1 if report.failed else 0
        if self._failing >= self.failed_rounds:
            self.state, self.why = "broken", "; ".join(f"{m}: {why}" for m, why in sorted(report.failed.items()))
        elif now - self._last_probed > self.hang_s:
            self.state, self.why = "broken", f"no stage probe answered for {self.hang_s:.0f} s"
        elif now - self._last_live > self.timeout_s:
            self.state, self.why = "unresponsive", f"Triton does not answer (nothing for {self.timeout_s:.0f} s)"
        elif report.live and report.models_ready and report.probes_answered:
            self.state, self.why = "ready", ""
        elif report.live and report.models_ready:
            pass  # probes still queued behind real work (a busy server): the state stands until the hang bound
        elif report.live is not None:
            self.state, self.why = "loading", report.why
        return self.state


def _inputs(request: Any) -> list[grpcclient.InferInput]:
    out = []
    for name, value in encode(request).items():
        if value.size == 0 and not isinstance(request, VisionEncoderRequest):
            continue  # optional: the stage's default
        arr = value[None]
        t = grpcclient.InferInput(name, list(arr.shape), _DTYPES[arr.dtype])
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


async def _probe(client: grpcaio.InferenceServerClient, url: str, model: str) -> None:
    """One request the model's stub must answer; raises what it answered instead."""
    if model == ENTRY_MODEL:
        session = TritonStream(url)
        await session.open()
        try:
            async for event in session.step(StepInput(), end=True):
                if event.kind == "error":
                    raise RuntimeError(f"{event.code}: {event.message}")
        finally:
            await session.close()  # its own START+END step ended the sequence
    elif model in STATEFUL_PROBES:
        sequence = {"sequence_id": next_correlation_id(), "sequence_start": True, "sequence_end": True}
        if model in DECOUPLED_STAGES:
            await infer_decoupled(client, model, _inputs(STATEFUL_PROBES[model]), **sequence)
        else:
            await client.infer(model, _inputs(STATEFUL_PROBES[model]), **sequence)
    else:
        await client.infer(model, _inputs(STATELESS_PROBES[model]))


async def check(client: grpcaio.InferenceServerClient, url: str, timeout_s: float) -> Report:
    """One round: liveness and readiness, then (when ready) every stage's probe, each bounded by `timeout_s`."""
    async def readiness() -> tuple[bool, bool]:
        live = bool(await client.is_server_live())
        return live, live and all(await asyncio.gather(*(client.is_model_ready(m) for m in MODELS)))

    try:
        live, ready = await asyncio.wait_for(readiness(), timeout_s)
    except TimeoutError:
        return Report(live=None)
    except Exception as exc:  # noqa: BLE001 (refused, reset: Triton is not up)
        return Report(live=False, why=f"Triton at {url} does not answer ({type(exc).__name__})")
    if not ready:
        return Report(live=live, why="the models are not ready (still loading, or failed to load)")
    failed: dict[str, str] = {}

    async def probe(model: str) -> None:
        try:
            await _probe(client, url, model)
        except Exception as exc:  # noqa: BLE001 (any answer but success is the stage's failure)
            failed[model] = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__

    try:
        await asyncio.wait_for(asyncio.gather(*(probe(m) for m in MODELS)), timeout_s)
    except TimeoutError:
        return Report(live=True, models_ready=True, failed=failed, probes_answered=False)
    return Report(live=True, models_ready=True, failed=failed, probes_answered=True)


class OwnedTriton(Protocol):
    """A Triton this gateway started (gateway.triton.launcher.TritonServer)."""

    def kill(self) -> None: ...  # its supervisor starts a new one

    def note_regions(self) -> None: ...  # its stubs' shared memory, unlinked when it is reaped


class StageHealth:
    """The watch loop: rounds of `check`, the verdict, and what follows from it."""

    def __init__(self, url: str, period_s: float, timeout_s: float, hang_s: float,
                 on_change: Callable[[str, str], None], tell_sessions: Callable[[], None],
                 owned: OwnedTriton | None = None, reloads_before_restart: int = 3, control_key: str = "",
                 on_heal: Callable[[str], None] = lambda action: None) -> None:
        self.url = url
        self.on_heal = on_heal  # told "reload" per model reloaded, "restart" per Triton restarted (the metrics)
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.verdict = Verdict(timeout_s, hang_s)
        self.on_change = on_change
        self.tell_sessions = tell_sessions
        self.owned = owned
        self.control_key = control_key
        # Triton 2.51's Python backend never frees a reloaded model's old instance once a request has failed on its
        # dead stub (the stub a zombie, its shared-memory region mapped): past this many, a Triton the gateway owns
        # is restarted whole, which frees them all
        self.reloads_before_restart = reloads_before_restart
        self.reloads = 0
        self._rounds_began: deque[float] = deque([0.0], maxlen=self.verdict.failed_rounds)  # Unix times
        self._told = False
        self._healed = False

    def apply(self, report: Report, now: float) -> bool:
        """Observe one round; True when the backend is to be healed now (once per episode of brokenness)."""
        state = self.verdict.observe(report, now)
        self.on_change(state, self.verdict.why)  # the registry logs each change, with why
        if report.live is False:
            self.reloads = 0  # Triton is down: the one that comes next holds no old instances
        if state == "ready":
            self._told = self._healed = False
            return False
        if state == "broken" and not self._told:  # silence (unresponsive) is the pool's failover's to tell
            self._told = True
            self.tell_sessions()
        if state == "broken" and not self._healed:
            self._healed = True
            return True
        return False

    async def heal(self, client: grpcaio.InferenceServerClient, failed: list[str]) -> None:
        """Reload the failing stages' models; when Triton refuses (or nothing answered: no stage to name), restart
        Triton if this gateway owns it, else say on /health that someone must."""
        why = f"no stage named ({self.verdict.why})"
        if self.owned is not None and self.reloads >= self.reloads_before_restart:
            why, failed = f"{self.reloads} reloads left their dead stubs' memory mapped", []
        if failed:
            try:
                reloaded = await reload_models(client, self.url, failed, self._rounds_began[0], self.control_key)
                self.reloads += len(reloaded)
                for _ in reloaded:
                    self.on_heal("reload")
                if self.owned is not None:
                    self.owned.note_regions()  # the new stubs' too: reaped with the server
                log.warning("endpoint %s: %s", self.url, f"reloaded {', '.join(reloaded)}" if reloaded
                            else f"{', '.join(failed)} reloaded by another gateway meanwhile")
                return
            except ReloadRefused as exc:
                why = str(exc)
        if self.owned is not None:
            log.error("a stage is broken (%s) and is not reloaded (%s): restarting Triton", self.verdict.why, why)
            self.reloads = 0
            self.on_heal("restart")
            self.owned.kill()
        else:
            self.verdict.why += f"; not healed: {why} (restart this Triton, or start it in explicit model control mode)"
            self.on_change(self.verdict.state, self.verdict.why)
            log.error("endpoint %s: a stage is broken and this gateway cannot heal it: %s", self.url, why)

    async def watch(self) -> None:
        client = grpcaio.InferenceServerClient(self.url)
        try:
            while True:
                self._rounds_began.append(time.time())  # the evidence of a broken verdict: its failing rounds
                report = await check(client, self.url, self.timeout_s)
                if self.apply(report, time.monotonic()):
                    await self.heal(client, sorted(report.failed))
                await asyncio.sleep(self.period_s)
        finally:
            await client.close()

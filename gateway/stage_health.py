"""Health that tells the truth: the gateway watches every stage, not only Triton's word for its entry model.

Every `health_period_s`:
- liveness: Triton's server-live and each model's readiness (its HTTP/gRPC front end answers these itself: a
  stopped or hung Triton answers nothing);
- one probe per stage model, a request its Python stub must answer, which tells a dead stage from a busy one:
  the stateful stages (`llm`, `tts`, `token2wav`) get a reserved probe request (`stage_io.PROBE`) that their model
  answers before any stage work or admission (a full KV pool refuses a new session `pool_full`: a busy stage, not a
  dead one), the audio encoder a tenth of a second of silence, the vision encoder no images, the entry model an
  empty START+END step (which starts no stage). A stub killed under the server (the OOM killer's first pick)
  answers an error while Triton still calls the model ready. An answer that is a retryable refusal (`pool_full`,
  `queue_full`) is an answer: never a failure.

Verdicts (`Verdict`, pure): `ready`; `loading` (models not ready yet, or a probe failed once: no new sessions,
nothing healed yet); `unresponsive` (no liveness answer for
`health_timeout_s`); `broken` (a probe answered an error two rounds in a row, or none answered for
`step_timeout_s`; probes merely slow behind real work change nothing before that). Unless ready, /health says not
ready; on broken the gateway heals the endpoint, one attempt at a time with deadlines, until it is ready
(gateway/healing.py, pure: reload the failing stages' models through Triton's model control API,
gateway/triton/reload.py; restart a Triton this gateway owns; say on /health why it is not healed), telling the
endpoint's live sessions `backend_unavailable` (retryable) as each attempt begins, unless only the stateless
encoders failed (their reload loses no session's state). A silent server (unresponsive)
is only reported here: its sessions are ended by the one silence detector, the endpoint pool's failover
(gateway/triton/pool.py, `failover_s`), not told a second time by this watch. A round that fails is logged and the
next one comes: the watch does not die.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from tritonclient.grpc import aio as grpcaio

from minicpmo_triton.duplex_contract import StepInput
from minicpmo_triton.errors import ADMISSION_REFUSALS, Code, describe, from_wire
from minicpmo_triton.stage_io import PROBE, AudioEncoderRequest, VisionEncoderRequest

from .healing import Cancel, Effect, Healer, Reload, Restart, TellSessions
from .triton.decoupled import stage_inputs
from .triton.reload import ReloadRefused, reload_models
from .triton.stream import ENTRY_MODEL, TritonStream, next_correlation_id

log = logging.getLogger("gateway.health")

STATEFUL = ("llm", "tts", "token2wav")  # probed with the reserved probe request, answered before any stage work
STATELESS_PROBES: dict[str, AudioEncoderRequest | VisionEncoderRequest] = {
    "audio_encoder": AudioEncoderRequest(np.zeros(1600, np.float32)), "vision_encoder": VisionEncoderRequest()}
MODELS = (ENTRY_MODEL, *STATEFUL, *STATELESS_PROBES)


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
        elif report.live and report.models_ready and report.probes_answered and not report.failed:
            self.state, self.why = "ready", ""
        elif report.live and report.models_ready:
            # probes still queued behind real work (a busy server): the state stands until the hang bound; a probe
            # that failed once (a fluke, or a stage that died: the next round says) is not ready either
            if report.failed and self.state == "ready":
                self.state, self.why = "loading", "; ".join(f"{m}: {w}" for m, w in sorted(report.failed.items()))
        elif report.live is not None:
            self.state, self.why = "loading", report.why
        return self.state


async def _probe_stub(client: grpcaio.InferenceServerClient, model: str) -> None:
    """The reserved probe to a stateful stage (decoupled: on a stream), a sequence of its own that starts and ends
    in it: its model answers it before any stage work (no state made, no room asked of a pool)."""
    async def one() -> Any:
        yield {"model_name": model, "inputs": [], "sequence_id": next_correlation_id(), "sequence_start": True,
               "sequence_end": True, "enable_empty_final_response": True, "parameters": {PROBE: True}}

    async for result, error in client.stream_infer(one()):
        if error is not None:
            raise error
        if result.get_response().parameters["triton_final_response"].bool_param:
            return


async def _probe(client: grpcaio.InferenceServerClient, url: str, model: str) -> None:
    """One request the model's stub must answer; raises what it answered instead."""
    if model == ENTRY_MODEL:
        session = TritonStream(url)
        await session.open()
        try:
            async for event in session.step(StepInput(), end=True):
                if event.kind == "error":
                    raise RuntimeError(f"[{event.code or Code.STAGE_ERROR}] {event.message}")
        finally:
            await session.close()  # its own START+END step ended the sequence
    elif model in STATEFUL:
        await _probe_stub(client, model)
    else:
        await client.infer(model, stage_inputs(STATELESS_PROBES[model]))


def failure(exc: Exception) -> str | None:
    """What a probe's error says of its stage: None when it is an answer after all (a retryable refusal, such as a
    full KV pool's `pool_full`: the stage is alive and busy), else why it failed (a line, bounded)."""
    message = str(exc)
    if from_wire(message.strip(), "probe").code in ADMISSION_REFUSALS:
        return None
    return message.splitlines()[0][:200] if message else type(exc).__name__


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
        except Exception as exc:  # noqa: BLE001 (any answer but success or a retryable refusal is the stage's failure)
            if (why := failure(exc)) is not None:
                failed[model] = why

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
    """The watch loop (the I/O around `Verdict` and `Healer`): rounds of `check`, the verdict, and the healing
    effects carried out. `on_change(state, why)` is told every round (the registry logs each change); `why` says
    what the healing does or why it has not healed."""

    def __init__(self, url: str, period_s: float, timeout_s: float, hang_s: float,
                 on_change: Callable[[str, str], None], tell_sessions: Callable[[], None],
                 owned: OwnedTriton | None = None, reloads_before_restart: int = 3, control_key: str = "",
                 deadline_s: float = 180.0, on_heal: Callable[[str], None] = lambda action: None) -> None:
        self.url = url
        self.on_heal = on_heal  # told "reload" per model reloaded, "restart" per Triton restarted (the metrics)
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.verdict = Verdict(timeout_s, hang_s)
        self.healer = Healer(deadline_s, owned is not None, reloads_before_restart, self.verdict.failed_rounds,
                             stateless=frozenset(STATELESS_PROBES))
        self.on_change = on_change
        self.tell_sessions = tell_sessions
        self.owned = owned
        self.control_key = control_key
        self.rounds = 0
        self._reload: asyncio.Task[None] | None = None

    @property
    def why(self) -> str:
        return "; ".join(w for w in (self.verdict.why, self.healer.why) if w)

    def apply(self, report: Report, began: float, now: float) -> list[Effect]:
        """Observe one round (begun at `began`, monotonic); what follows from it."""
        state = self.verdict.observe(report, now)
        effects = self.healer.observe(state, report.failed, began, now, report.live)
        self.on_change(state, self.why)
        return effects

    def carry_out(self, effects: list[Effect], client: grpcaio.InferenceServerClient) -> None:
        for effect in effects:
            if isinstance(effect, TellSessions):
                self.tell_sessions()
            elif isinstance(effect, Reload):
                since = time.time() - (time.monotonic() - effect.since)  # the evidence's start, as a Unix time
                self._reload = asyncio.get_running_loop().create_task(self._reloading(client, effect.models, since))
            elif isinstance(effect, Restart):
                assert self.owned is not None
                log.error("endpoint %s: a stage is broken (%s) and is not reloaded (%s): restarting Triton", self.url,
                          self.verdict.why, effect.why)
                self.on_heal("restart")
                self.owned.kill()
            elif isinstance(effect, Cancel) and self._reload is not None:
                log.error("endpoint %s: %s", self.url, self.healer.why)
                self._reload.cancel()

    async def _reloading(self, client: grpcaio.InferenceServerClient, models: tuple[str, ...], since: float) -> None:
        """A Reload effect: its end goes back to the healer (a cancel, at its deadline, was the healer's own)."""
        try:
            reloaded = await reload_models(client, self.url, list(models), since, self.control_key)
        except ReloadRefused as exc:
            effects = self.healer.ended(time.monotonic(), refused=str(exc))
            log.error("endpoint %s: %s", self.url, self.healer.why or str(exc))
        except Exception as exc:  # noqa: BLE001 (the lock, the client: the attempt failed, the healing goes on)
            effects = self.healer.ended(time.monotonic(), refused=f"the reload failed: {describe(exc)}")
            log.error("endpoint %s: %s", self.url, self.healer.why)
        else:
            effects = self.healer.ended(time.monotonic(), reloaded=reloaded)
            for _ in reloaded:
                self.on_heal("reload")
            if self.owned is not None:
                self.owned.note_regions()  # the new stubs' too: reaped with the server
            log.warning("endpoint %s: %s", self.url, f"reloaded {', '.join(reloaded)}" if reloaded
                        else f"{', '.join(models)} reloaded by another gateway meanwhile")
        self.on_change(self.verdict.state, self.why)
        self.carry_out(effects, client)

    async def round(self, client: grpcaio.InferenceServerClient) -> None:
        began = time.monotonic()
        report = await check(client, self.url, self.timeout_s)
        self.rounds += 1
        self.carry_out(self.apply(report, began, time.monotonic()), client)

    async def watch(self) -> None:
        client = grpcaio.InferenceServerClient(self.url)
        try:
            while True:
                try:
                    await self.round(client)
                except Exception as exc:  # noqa: BLE001 (logged; the next round comes: the watch never dies)
                    log.error("endpoint %s: a health round failed: %s", self.url, describe(exc))
                await asyncio.sleep(self.period_s)
        finally:
            if self._reload is not None:
                self._reload.cancel()
            await client.close()

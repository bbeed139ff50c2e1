"""The Triton Python-backend models. Each `model_repository/<name>/1/model.py` imports one of these.

Stateful stages read the sequence batcher's START / END / CORRID controls, run one batched compute
over every request of an `execute()`, and publish their live sequence count as the
`minicpmo_<model>_live_sequences` gauge on Triton's metrics port: every series of a model is named
`minicpmo_<model>_<what>` (`stage_metric`; docs/deploy.md, "Metrics").
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import duplex_contract as contract
from ..duplex_contract import StepEvent
from ..engine.exported import Engine, OnnxEngine, gpu_available, load_engine
from ..engine.memory_plan import POOLS, MemoryPlan, plan_pools, repository_stages
from ..engine.protocol import pick_engine, token2wav_in_llm, token2wav_on_device, tts_in_llm
from ..engine.stage_engine import Placement, Probe, place
from ..errors import Code, StepError, describe, to_wire
from ..media.tokenizer import load_tokenizer
from ..model_config import load_stage_config
from ..stage_io import PROBE, SPEECH_CALL, STAGE_IO, Token2WavRequest, TtsRequest, decode, encode
from ..stages.audio_encoder import AudioEncoderStage, AudioStreamEncoder, StreamKv
from ..stages.base import SequenceStage, StageCall, answer_order
from ..stages.kv import StageKv
from ..stages.llm import LlmStage
from ..stages.state_store import SequenceNotStarted, SequenceStore
from ..stages.token2wav import Token2WavStage, VoicePrompts
from ..stages.tts import TtsStage, with_tts_sampling
from ..stages.vision_encoder import VisionEncoderStage
from ..stages.voice_prep import VoicePreparer, as_bulk
from ..stages.voice_prompt import VoiceLibrary, default_ref_audio
from . import tracing
from .bls import TritonBlsStages
from .pipeline import DuplexPipeline
from .rendezvous import BatchWindow
from .stage_settings import stage_setting

if TYPE_CHECKING:  # torch: imported only where the device engine is built
    from ..media.tokenizer import Tokenizer
    from ..stages.inflight import InflightLoop
    from ..stages.speaker import Speaker
    from ..stages.token2wav_inflight import InflightToken2Wav
    from ..stages.token2wav_local import LocalToken2Wav

_FAMILIES: dict[str, Any] = {}  # kept for the stub's life: a Metric must not outlive its family


def stage_metric(model: str, what: str, description: str, counter: bool = False, **labels: str) -> Any:
    """One series of a model on Triton's metrics port, named `minicpmo_<model>_<what>` (a counter's `what` ends in
    `_total`); Triton writes its `# HELP` and `# TYPE`."""
    name = f"minicpmo_{model}_{what}"
    if name not in _FAMILIES:
        kind = pb_utils.MetricFamily.COUNTER if counter else pb_utils.MetricFamily.GAUGE
        _FAMILIES[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind)
    return _FAMILIES[name].Metric(labels=labels)


class _ModelContext:
    """What initialize() gets, made convenient: names, folder, parameters, metrics."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.config = json.loads(args["model_config"])
        self.name: str = args["model_name"]
        self.version_dir = Path(args["model_repository"]) / args["model_version"]
        self.params = {k: v["string_value"] for k, v in self.config.get("parameters", {}).items()}
        self.preset = load_stage_config(self.version_dir)
        self.kind: str = args.get("model_instance_kind", "CPU")  # GPU for a KIND_GPU instance
        self.device_id = int(args.get("model_instance_device_id", 0) or 0)

    def setting(self, key: str) -> Any:
        """MINICPMO_<KEY>, else this model's config.pbtxt parameter, else the default (`stage_settings`)."""
        return stage_setting(key, self.params)

    @functools.cached_property
    def memory_plan(self) -> MemoryPlan:
        """This instance's device shared out (`engine.memory_plan`): every stage's weights and workspace, then the
        pools; the same for every model on the device, whatever order they load in."""
        import torch

        from ..engine.pool import device_memory  # torch: only a model that builds a pool asks

        device = _device(self)
        cuda = device != "cpu"
        stage_engine = self.setting("stage_engine")
        tts_here = _runs_tts_in_llm(self)
        on_device = {name for name, on in (
            ("llm", pick_engine(self.setting("llm_engine"), cuda) == "paged"),
            ("whisper", pick_engine(self.setting("audio_engine"), cuda, "audio_engine") == "paged"),
            ("tts", tts_here or pick_engine(self.setting("tts_engine"), cuda, "tts_engine") == "paged"),
            ("token2wav", token2wav_on_device(stage_engine, cuda)),
            ("audio_encoder", cuda and stage_engine != "onnx"),
            ("vision_encoder", cuda and stage_engine != "onnx")) if on}
        stages = repository_stages(self.version_dir.parent.parent, self.preset, on_device, self.setting("engine_rows"),
                                   2 if cuda else 4, cuda, tts_here)
        return plan_pools(device_memory(torch.device(device)), stages,
                          {pool: self.setting(key) for pool, key in POOLS.items()})

    def placement(self, plans: bool) -> Placement:
        """Where this model runs (`stage_engine`); a GPU it was given and cannot reach fails its load, with the
        coded reason Triton keeps for it (and the gateway's /health shows)."""
        try:
            return place(self.name, self.setting("stage_engine"), Probe.machine(self.kind, self.device_id), plans)
        except StepError as exc:
            raise RuntimeError(to_wire(exc)) from exc


class _DeviceGauge:
    """Publishes where a model runs: `minicpmo_<model>_device{device} 1` on Triton's metrics port (/health)."""

    def __init__(self, model: str, device: str) -> None:
        self._metric = stage_metric(model, "device", "Where this model runs (1, labelled with the device)",
                                    device=device)
        self._metric.set(1)


class _LiveGauge:
    """Publishes a store's size (and evictions) and sweeps idle state on a timer thread."""

    def __init__(self, model: str, store: SequenceStore[Any], period_s: float, evicts: bool = True,
                 counted: Callable[[], dict[str, int]] = dict) -> None:
        self._gauge = stage_metric(model, "live_sequences", "Live per-session state entries")
        self._evicted = stage_metric(model, "evicted_sequences_total", "Session states evicted after the idle TTL",
                                     counter=True)
        self._counted = counted  # the stage's own running counts, by name: published as counters
        self._counters: dict[str, Any] = {}
        self._reported_counts: dict[str, int] = {}
        self._model = model
        self._store = store
        self._reported_evictions = 0
        self._reported_live = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sweep, args=(period_s,), daemon=True)
        if evicts:  # else the stage's own engine thread evicts (and calls `update`)
            self._thread.start()

    def update(self) -> None:
        # Each set is a round trip to the server process: only a changed count is sent.
        live = len(self._store)
        if live != self._reported_live:
            self._gauge.set(live)
            self._reported_live = live
        new = self._store.evicted_total - self._reported_evictions
        if new:
            self._evicted.increment(new)
            self._reported_evictions += new
        for name, count in self._counted().items():
            if name not in self._counters:
                help_text = f"{name.replace('_', ' ').capitalize()} (the {self._model} stage's own count)"
                self._counters[name] = stage_metric(self._model, f"{name}_total", help_text, counter=True)
            if new := count - self._reported_counts.get(name, 0):
                self._counters[name].increment(new)
                self._reported_counts[name] = count

    def _sweep(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            if self._store.evict_expired():
                pb_utils.Logger.log_warn(f"evicted idle sequences; {len(self._store)} live")
            self.update()

    def close(self) -> None:
        self._stop.set()


def _rows(request: Any) -> dict[str, np.ndarray]:
    """A request's inputs by name, batch row 0 (one pass: looking each up by name scans them all)."""
    return {t.name(): t.as_numpy()[0] for t in request.inputs()}


def _is_probe(request: Any) -> bool:
    """The gateway's liveness probe (`stage_io.PROBE`, a request parameter)."""
    return PROBE in json.loads(request.parameters() or "{}")


def _is_speech_call(request: Any) -> bool:
    """A TTS call to the llm model (`stage_io.SPEECH_CALL`, a request parameter; `tts_in_llm`)."""
    return SPEECH_CALL in json.loads(request.parameters() or "{}")


def _control(request: Any, rows: dict[str, np.ndarray]) -> tuple[int, bool, bool]:
    corr, start, end = rows.get("CORRID"), rows.get("START"), rows.get("END")
    corr_id = int(corr.reshape(-1)[0]) if corr is not None else int(request.correlation_id())
    return corr_id, bool(start is not None and start.reshape(-1)[0]), bool(end is not None and end.reshape(-1)[0])


def _response(result: Any, model: str) -> Any:
    if isinstance(result, Exception):
        if not isinstance(result, StepError):  # a bug (or a stage's state gone): the operator sees its type and place
            pb_utils.Logger.log_error(f"{model}: a row failed with an uncoded error: {describe(result)}")
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(to_wire(result)))  # its code rides along
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v[None]) for k, v in encode(result).items()])


class _StatefulStageModel:
    """Base for llm / tts / token2wav: `make_stage` builds the stage from the exported artefacts."""

    stage_name = ""

    def make_stage(self, ctx: _ModelContext) -> SequenceStage[Any, Any, Any]:
        raise NotImplementedError

    def initialize(self, args: dict[str, Any]) -> None:
        self.load(_ModelContext(args))

    def load(self, ctx: _ModelContext) -> None:
        """The stage and its gauges, from one context (its memory plan made once for every pool it sizes)."""
        self.stage = self.make_stage(ctx)
        self.request_cls = STAGE_IO[self.stage_name][0]
        self.gauge = _LiveGauge(ctx.name, self.stage.store, ctx.setting("sweep_period_s"), counted=self.stage.counted)
        self.device_gauge = _DeviceGauge(ctx.name, self.device_label(ctx))

    def device_label(self, ctx: _ModelContext) -> str:
        """Where the model runs, for /health (the models that choose, by `stage_engine`, say so)."""
        return _device(ctx)

    def execute(self, requests: list[Any]) -> list[Any] | None:  # None: a decoupled model answers by its senders
        results = self.stage.run(self._calls(requests))
        self.gauge.update()
        return [_response(r, self.stage_name) for r in results]

    def _calls(self, requests: list[Any]) -> list[StageCall[Any]]:
        calls: list[StageCall[Any]] = []
        for request in requests:
            rows = _rows(request)
            calls.append(StageCall(decode(self.request_cls, rows.get), *_control(request, rows)))
        return calls

    def _answer_probes(self, requests: list[Any]) -> list[Any]:
        """Liveness probes answered at once with an empty final response, before any stage work or admission (the
        stub is alive; a full KV pool, which would refuse a new sequence, is a busy stage, not a dead one); the
        other requests, in order."""
        rest = []
        for request in requests:
            if not _is_probe(request):
                rest.append(request)
                continue
            try:
                request.get_response_sender().send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # noqa: BLE001 (a prober gone: nothing to do)
                pb_utils.Logger.log_warn(f"{self.stage_name}: a probe not answered: {describe(exc)}")
        return rest

    def stand_aside(self, ctx: _ModelContext, where: str) -> None:
        """A model whose stage the llm model runs (tts_in_llm, token2wav_in_llm), where every use of it goes: it loads
        nothing (no weights, no pool) and refuses work (`_refuse_moved`); its live-sequence gauge stays at 0 for the
        probes, and /health reads `where` the stage runs."""
        self.gauge = _LiveGauge(ctx.name, SequenceStore(_ttl(ctx)), ctx.setting("sweep_period_s"))
        self.device_gauge = _DeviceGauge(ctx.name, where)

    def _refuse_moved(self, requests: list[Any], why: str) -> None:
        """A model whose stage the llm model runs (tts_in_llm, token2wav_in_llm): probes answered, calls refused."""
        for request in self._answer_probes(requests):
            corr_id, _, _ = _control(request, _rows(request))
            self._send(request.get_response_sender(), corr_id, StepError(Code.STAGE_ERROR, why))

    def _send(self, sender: Any, corr_id: int, result: Any, final: bool = True) -> None:
        """A decoupled model's answer to a call: its one response, with the final flag (or a first of two)."""
        try:
            sender.send(_response(result, self.stage_name),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
        except Exception as exc:  # noqa: BLE001 (a caller gone must not stop the thread that answers)
            pb_utils.Logger.log_warn(f"{self.stage_name}: sequence {corr_id}: response not delivered: {describe(exc)}")

    def finalize(self) -> None:
        self.gauge.close()


def _ttl(ctx: _ModelContext) -> float:
    return float(ctx.setting("state_ttl_s"))


def _threads(ctx: _ModelContext) -> int:
    return int(ctx.setting("ort_threads"))


class _InflightStageModel(_StatefulStageModel):
    """Decoupled (config.pbtxt): each request is answered through its response sender with the final flag. On the
    device engine, execute() only queues the calls for the engine thread's in-flight loop (`stages.inflight`), which
    answers each when its row is done; on ONNX it answers its batch before it returns, as a plain model would."""

    def _inflight(self, period_s: float, changed: Callable[[], None]) -> InflightLoop[Any, Any]:
        raise NotImplementedError

    def load(self, ctx: _ModelContext) -> None:
        self.stage = self.make_stage(ctx)
        self.request_cls = STAGE_IO[self.stage_name][0]
        period = ctx.setting("sweep_period_s")
        core = getattr(getattr(self.stage, "kv", None), "core", None)
        self.inflight: InflightLoop[Any, Any] | None = None
        self.gauge = _LiveGauge(ctx.name, self.stage.store, period, evicts=core is None, counted=self.stage.counted)
        self.device_gauge = _DeviceGauge(ctx.name, self.device_label(ctx))
        if core is not None:
            pool = core.runner.pool
            kv_free = stage_metric(ctx.name, "kv_free_blocks", "Free blocks in the device engine's KV pool")

            def changed() -> None:  # on the engine thread, after a call's admission or its answer
                self.gauge.update()
                kv_free.set(pool.free_blocks)

            changed()
            self.inflight = self._inflight(period, changed)

    def _reply(self, call: StageCall[Any], sender: Any) -> Callable[[Any], None]:
        """How the engine thread answers a call (the llm model's may answer twice: `stages.speaker`)."""
        return functools.partial(self._send, sender, call.corr_id)

    def execute(self, requests: list[Any]) -> None:
        requests = self._answer_probes(requests)
        calls = self._calls(requests)
        senders = [request.get_response_sender() for request in requests]
        if self.inflight is not None:
            for call, sender in zip(calls, senders, strict=True):
                self.inflight.submit(call, self._reply(call, sender))
            return None
        for group in answer_order(calls, self.stage.can_wait):
            for i, result in zip(group, self.stage.run([calls[i] for i in group]), strict=True):
                self._send(senders[i], calls[i].corr_id, result)
        self.gauge.update()
        return None

    def finalize(self) -> None:
        if self.inflight is not None:
            self.inflight.close()
        super().finalize()


class LlmModel(_InflightStageModel):
    stage_name = "llm"
    stage: LlmStage
    speaker: Speaker | None = None

    def _inflight(self, period_s: float, changed: Callable[[], None]) -> InflightLoop[Any, Any]:
        from ..stages.llm_inflight import InflightLlm  # torch, as the device engine

        return InflightLlm(self.stage, period_s, changed)

    def load(self, ctx: _ModelContext) -> None:
        super().load(ctx)
        if _runs_tts_in_llm(ctx):
            self.speaker = _speaker(ctx)
            self.stage.hidden_on_device = True  # a speaking call's hidden rows go to it on the device
        if self.inflight is not None:  # the device engine: its pools are the memory plan's
            self.plan_metrics = _publish_plan(ctx.name, ctx.memory_plan)

    def execute(self, requests: list[Any]) -> None:
        rest = []
        for request in requests:
            if _is_speech_call(request):
                self._speech(request)
            else:
                rest.append(request)
        return super().execute(rest)

    def _speech(self, request: Any) -> None:
        """A TTS call (`stage_io.SPEECH_CALL`): straight to the in-process TTS's thread, on the session's TTS sequence
        (the llm sequence's flags are not its own: a call that carries them is refused)."""
        rows = _rows(request)
        corr_id, start, end = _control(request, rows)
        send = functools.partial(self._send, request.get_response_sender(), corr_id)
        if self.speaker is None:
            send(StepError(Code.STAGE_ERROR, "this llm model runs no TTS (tts_in_llm is off): call the tts model"))
        elif start or end:
            send(StepError(Code.INVALID_INPUT, "a TTS call to the llm model carries no START or END"))
        else:
            # token2wav's call for its codes rides along (`token2wav_in_llm`; the speaker ignores it where it runs none)
            self.speaker.voice(StageCall(decode(TtsRequest, rows.get), corr_id), send,
                               decode(Token2WavRequest, rows.get))

    def _reply(self, call: StageCall[Any], sender: Any) -> Callable[[Any], None]:
        if self.speaker is None:
            return super()._reply(call, sender)
        return self.speaker.reply(call, functools.partial(self._send, sender, call.corr_id))

    def finalize(self) -> None:
        if self.speaker is not None:
            self.speaker.close()
        super().finalize()

    def make_stage(self, ctx: _ModelContext) -> LlmStage:
        models = ctx.version_dir.parent.parent
        tokenizer = load_tokenizer(ctx.preset, models / "duplex" / "1")
        # The step's audio is encoded here, in the LLM's batch: one BLS hop less per step.
        llm = _llm_kv(ctx, tokenizer)
        encoder = AudioStreamEncoder(_audio_stream_kv(ctx, models / "audio_encoder" / "1"), ctx.preset.audio,
                                     ctx.preset.samples_per_audio_token)
        return LlmStage(llm, ctx.preset, tokenizer, _ttl(ctx), encoder, ctx.setting("admit_tokens"))


def _audio_stream_kv(ctx: _ModelContext, folder: Path) -> Engine | StreamKv:
    """The duplex stream's Whisper: the stream.onnx graph, or the device encoder (its KV pool on the instance's
    device), as `audio_engine` says."""
    device = _device(ctx)
    if pick_engine(ctx.setting("audio_engine"), device != "cpu", "audio_engine") == "onnx":
        return load_engine(folder, _threads(ctx), "stream")
    from ..engine.whisper import load_paged_whisper  # torch

    return load_paged_whisper(folder, ctx.preset.audio, device, pool_bytes=ctx.memory_plan.pools["audio"],
                              compiled=_compiled(ctx))


def _device(ctx: _ModelContext) -> str:
    """The instance's GPU for a KIND_GPU instance where CUDA is, else the CPU."""
    return f"cuda:{ctx.device_id}" if ctx.kind == "GPU" and gpu_available() else "cpu"


def _compiled(ctx: _ModelContext) -> bool | None:
    """`engine_compile`: the device engines' layers and attention compiled (None: on CUDA); 0 turns it off."""
    return None if ctx.setting("engine_compile") else False


def _core_settings(ctx: _ModelContext) -> dict[str, Any]:
    """The engine core's settings: its batch rows, CUDA graphs, overlap, compiled layers."""
    return {"rows": ctx.setting("engine_rows"), "graphs": None if ctx.setting("engine_graphs") else False,
            "overlap": bool(ctx.setting("engine_overlap")), "compile_layers": _compiled(ctx)}


def _llm_kv(ctx: _ModelContext, tokenizer: Tokenizer) -> Engine | StageKv:
    """The exported ONNX graph with host caches, or the device engine: the KV pool and the token choice on the
    instance's device (its GPU for a KIND_GPU instance where CUDA is, else the CPU), as `llm_engine` says."""
    device = _device(ctx)
    if pick_engine(ctx.setting("llm_engine"), device != "cpu") == "onnx":
        from ..engine.exported import OnnxEngine

        return OnnxEngine(ctx.version_dir / "model.onnx", _threads(ctx))  # the LLM's host path: no TensorRT plan
    from ..stages.pool_kv import load_llm_kv  # torch

    return load_llm_kv(ctx.version_dir, ctx.preset, tokenizer, device, pool_bytes=ctx.memory_plan.pools["kv"],
                       kv_dtype=ctx.setting("kv_dtype"), **_core_settings(ctx))


MOVED_TTS = "in the llm model (tts_in_llm)"  # where the TTS runs when the llm model runs it (/health's devices)


class TtsModel(_InflightStageModel):
    stage_name = "tts"
    stage: TtsStage

    def _inflight(self, period_s: float, changed: Callable[[], None]) -> InflightLoop[Any, Any]:
        from ..stages.tts_inflight import InflightTts  # torch, as the device engine

        return InflightTts(self.stage, period_s, changed)

    def initialize(self, args: dict[str, Any]) -> None:
        ctx = _ModelContext(args)
        self.moved = _runs_tts_in_llm(ctx)
        if not self.moved:
            self.load(ctx)
            if self.inflight is not None:  # the device engine: its pool is the memory plan's
                self.plan_metrics = _publish_plan(ctx.name, ctx.memory_plan)
            return
        self.inflight = None
        self.stand_aside(ctx, MOVED_TTS)  # one TTS pool per GPU: the llm model's

    def execute(self, requests: list[Any]) -> None:
        if not self.moved:
            return super().execute(requests)
        self._refuse_moved(requests, "the TTS runs in the llm model here (tts_in_llm): its calls go there")
        return None

    def make_stage(self, ctx: _ModelContext) -> TtsStage:
        device = pick_engine(ctx.setting("tts_engine"), _device(ctx) != "cpu", "tts_engine") == "paged"
        return _tts_stage(ctx, ctx.version_dir, device)


def _tts_stage(ctx: _ModelContext, folder: Path, device_engine: bool) -> TtsStage:
    """The TTS stage over the artefacts in `folder`: ONNX, or the device TTS (its own KV pool on the instance's
    device)."""
    preset = with_tts_sampling(load_stage_config(folder), int(ctx.setting("tts_top_k")),
                               float(ctx.setting("tts_top_p")))
    if not device_engine:
        return TtsStage(load_engine(folder, _threads(ctx)), preset, _ttl(ctx))
    from ..stages.pool_kv import load_tts_kv  # torch
    from ..stages.tts import TURN_TOKENS

    kv = load_tts_kv(folder, preset, _device(ctx), pool_bytes=ctx.memory_plan.pools["tts"], max_tokens=TURN_TOKENS,
                     **_core_settings(ctx))
    return TtsStage(kv, preset, _ttl(ctx))


def _publish_plan(model: str, plan: MemoryPlan) -> list[Any]:
    """The memory plan in the load's log, and on Triton's metrics port as `minicpmo_<model>_memory_plan_bytes{item}`
    (the device's total, the margin, each stage's weights and workspace, each pool); its series, to be kept."""
    for line in plan.lines():
        pb_utils.Logger.log_info(f"{model}: {line}")
    items = {"total": plan.total, "margin": plan.margin, "budget": plan.budget,
             **{f"weights_{s.name}": s.weights for s in plan.stages},
             **{f"workspace_{s.name}": s.workspace for s in plan.stages},
             **{f"pool_{pool}": size for pool, size in plan.pools.items()}}
    metrics = []
    for item, value in items.items():
        metrics.append(stage_metric(model, "memory_plan_bytes", "The device's memory plan: its total, the margin, "
                                    "each stage's weights and workspace, each KV pool's bytes", item=item))
        metrics[-1].set(value)
    return metrics


def _runs_tts_in_llm(ctx: _ModelContext) -> bool:
    """`tts_in_llm` as the llm and tts models resolve it for their instance (the duplex model, for the machine)."""
    return tts_in_llm(ctx.setting("tts_in_llm"), ctx.setting("llm_engine"), ctx.setting("tts_engine"),
                      _device(ctx) != "cpu")


def _speaker(ctx: _ModelContext) -> Speaker:
    """`tts_in_llm`: the device TTS (../tts/1's artefacts) on its own engine thread in the llm model's process; its
    pool and sessions published as the llm model's `tts_kv_free_blocks` and `tts_live_sequences`."""
    from ..stages.speaker import Speaker
    from ..stages.tts_inflight import InflightTts  # torch

    stage = _tts_stage(ctx, ctx.version_dir.parent.parent / "tts" / "1", device_engine=True)
    live = stage_metric(ctx.name, "tts_live_sequences", "Live TTS sessions of the TTS run in this model (tts_in_llm)")
    free = stage_metric(ctx.name, "tts_kv_free_blocks", "Free blocks in the KV pool of the TTS run in this model")
    pool = stage.kv.core.runner.pool  # type: ignore[attr-defined] # the device TTS: a PoolKv

    def changed() -> None:  # on the TTS's engine thread, after a chunk's admission or its answer
        live.set(len(stage.store))
        free.set(pool.free_blocks)

    changed()
    vocoder = _local_token2wav(ctx) if _runs_token2wav_in_llm(ctx) else None
    return Speaker(InflightTts(stage, ctx.setting("sweep_period_s"), changed), vocoder)


MOVED_TOKEN2WAV = "in the llm model (token2wav_in_llm)"  # where token2wav runs when the llm model runs it (/health)


def _runs_token2wav_in_llm(ctx: _ModelContext) -> bool:
    """`token2wav_in_llm` as the llm and token2wav models resolve it for their instance (the duplex model, for the
    machine)."""
    return token2wav_in_llm(ctx.setting("token2wav_in_llm"), _runs_tts_in_llm(ctx),
                            token2wav_on_device(ctx.setting("stage_engine"), _device(ctx) != "cpu"))


def _token2wav_stage(ctx: _ModelContext, folder: Path, placement: Placement) -> Token2WavStage:
    """The token2wav stage over the artefacts in `folder`: its device streamer where `placement` is the device, else
    its host path (numpy + ONNX Runtime)."""
    streamer = None
    if placement.engine == "device":
        from ..stages.token2wav_device import DeviceStreamer, cache_dtype  # torch

        streamer = DeviceStreamer.load(folder, ctx.preset.token2wav, placement.device, ctx.setting("token2wav_slots"),
                                       cache_dtype(ctx.setting("token2wav_cache_dtype"), placement.device),
                                       _threads(ctx))
    return Token2WavStage.load(folder, ctx.preset, _ttl(ctx), _threads(ctx), ctx.setting("voice_prompt_cache_mb"),
                               streamer)


def _local_token2wav(ctx: _ModelContext) -> LocalToken2Wav:
    """`token2wav_in_llm`: token2wav (../token2wav/1's artefacts) in the llm model's process, placed by `stage_engine`
    as the token2wav model would be; its sessions published as the llm model's `token2wav_live_sequences`."""
    from ..stages.token2wav_local import LocalToken2Wav

    placement = ctx.placement(plans=False)
    stage = _token2wav_stage(ctx, ctx.version_dir.parent.parent / "token2wav" / "1", placement)
    live = stage_metric(ctx.name, "token2wav_live_sequences",
                        "Live token2wav sessions of the token2wav run in this model (token2wav_in_llm)")

    def changed() -> None:  # after a call's answer, on whichever thread gave it
        live.set(len(stage.store))

    changed()
    inflight = None
    if placement.engine == "device":
        from ..stages.token2wav_inflight import InflightToken2Wav  # torch

        inflight = InflightToken2Wav(stage, ctx.setting("sweep_period_s"), changed)
    return LocalToken2Wav(stage, inflight, ctx.setting("voice_prep_queue"), changed)


class _VoicePromptCounter:
    """Publishes how many voice prompts were computed and how many sessions reused one."""

    def __init__(self, prompts: VoicePrompts) -> None:
        self._metrics = {event: stage_metric("token2wav", "voice_prompts_total", "Voice prompts computed, and reused "
                                             "by a session", counter=True, event=event)
                         for event in ("computed", "reused")}
        self._prompts = prompts
        self._reported = {"computed": 0, "reused": 0}

    def update(self) -> None:
        for event, metric in self._metrics.items():
            new = getattr(self._prompts, event) - self._reported[event]
            if new:
                metric.increment(new)
                self._reported[event] += new


class Token2WavModel(_StatefulStageModel):
    """Decoupled (config.pbtxt): a call with a new voice reference is answered once its prompt is prepared on a
    worker of its own (`VoicePreparer`), after execute() has answered the other calls of its batch. On the device
    path (`stage_engine`) execute() only queues the calls for the engine thread's in-flight loop
    (`stages.token2wav_inflight`), which answers each when its last chunk is done."""

    stage_name = "token2wav"
    stage: Token2WavStage
    inflight: InflightToken2Wav | None = None
    voices: VoicePreparer | None = None  # None: the llm model runs token2wav (token2wav_in_llm)

    def make_stage(self, ctx: _ModelContext) -> Token2WavStage:
        stage = _token2wav_stage(ctx, ctx.version_dir, self.placement)
        self.voice_counter = _VoicePromptCounter(stage.prompts)
        return stage

    def initialize(self, args: dict[str, Any]) -> None:
        ctx = _ModelContext(args)
        if _runs_token2wav_in_llm(ctx):  # `voices` stays None: calls refused (`execute`)
            self.stand_aside(ctx, MOVED_TOKEN2WAV)
            return
        self.placement = ctx.placement(plans=False)  # first: a GPU out of reach refuses before anything loads
        self.stage = self.make_stage(ctx)
        self.request_cls = STAGE_IO[self.stage_name][0]
        period = ctx.setting("sweep_period_s")
        device = self.placement.engine == "device"
        self.gauge = _LiveGauge(ctx.name, self.stage.store, period, evicts=not device)  # else the engine thread
        if device:
            from ..stages.token2wav_inflight import InflightToken2Wav  # torch

            self.inflight = InflightToken2Wav(self.stage, period, self._counted)
        self.voices = VoicePreparer(self.stage, ctx.setting("voice_prep_queue"),
                                    submit=None if self.inflight is None else self.inflight.submit)
        self.device_gauge = _DeviceGauge(ctx.name, self.placement.label)

    def execute(self, requests: list[Any]) -> None:
        if self.voices is None:
            self._refuse_moved(requests, "token2wav runs in the llm model here (token2wav_in_llm): its calls go there")
            return None
        requests = self._answer_probes(requests)
        calls = self._calls(requests)
        answers = [functools.partial(self._send, request.get_response_sender(), call.corr_id)
                   for request, call in zip(requests, calls, strict=True)]
        self.voices.serve(calls, answers, after=self._counted)
        return None

    def _counted(self) -> None:
        self.gauge.update()
        self.voice_counter.update()

    def finalize(self) -> None:
        if self.voices is not None:
            self.voices.close()
        if self.inflight is not None:
            self.inflight.close()
        super().finalize()


class _StatelessStageModel:
    """Dynamic batching hands it the inputs of many sessions at once."""

    stage_name = ""

    def make_stage(self, ctx: _ModelContext) -> Any:
        raise NotImplementedError

    def initialize(self, args: dict[str, Any]) -> None:
        ctx = _ModelContext(args)
        self.placement = ctx.placement(plans=True)
        self.stage = self.make_stage(ctx)
        self.device_gauge = _DeviceGauge(ctx.name, self.placement.label)

    def execute(self, requests: list[Any]) -> list[Any]:
        calls: list[Any] = [decode(STAGE_IO[self.stage_name][0], _rows(r).get) for r in requests]
        return [_response(r, self.stage_name) for r in self.stage.run(calls)]


class AudioEncoderModel(_StatelessStageModel):
    """Whole utterances: voice references (a session's system prompt), a chat turn's audio. A call's steps never wait
    on it (the duplex stream's audio is encoded in the llm model): its stub runs as bulk work."""

    stage_name = "audio_encoder"

    def make_stage(self, ctx: _ModelContext) -> AudioEncoderStage:
        as_bulk(whole_process=True)
        return AudioEncoderStage(_encoder_engine(ctx, self.placement), ctx.preset.samples_per_audio_token)


class VisionEncoderModel(_StatelessStageModel):
    stage_name = "vision_encoder"

    def make_stage(self, ctx: _ModelContext) -> VisionEncoderStage:
        return VisionEncoderStage(_encoder_engine(ctx, self.placement), ctx.preset.vision)


def _encoder_engine(ctx: _ModelContext, placement: Placement) -> Engine:
    """An encoder's graph: its TensorRT bf16 plan on its GPU (built at its first load there, kept by hash:
    plan_cache.py), or ONNX Runtime on the CPU."""
    if placement.engine == "onnx":
        return OnnxEngine(ctx.version_dir / "model.onnx", _threads(ctx))
    import torch

    from ..engine.exported import TensorRTEngine
    from ..engine.plan_cache import cached_plan

    torch.cuda.set_device(placement.device)  # the plan binds on the current device
    max_batch = int(ctx.config["max_batch_size"])
    return TensorRTEngine(cached_plan(ctx.version_dir, "model", ctx.name, ctx.preset, max_batch))


def _event_response(event: StepEvent) -> Any:
    return pb_utils.InferenceResponse([pb_utils.Tensor(k, v[None]) for k, v in contract.encode_event(event).items()])


class DuplexModel:
    """The streaming entry model (BLS, decoupled): one request = one duplex step of one session.

    Responses stream as they are made (listen, text, audio), then the final flag. Requests of many
    sessions run concurrently on this instance's event loop, so the stages batch across sessions.
    """

    def initialize(self, args: dict[str, Any]) -> None:
        ctx = _ModelContext(args)
        tokenizer = load_tokenizer(ctx.preset, ctx.version_dir)
        window = BatchWindow(target=ctx.setting("llm_batch_target"),
                             max_s=ctx.setting("llm_batch_window_ms") / 1000,
                             min_sessions=ctx.setting("llm_batch_min_sessions"),
                             max_sessions=ctx.setting("llm_batch_max_sessions"),
                             budget_s=ctx.setting("llm_batch_budget_ms") / 1000)
        gather_s = ctx.setting("llm_gather_ms") / 1000
        # The door batches steps for an engine that runs a batch at a time (ONNX); the device engine batches in
        # flight (a step joins the running loop between iterations), where the door would only add its wait. As
        # the llm model decides it (`llm_engine`: its environment or the default, auto = the device engine where a
        # GPU is), the door stands aside.
        if pick_engine(ctx.setting("llm_engine"), gpu_available()) == "paged":
            gather_s, window = 0.0, BatchWindow()
        # ... and where it runs the TTS too (`tts_in_llm`), a speaking step is one llm request: text, then codes.
        speaks = tts_in_llm(ctx.setting("tts_in_llm"), ctx.setting("llm_engine"), ctx.setting("tts_engine"),
                            gpu_available())
        # ... and where it runs token2wav too (`token2wav_in_llm`), its second response is the step's audio
        voiced = token2wav_in_llm(ctx.setting("token2wav_in_llm"), speaks,
                                  token2wav_on_device(ctx.setting("stage_engine"), gpu_available()))
        voices_dir = ctx.setting("voices_dir")  # MINICPMO_VOICES_DIR overrides it, as any MINICPMO_<KEY>
        self.stages = TritonBlsStages(voiced)
        self.pipeline = DuplexPipeline(self.stages, ctx.preset, tokenizer, _ttl(ctx),
                                       llm_gather_s=gather_s, batch_window=window,
                                       voices=VoiceLibrary(Path(voices_dir) if voices_dir else None),
                                       default_ref_audio=default_ref_audio(ctx.version_dir),
                                       prefill_chunk_tokens=ctx.setting("prefill_chunk_tokens"),
                                       tts_in_llm=speaks, token2wav_in_llm=voiced)
        self.gauge = _LiveGauge(ctx.name, self.pipeline.sessions, ctx.setting("sweep_period_s"))
        self._bls_threads = ctx.setting("bls_threads")
        self._executor: ThreadPoolExecutor | None = None
        tracing.start(ctx.setting("otlp_endpoint"))  # a traced step's spans (the gateway sends their context)

    async def execute(self, requests: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        if self._executor is None:
            # The stub runs each BLS call (async_exec) blocking in the loop's default executor, whose
            # few threads (cores + 4) would cap the stage calls in flight for all sessions together.
            self._executor = ThreadPoolExecutor(self._bls_threads, thread_name_prefix="bls")
            loop.set_default_executor(self._executor)
        await asyncio.gather(*(self._handle(r) for r in requests))
        return None

    async def _handle(self, request: Any) -> None:
        sender = request.get_response_sender()
        rows = _rows(request)
        corr_id, start, end = _control(request, rows)

        def send(response: Any = None, flags: int = 0) -> None:
            # A client that went away (its gRPC stream broken) must not break the step for the stages.
            try:
                sender.send(response, flags=flags)
            except Exception as exc:  # noqa: BLE001 (logged; the step goes on for the stages)
                pb_utils.Logger.log_warn(f"sequence {corr_id}: response not delivered: {describe(exc)}")

        try:
            inp = contract.decode_request(rows, start, self.pipeline.preset.duplex)
            if isinstance(inp, contract.Cancel):
                # Beside the step in flight (not queued behind it): it stops at its next stage boundary.
                self.pipeline.cancel(corr_id)
                return

            async def emit(event: StepEvent) -> None:
                self.gauge.update()  # a sequence started by this step is counted before the client hears of it
                send(_event_response(event))

            with tracing.step_span(tracing.traceparent(request.parameters), corr_id):
                await self.pipeline.step(corr_id, start, end, inp, emit)
        except StepError as exc:
            send(_event_response(StepEvent.error(exc)))
        except SequenceNotStarted as exc:
            send(_event_response(StepEvent.error(StepError(Code.SEQUENCE_NOT_STARTED, f"no sequence {exc}"))))
        except Exception as exc:  # noqa: BLE001 (the client is told; the server keeps serving)
            pb_utils.Logger.log_error(f"duplex step failed for sequence {corr_id}: {describe(exc)}")
            send(_event_response(StepEvent.error(StepError(Code.INTERNAL_ERROR, f"{type(exc).__name__}"))))
        finally:
            self.gauge.update()
            await self.stages.finished.release(request.is_cancelled)  # before the final flag frees the request
            send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        self.gauge.close()
        tracing.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

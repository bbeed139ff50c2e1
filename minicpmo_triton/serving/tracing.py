"""The entry model's part of a duplex step's trace (OpenTelemetry SDK in the stub; docs/deploy.md, "Traces").

The gateway sends a traced step's W3C context as the request parameter `traceparent` (and in its stream's headers,
for Triton's own spans). Here the step becomes `duplex.step`, a child of that context, and each stage call a
`stage.<model>` inside it (minicpmo_triton/serving/bls.py):
the time from the call leaving the entry model to the stage's
answer (its queue and its compute), so a slow step names its slow stage. Triton 2.51 cannot trace the stage calls
itself: a BLS request given the step's Triton trace (`trace=request.trace()`) crashes tritonserver (SIGSEGV in
TRITONBACKEND_RequestRelease) once the async decoupled entry model's request, and its trace with it, is released
before its stage calls end. Only a step that came with a context is traced; attributes are ids and counts, never
the caller's text or audio.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SCOPE = "minicpmo.triton"
TRACEPARENT = "traceparent"  # the request parameter the gateway sends (gateway/triton/stream.py)
_PROPAGATOR = TraceContextTextMapPropagator()
_started = False  # this stub exports spans (an endpoint was set)


def start(otlp_endpoint: str, service: str = "minicpmo-triton") -> None:
    """This stub's spans go to the collector at `otlp_endpoint` (http://host:4318), in batches; nothing without one."""
    global _started
    if not otlp_endpoint:
        return
    _started = True
    from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/traces"), schedule_delay_millis=1000))
    trace.set_tracer_provider(provider)


def stop() -> None:
    """The spans still batched are sent (at the model's finalize)."""
    shutdown = getattr(trace.get_tracer_provider(), "shutdown", None)
    if shutdown is not None:
        shutdown()


def traceparent(parameters: Callable[[], str]) -> str | None:
    """The step's trace context from a request's parameters (Triton's JSON of them), if it came with one and this
    stub exports spans."""
    if not _started:
        return None
    try:
        value = json.loads(parameters() or "{}").get(TRACEPARENT)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


@contextlib.contextmanager
def step_span(context: str | None, corr_id: int) -> Iterator[None]:
    """`duplex.step` around the entry model's work on a step that came with a trace context; nothing otherwise."""
    if context is None:
        yield
        return
    parent = _PROPAGATOR.extract({TRACEPARENT: context})
    with trace.get_tracer(SCOPE).start_as_current_span("duplex.step", parent,
                                                       attributes={"minicpmo.sequence": str(corr_id)}):
        yield


@contextlib.contextmanager
def stage_span(model: str, **attributes: Any) -> Iterator[None]:
    """`stage.<model>` around one stage call, inside a traced step only (the current span records)."""
    if not trace.get_current_span().is_recording():
        yield
        return
    with trace.get_tracer(SCOPE).start_as_current_span(f"stage.{model}", attributes={"triton.model": model,
                                                                                     **attributes}):
        yield

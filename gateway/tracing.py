"""One trace per duplex step (OpenTelemetry), off by default; on with `MINICPMO_OTLP_ENDPOINT` (docs/deploy.md,
"Traces").

A step's trace: `gateway.step` (the append that completed its second, to its last event handed to the caller), with
`gateway.queue` (its wait behind the session's step in flight) and `gateway.triton` (sent, to its last event back).
The context of `gateway.triton` goes to Triton with the step (`gateway/triton/stream.py`): Triton's own spans
(`InferRequest`, the `duplex` model's) and the entry model's (`duplex.step`, then `stage.llm`, `stage.tts`, ... one
per stage call: minicpmo_triton/serving/tracing.py) join it, so a slow step names its slow stage. Spans carry
ids, counts and decisions, never the caller's text or audio.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SCOPE = "minicpmo.gateway"
_PROPAGATOR = TraceContextTextMapPropagator()


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP collector's traces URL from its base (`http://host:4318`)."""
    return endpoint.rstrip("/") + "/v1/traces"


def provider(endpoint: str, service: str = "minicpmo-gateway") -> trace.TracerProvider:
    """The SDK's provider exporting to `endpoint` in batches (OTLP/HTTP, JSON: the protobuf encoding's package needs
    a protobuf that tritonclient 2.51's gRPC stack does not take; docs/deploy.md)."""
    from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    sdk = TracerProvider(resource=Resource.create({"service.name": service}))
    sdk.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    return sdk


def ns_at(monotonic_s: float) -> int:
    """A `time.monotonic()` instant as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class StepTracer:
    """Opens each step's spans; a no-op (its spans record nothing, no context goes to Triton) without a provider."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.provider = tracer_provider
        self.tracer: Tracer = (tracer_provider.get_tracer(SCOPE) if tracer_provider is not None
                               else trace.NoOpTracer())

    @classmethod
    def of(cls, otlp_endpoint: str) -> StepTracer:
        return cls(provider(otlp_endpoint) if otlp_endpoint else None)

    def shutdown(self) -> None:
        """The spans still batched are sent (the SDK's provider; the no-op has none)."""
        shutdown = getattr(self.provider, "shutdown", None)
        self.provider = None  # once: the gateway shuts down from its server and its app's lifespan both
        if shutdown is not None:
            shutdown()

    @contextlib.contextmanager
    def step(self, planned_at: float, sent_at: float, attributes: dict[str, Any]) -> Iterator[StepSpans]:
        root = self.tracer.start_span("gateway.step", start_time=ns_at(planned_at), attributes=attributes)
        if not root.is_recording():  # off, or not sampled: nothing is made or sent
            yield StepSpans(root, root)
            return
        context = trace.set_span_in_context(root)
        self.tracer.start_span("gateway.queue", context, start_time=ns_at(planned_at)).end(ns_at(sent_at))
        triton = self.tracer.start_span("gateway.triton", context, start_time=ns_at(sent_at))
        spans = StepSpans(root, triton)
        try:
            yield spans
        finally:
            triton.end()
            root.end()


class StepSpans:
    def __init__(self, root: Span, triton: Span) -> None:
        self.root = root
        self.triton = triton

    @property
    def traceparent(self) -> str | None:
        """The W3C trace context Triton's part of the step continues (None: not traced)."""
        if not self.triton.is_recording():
            return None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(self.triton))
        return carrier.get("traceparent")

    def decided(self, decision: str) -> None:
        self.root.set_attribute("minicpmo.decision", decision)  # listen | speak | error

"""A duplex step's trace, end to end (docs/deploy.md, "Traces"): a gateway whose spans go to the OpenTelemetry SDK's
in-memory exporter, a tritonserver in OpenTelemetry trace mode whose spans (Triton's own, and the entry model's
per stage) go to a small OTLP receiver, real sessions between them. Every step the caller saw is one trace holding
the gateway's spans, Triton's and one per stage the step used; none carries the caller's words or audio."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import uvicorn
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.audio import encode_f32_base64
from gateway.routes import create_app
from gateway.settings import Settings
from gateway.tracing import StepTracer
from gateway.triton import free_port

from .conftest import RunningTriton, triton_with
from .helpers import deltas, open_session, recv_until
from .otlp_receiver import OtlpReceiver, ReceivedSpan
from .test_vision_e2e import jpeg

pytestmark = [pytest.mark.ops, pytest.mark.asyncio(loop_scope="function")]

GATEWAY_SPANS = {"gateway.step", "gateway.queue", "gateway.triton"}
TRITON_SPANS = {"InferRequest", "duplex"}  # Triton's own: the request on its stream, the entry model's
WORDS = "Please book a table for two at the harbour restaurant tonight"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced_triton(receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with({"MINICPMO_OTLP_ENDPOINT": receiver.url}, tmp_path_factory.mktemp("traced"))


@contextlib.asynccontextmanager
async def traced_gateway(triton_url: str, exporter: InMemorySpanExporter) -> AsyncIterator[str]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(Settings(triton_url=triton_url))
    app.state.gateway.tracer = StepTracer(provider)  # as MINICPMO_OTLP_ENDPOINT would, into memory
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(60):
            while not (server.started and app.state.gateway.ready):
                await asyncio.sleep(0.05)
        yield f"ws://127.0.0.1:{port}/backend"
    finally:
        server.should_exit = True
        await task


def hexid(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def gateway_spans(exporter: InMemorySpanExporter) -> list[ReceivedSpan]:
    def received(s: ReadableSpan) -> ReceivedSpan:
        assert s.context is not None
        return ReceivedSpan(hexid(s.context.trace_id, 32), hexid(s.context.span_id, 16),
                            hexid(s.parent.span_id, 16) if s.parent else "", s.name, "gateway",
                            dict(s.attributes or {}), s.start_time or 0, s.end_time or 0)
    return [received(s) for s in exporter.get_finished_spans()]


async def wait_for(receiver: OtlpReceiver, traces: set[str], names: set[str], timeout_s: float = 30.0) -> None:
    """Until Triton's and the stub's batches are in (each exports within a second or so)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with receiver.lock:
            seen = defaultdict(set)
            for s in receiver.spans:
                seen[s.trace_id].add(s.name)
        if all(names <= seen[t] for t in traces):
            return
        await asyncio.sleep(0.5)


async def test_every_step_is_one_trace_through_every_stage(traced_triton: RunningTriton, receiver: OtlpReceiver,
                                                           speech) -> None:
    exporter = InMemorySpanExporter()
    audio = speech(WORDS)
    async with traced_gateway(traced_triton.endpoint, exporter) as url:
        # full duplex: a step per appended second
        ws, _ = await open_session(url)
        seconds = [audio[i:i + 16_000] for i in range(0, len(audio) - 15_999, 16_000)][:4]
        answered = []
        for i, second in enumerate(seconds):
            await ws.send(json.dumps({"type": "input.append", "input": {"input_id": f"in_{i}",
                                                                        "audio": encode_f32_base64(second)}}))
            answered += await recv_until(ws, lambda e, i=i: e.get("input_id") == f"in_{i}"
                                         and e.get("chunk_usage") is not None, 60)
        await ws.close()
        # a turn-based chat turn that goes through every stage: audio and an image in, speech out
        chat, _ = await open_session(url, mode="turn_based")
        message = {"role": "user", "content": [
            {"type": "audio", "audio": encode_f32_base64(audio)},
            {"type": "image", "image": jpeg(96, 64)}]}
        await chat.send(json.dumps({"type": "input.append", "input": {
            "input_id": "t", "messages": [message], "max_new_tokens": 24, "generate_audio": True}}))
        turn = await recv_until(chat, lambda e: e["type"] in ("response.done", "error"), 120)
        await chat.close()
    assert turn[-1]["type"] == "response.done" and deltas(turn, "audio")

    mine = gateway_spans(exporter)
    roots = [s for s in mine if s.name == "gateway.step"]
    assert len(roots) == len(seconds) + 1  # one per step the callers sent: four seconds and the chat turn
    traces = {s.trace_id for s in roots}
    assert len(traces) == len(roots)  # one trace each
    for trace_id in traces:
        assert {s.name for s in mine if s.trace_id == trace_id} == GATEWAY_SPANS
    await wait_for(receiver, traces, TRITON_SPANS | {"duplex.step", "stage.llm"})

    with receiver.lock:
        theirs = [s for s in receiver.spans if s.trace_id in traces]
    by_trace: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for s in mine + theirs:
        by_trace[s.trace_id].append(s)
    chat_trace = next(s.trace_id for s in roots if s.attributes["minicpmo.kind"] == "chat")
    for trace_id, spans in by_trace.items():
        names = {s.name for s in spans}
        assert GATEWAY_SPANS | TRITON_SPANS | {"duplex.step", "stage.llm"} <= names, names
        ids = {s.span_id for s in spans}
        root = next(s for s in spans if s.name == "gateway.step")
        # one tree: every span's parent is in this trace, but the gateway's root
        assert all(s.parent_id in ids for s in spans if s is not root), [(s.name, s.parent_id) for s in spans]
        stage_spans = [s for s in spans if s.name.startswith("stage.")]
        duplex_step = next(s for s in spans if s.name == "duplex.step")
        assert all(root.start_ns <= s.start_ns and s.end_ns <= root.end_ns + 50_000_000 for s in stage_spans)
        assert all(s.parent_id == duplex_step.span_id for s in stage_spans)
        if trace_id == chat_trace:  # every stage, in the one trace of the turn that used them all
            assert {"stage.audio_encoder", "stage.vision_encoder", "stage.llm", "stage.tts",
                    "stage.token2wav"} <= names, names
    # a spoken step names its speech stages; the decision is on the gateway's root
    decisions = {s.trace_id: s.attributes.get("minicpmo.decision") for s in roots}
    for trace_id, decision in decisions.items():
        if decision == "speak" and trace_id != chat_trace:
            assert {"stage.tts", "stage.token2wav"} <= {s.name for s in by_trace[trace_id]}

    # nothing of the caller's: no word of what was said, no audio, in any span or what was sent of them
    sent = b"".join(receiver.bodies).decode()
    said = {w.lower() for w in WORDS.split() if len(w) > 3}
    texts = [json.dumps(s.attributes) + s.name for s in mine] + [sent]
    reply = "".join(e.get("text", "") for e in turn if e.get("text"))
    audio_b64 = base64.b64encode(np.asarray(audio[:4000], "<f4").tobytes()).decode()[:64]
    for text in texts:
        assert not any(w in text.lower() for w in said)
        assert audio_b64 not in text
        assert not reply or reply not in text


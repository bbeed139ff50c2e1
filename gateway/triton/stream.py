"""A session's stream to Triton (`TritonStream`): one gRPC stream to the `duplex` model with the session's
correlation ID, which names its sequence in Triton.

Steps go out in order on the stream; each step's streamed responses are routed back by request id
until Triton's empty final response. `close()` sends the sequence END exactly once; one it could not confirm (the
stream broken, Triton silent, the entry model's state gone) is handed to `on_unended`, which has it ENDed later
(gateway/triton/orphans.py). A step Triton could not run at all (an error on the stream: the entry model's stub
died, its model is reloading) is `TritonUnavailable`: the session's state is gone with it.

A traced step (`trace`: its W3C context, gateway/tracing.py) goes on a gRPC stream of its own whose headers carry
the context, the one place Triton 2.51 reads it from (a stream's headers, not a request's): Triton's own spans
then join that step's trace; the context rides as a request parameter too, for the entry model's spans. Its
sequence is the session's all the same (the correlation ID names it, not the stream).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import aio as grpcaio

from minicpmo_triton.duplex_contract import Cancel, Request, StepEvent, StepInput, decode_event, encode_request

ENTRY_MODEL = "duplex"
_FINAL = "triton_final_response"
TRACEPARENT = "traceparent"  # W3C trace context: the stream's header, and the request's parameter


def next_correlation_id(taken: Collection[int] = ()) -> int:
    """63 random bits, from the OS, for each session, none of `taken` (this gateway's live ones on that server).
    No coordination between gateways, endpoints or restarts is needed: two live sequences on one server share
    an id with a probability under n^2 / 2^64 for n sessions on it at once (5e-12 for 10,000), where a counter
    under a random 24-bit prefix per process collides whenever two live gateways draw the same prefix (G^2 / 2^25
    for G of them: 3e-4 for 100). Below 2^63: the id also travels as an INT64."""
    while True:
        corr_id = secrets.randbits(63)
        if corr_id and corr_id not in taken:
            return corr_id


class TritonStreamError(RuntimeError):
    """The stream to Triton broke, or Triton rejected a step."""


class TritonUnavailable(TritonStreamError):
    """The stream to Triton is gone (Triton died or restarted): the sequence's state went with it."""


_DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.bool_): "BOOL",
           np.dtype(np.object_): "BYTES"}


def build_inputs(req: Request) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in encode_request(req).items():
        arr = value[None]  # the batch dimension
        t = grpcclient.InferInput(name, list(arr.shape), _DTYPES[arr.dtype])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def parse_result(result: grpcclient.InferResult) -> StepEvent | None:
    raw = result.as_numpy("event")
    if raw is None:
        return None  # the empty final response
    return decode_event(raw, result.as_numpy("audio"))


class TritonStream:
    def __init__(self, url: str, corr_id: int | None = None, model: str = ENTRY_MODEL,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.url = url
        self.on_lost = on_lost  # told once when the stream breaks before the sequence ended
        self.on_unended: Callable[[], None] | None = None  # told when close() could not confirm the END
        self.model = model
        self.corr_id = corr_id or next_correlation_id()
        self._client: grpcaio.InferenceServerClient | None = None
        self._outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._pending: OrderedDict[str, asyncio.Queue[StepEvent | Exception | None]] = OrderedDict()
        self._reader: asyncio.Task[None] | None = None
        self._step_no = 0
        self._traced: set[asyncio.Task[None]] = set()  # traced steps' own streams, being read
        self.started = False
        self.ended = False
        self._broken: Exception | None = None

    async def open(self) -> None:
        self._client = grpcaio.InferenceServerClient(self.url)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            while (item := await self._outbox.get()) is not None:
                yield item

        stream = self._client.stream_infer(requests())
        self._reader = asyncio.create_task(self._read(stream))

    def _route(self, result: Any, error: Any) -> None:
        """One message of a stream to the step it answers."""
        if error is not None:
            # Triton's stream errors carry no request id: they belong to the oldest open step. Triton could not run
            # it (the entry model's own failures are coded events): its state is gone
            if self._pending:
                _, oldest = self._pending.popitem(last=False)
                oldest.put_nowait(TritonUnavailable(f"Triton could not run the step: {error}"))
            return
        response = result.get_response()
        q = self._pending.get(response.id)
        if q is None:
            return
        event = parse_result(result)
        if event is not None:
            q.put_nowait(event)
        if response.parameters[_FINAL].bool_param:
            self._pending.pop(response.id, None)
            q.put_nowait(None)

    async def _read(self, stream: Any) -> None:
        try:
            async for result, error in stream:
                self._route(result, error)
        except asyncio.CancelledError:  # closed by us (`close`): the steps still open learn the stream is gone
            self._broken = TritonStreamError("the stream to Triton was closed")
            raise
        except Exception as exc:  # noqa: BLE001 (the stream is gone: every open step learns why)
            self._broken = exc
        finally:
            self._broken = self._broken or TritonStreamError("the stream to Triton closed")
            for q in self._pending.values():
                q.put_nowait(TritonUnavailable(f"stream to Triton lost: {self._broken}"))
            self._pending.clear()
            if not self.ended and self.on_lost is not None:
                self.on_lost()

    async def _read_traced(self, item: dict[str, Any], traceparent: str) -> None:
        """A traced step's own stream: its one request, then its responses until the final one."""
        async def one() -> AsyncIterator[dict[str, Any]]:
            yield item

        assert self._client is not None
        try:
            async for result, error in self._client.stream_infer(one(), headers={TRACEPARENT: traceparent}):
                self._route(result, error)
        except Exception as exc:  # noqa: BLE001 (this step's stream broke: the step learns why; the session's own
            # stream tells the session when Triton went away)
            q = self._pending.pop(item["request_id"], None)
            if q is not None:
                q.put_nowait(TritonUnavailable(f"stream to Triton lost: {exc}"))

    def _send(self, req: Request, end: bool, trace: str | None = None) -> asyncio.Queue[StepEvent | Exception | None]:
        if self._broken is not None:
            raise TritonUnavailable(f"stream to Triton lost: {self._broken}")
        if self.ended:
            raise TritonStreamError("the sequence has ended")
        request_id = f"{self.corr_id}-{self._step_no}"
        self._step_no += 1
        q: asyncio.Queue[StepEvent | Exception | None] = asyncio.Queue()
        self._pending[request_id] = q
        item: dict[str, Any] = {
            "model_name": self.model, "inputs": build_inputs(req), "request_id": request_id,
            "sequence_id": self.corr_id, "sequence_start": not self.started, "sequence_end": end,
            "parameters": {"triton_enable_empty_final_response": True},
        }
        if trace is None:
            self._outbox.put_nowait(item)
        else:
            item["parameters"][TRACEPARENT] = trace
            task = asyncio.get_running_loop().create_task(self._read_traced(item, trace))
            self._traced.add(task)
            task.add_done_callback(self._traced.discard)
        self.started = True
        self.ended = end
        return q

    async def step(self, req: Request, end: bool = False, trace: str | None = None) -> AsyncIterator[StepEvent]:
        """Send one step now; iterate its events (a coded `error` event ends the step). `trace`: its trace context."""
        q = self._send(req, end, trace)
        while (item := await q.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item

    async def cancel(self) -> None:
        """Stop the step in flight: its remaining stages are skipped (its events still end normally)."""
        if self.started and not self.ended and self._broken is None:
            async for _ in self.step(Cancel()):
                pass

    async def close(self, timeout_s: float = 10.0) -> None:
        """End the Triton sequence (once, waiting at most `timeout_s`; 0: not even tried, Triton being gone) and close
        the stream. An END not confirmed goes to `on_unended`."""
        confirmed = not self.started or self.ended
        try:
            if not confirmed and self._broken is None and timeout_s > 0:
                async def drain() -> bool:
                    errors = [ev for ev in [e async for e in self.step(StepInput(), end=True)] if ev.kind == "error"]
                    return not errors  # e.g. the entry model no longer holds the sequence: its stages may
                confirmed = await asyncio.wait_for(drain(), timeout_s)
        finally:
            if not confirmed and self.on_unended is not None:
                self.on_unended()
            self.ended = True
            self._outbox.put_nowait(None)
            if self._reader is not None:
                await asyncio.wait({self._reader}, timeout=2.0)  # the reader sees the stream end (it logs nothing)
                self._reader.cancel()  # a no-op once it has
            for task in list(self._traced):
                task.cancel()
            if self._client is not None:
                await self._client.close()

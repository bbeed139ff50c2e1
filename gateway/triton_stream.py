"""One session = one gRPC stream to the `duplex` model with the session's correlation ID.

Steps go out in order on the stream; each step's streamed responses are routed back by request id
until Triton's empty final response. `close()` sends the sequence END exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import aio as grpcaio

ENTRY_MODEL = "duplex"
_FINAL = "triton_final_response"

# Unique per gateway process and across restarts: random high bits, a counter below.
_corr_ids = itertools.count((int.from_bytes(os.urandom(3), "big") << 32) + 1)


def next_correlation_id() -> int:
    return next(_corr_ids)


class TritonStreamError(RuntimeError):
    """The stream to Triton broke, or Triton rejected a step."""


@dataclass
class StepEvent:
    kind: str  # listen | text | audio | error
    text: str = ""
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    end_of_turn: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    chunk_usage: dict[str, int] | None = None
    code: str = ""
    message: str = ""
    reason: str = ""


@dataclass
class StepRequest:
    audio: np.ndarray | None = None  # 16 kHz float32
    force_listen: bool = False
    context: dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    chat: dict[str, Any] | None = None  # a turn-based turn
    frames: list[bytes] = field(default_factory=list)  # encoded images
    max_slice_nums: list[int] = field(default_factory=list)
    voice: dict[str, np.ndarray] | None = None  # ref_audio / tts_ref_audio (16 kHz), with the first step
    voice_name: str = ""  # a named voice of the model server's voice folder, with the first step
    rollback_to: int = -1  # barge-in: the LLM's kv length to go back to
    replay_audio: np.ndarray | None = None  # ... and the caller's whole seconds since then, heard again
    cancel: bool = False  # stop the step in flight (sent beside it, answers nothing)


def _string_input(name: str, value: dict[str, Any]) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[json.dumps(value).encode("utf-8")]], dtype=np.object_))
    return t


def _f32_input(name: str, values: np.ndarray) -> grpcclient.InferInput:
    arr = np.ascontiguousarray(values, np.float32).reshape(1, -1)
    t = grpcclient.InferInput(name, list(arr.shape), "FP32")
    t.set_data_from_numpy(arr)
    return t


def build_inputs(req: StepRequest) -> list[grpcclient.InferInput]:
    inputs = []
    if req.audio is not None and len(req.audio):
        inputs.append(_f32_input("audio", req.audio))
    for name, ref in (req.voice or {}).items():
        inputs.append(_f32_input(name, ref))
    if req.replay_audio is not None and len(req.replay_audio):
        inputs.append(_f32_input("replay_audio", req.replay_audio))
    for name, flag in (("force_listen", req.force_listen), ("cancel", req.cancel)):
        if flag:
            t = grpcclient.InferInput(name, [1, 1], "BOOL")
            t.set_data_from_numpy(np.array([[True]]))
            inputs.append(t)
    if req.rollback_to >= 0:
        t = grpcclient.InferInput("rollback_to", [1, 1], "INT64")
        t.set_data_from_numpy(np.array([[req.rollback_to]], np.int64))
        inputs.append(t)
    if req.voice_name:
        t = grpcclient.InferInput("voice_name", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[req.voice_name.encode("utf-8")]], dtype=np.object_))
        inputs.append(t)
    if req.context:
        inputs.append(_string_input("context", req.context))
    if req.options is not None:
        inputs.append(_string_input("options", req.options))
    if req.chat is not None:
        inputs.append(_string_input("chat", req.chat))
    if req.frames:
        t = grpcclient.InferInput("frames", [1, len(req.frames)], "BYTES")
        t.set_data_from_numpy(np.array([req.frames], dtype=np.object_))
        inputs.append(t)
        slices = np.array([req.max_slice_nums or [1] * len(req.frames)], np.int64)
        t = grpcclient.InferInput("max_slice_nums", list(slices.shape), "INT64")
        t.set_data_from_numpy(slices)
        inputs.append(t)
    if not inputs:  # an END-only request still needs one tensor
        t = grpcclient.InferInput("force_listen", [1, 1], "BOOL")
        t.set_data_from_numpy(np.array([[False]]))
        inputs.append(t)
    return inputs


def parse_result(result: grpcclient.InferResult) -> StepEvent | None:
    raw = result.as_numpy("event")
    if raw is None:
        return None  # the empty final response
    event = json.loads(raw.reshape(-1)[0])
    audio = result.as_numpy("audio")
    return StepEvent(
        kind=event["kind"], text=event.get("text", ""),
        audio=np.zeros(0, np.float32) if audio is None else audio.reshape(-1),
        end_of_turn=bool(event.get("end_of_turn")), metrics=event.get("metrics", {}),
        chunk_usage=event.get("chunk_usage"), code=event.get("code", ""), message=event.get("message", ""),
        reason=event.get("reason", ""),
    )


class TritonSession:
    def __init__(self, url: str, corr_id: int | None = None, model: str = ENTRY_MODEL) -> None:
        self.url = url
        self.model = model
        self.corr_id = corr_id or next_correlation_id()
        self._client: grpcaio.InferenceServerClient | None = None
        self._outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._pending: OrderedDict[str, asyncio.Queue[StepEvent | BaseException | None]] = OrderedDict()
        self._reader: asyncio.Task[None] | None = None
        self._step_no = 0
        self.started = False
        self.ended = False
        self._broken: BaseException | None = None

    async def open(self) -> None:
        self._client = grpcaio.InferenceServerClient(self.url)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            while (item := await self._outbox.get()) is not None:
                yield item

        stream = self._client.stream_infer(requests())
        self._reader = asyncio.create_task(self._read(stream))

    async def _read(self, stream: Any) -> None:
        try:
            async for result, error in stream:
                if error is not None:
                    # Triton's stream errors carry no request id: they belong to the oldest open step.
                    if self._pending:
                        _, q = self._pending.popitem(last=False)
                        q.put_nowait(TritonStreamError(str(error)))
                    continue
                response = result.get_response()
                q = self._pending.get(response.id)
                if q is None:
                    continue
                event = parse_result(result)
                if event is not None:
                    q.put_nowait(event)
                if response.parameters[_FINAL].bool_param:
                    self._pending.pop(response.id, None)
                    q.put_nowait(None)
        except BaseException as exc:  # noqa: BLE001 (the stream is gone: every open step learns why)
            self._broken = exc
        finally:
            self._broken = self._broken or TritonStreamError("the stream to Triton closed")
            for q in self._pending.values():
                q.put_nowait(TritonStreamError(f"stream to Triton lost: {self._broken}"))
            self._pending.clear()

    def _send(self, req: StepRequest, end: bool) -> asyncio.Queue[StepEvent | BaseException | None]:
        if self._broken is not None:
            raise TritonStreamError(f"stream to Triton lost: {self._broken}")
        if self.ended:
            raise TritonStreamError("the sequence has ended")
        request_id = f"{self.corr_id}-{self._step_no}"
        self._step_no += 1
        q: asyncio.Queue[StepEvent | BaseException | None] = asyncio.Queue()
        self._pending[request_id] = q
        self._outbox.put_nowait({
            "model_name": self.model, "inputs": build_inputs(req), "request_id": request_id,
            "sequence_id": self.corr_id, "sequence_start": not self.started, "sequence_end": end,
            "parameters": {"triton_enable_empty_final_response": True},
        })
        self.started = True
        self.ended = end
        return q

    async def step(self, req: StepRequest, end: bool = False) -> AsyncIterator[StepEvent]:
        """Send one step now; iterate its events (a coded `error` event ends the step)."""
        q = self._send(req, end)
        while (item := await q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def cancel(self) -> None:
        """Stop the step in flight: its remaining stages are skipped (its events still end normally)."""
        if self.started and not self.ended and self._broken is None:
            async for _ in self.step(StepRequest(cancel=True)):
                pass

    async def close(self, timeout_s: float = 10.0) -> None:
        """End the Triton sequence (once) and close the stream."""
        try:
            if self.started and not self.ended and self._broken is None:
                async def drain() -> None:
                    async for _ in self.step(StepRequest(), end=True):
                        pass
                await asyncio.wait_for(drain(), timeout_s)
        finally:
            self.ended = True
            self._outbox.put_nowait(None)
            if self._reader is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                    self._reader.cancel()
            if self._client is not None:
                await self._client.close()

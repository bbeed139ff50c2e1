"""The stages as seen from the entry model: BLS requests with explicit correlation IDs and flags."""

from __future__ import annotations

import asyncio
from typing import Any

import triton_python_backend_utils as pb_utils

from . import stage_io as io
from .errors import Code, StepError, from_wire
from .pipeline import Ready
from .stages.base import StageCall


async def _answer(infer: Any, decoupled: bool) -> Any:
    """The stage's one response. A decoupled stage's comes through an iterator that blocks until the stage
    answers: it is read on an executor thread, as `async_exec` waits for a plain stage's."""
    if not decoupled:
        return await infer.async_exec()

    def first() -> Any:
        responses = infer.exec(decoupled=True)
        answer = None
        for response in responses:  # the final flag ends the iteration; the answer rides with it
            if answer is None or response.has_error():
                answer = response
        return answer

    answer = await asyncio.get_running_loop().run_in_executor(None, first)
    if answer is None:
        raise StepError(Code.STAGE_ERROR, "llm: no response")
    return answer


def _flags(call: StageCall[Any]) -> int:
    flags = 0
    if call.start:
        flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    if call.end:
        flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
    return flags


class TritonBlsStages:
    async def _exec(self, model: str, request: Any, result_cls: type, call: StageCall[Any] | None = None,
                    ready: Ready | None = None) -> Any:
        tensors = [pb_utils.Tensor(name, value[None]) for name, value in io.encode(request).items()]
        kwargs: dict[str, Any] = {}
        if call is not None:
            kwargs = {"correlation_id": call.corr_id, "flags": _flags(call)}
        outputs = [f for f in result_cls.__dataclass_fields__]
        infer = pb_utils.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs, **kwargs)
        if ready is not None:
            # Built first: steps released from the door together reach the batcher together.
            await ready()
        response = await _answer(infer, decoupled=model in io.DECOUPLED_STAGES)
        if response.has_error():
            raise from_wire(response.error().message(), model)  # the stage's code, or stage_error

        outputs_by_name = {t.name(): t.as_numpy()[0] for t in response.output_tensors()}
        return io.decode(result_cls, outputs_by_name.get)

    async def audio_encoder(self, request: io.AudioEncoderRequest) -> io.AudioEncoderResult:
        return await self._exec("audio_encoder", request, io.AudioEncoderResult)

    async def vision_encoder(self, request: io.VisionEncoderRequest) -> io.VisionEncoderResult:
        return await self._exec("vision_encoder", request, io.VisionEncoderResult)

    async def llm(self, call: StageCall[io.LlmRequest], ready: Ready | None = None) -> io.LlmResult:
        return await self._exec("llm", call.request, io.LlmResult, call, ready)

    async def tts(self, call: StageCall[io.TtsRequest]) -> io.TtsResult:
        return await self._exec("tts", call.request, io.TtsResult, call)

    async def token2wav(self, call: StageCall[io.Token2WavRequest]) -> io.Token2WavResult:
        return await self._exec("token2wav", call.request, io.Token2WavResult, call)

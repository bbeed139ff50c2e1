"""The stages as seen from the entry model: BLS requests with explicit correlation IDs and flags."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import triton_python_backend_utils as pb_utils

from .. import stage_io as io
from ..errors import Code, StepError, from_wire
from ..stages.base import StageCall
from . import tracing
from .pipeline import Ready


class FinishedStreams:
    """The response iterators of finished decoupled calls, held until the stub has forgotten them.

    The stub keeps each iterator in a map until its stub-to-parent thread sends the iterator's cleanup; if that
    map holds the last reference, the iterator and its responses' numpy arrays are freed on that C++ thread
    without the GIL (python_backend `Stub::SendCleanupId`): Python 3.12's allocator crashes the stub there. So
    whoever reads a stream hands it here, and it is dropped only after a later round trip through the same
    FIFO thread (a request's `is_cancelled()`) shows the cleanup sent before it is done.
    """

    def __init__(self) -> None:
        self._held: list[Any] = []

    def hold(self, stream: Any) -> None:
        self._held.append(stream)

    async def release(self, round_trip: Callable[[], bool]) -> None:
        """Drop what was held before `round_trip` (a request's `is_cancelled`) went through the FIFO. A
        cancelled request answers from its cache without the round trip: then everything is kept for the next."""
        if not self._held:
            return
        held, self._held = self._held, []
        try:
            cached = await asyncio.get_running_loop().run_in_executor(None, round_trip)
        except Exception:  # noqa: BLE001 (no round trip made: keep them; a step's end must not fail here)
            cached = True
        if cached:
            self._held.extend(held)
        else:
            held.clear()  # the last references: freed here, on a Python thread with the GIL


def _next(responses: Any, finished: FinishedStreams) -> Any:
    """A decoupled call's next response (None: its stream ended); an ended stream is handed to `finished`."""
    answer = next(responses, None)
    if answer is None or answer.has_error():  # nothing follows an error
        _drain(responses, finished)
    return answer


def _last(responses: Any, finished: FinishedStreams) -> Any:
    """A decoupled call's last response (None: its stream ended first), its stream read to its end."""
    answer = next(responses, None)
    _drain(responses, finished)
    return answer


def _drain(responses: Any, finished: FinishedStreams) -> None:
    """The stream read to its end (its final flag), then handed to `finished`."""
    for _ in responses:
        pass
    finished.hold(responses)


async def _answer(infer: Any, decoupled: bool, finished: FinishedStreams) -> Any:
    """The stage's one response. A decoupled stage's comes through an iterator that blocks until the stage
    answers: it is read on an executor thread, as `async_exec` waits for a plain stage's."""
    if not decoupled:
        return await infer.async_exec()

    def first() -> Any:
        responses = infer.exec(decoupled=True)
        answer = None
        try:
            for response in responses:  # the final flag ends the iteration; the answer rides with it
                if answer is None or response.has_error():
                    answer = response
        finally:
            finished.hold(responses)
        return answer

    answer = await asyncio.get_running_loop().run_in_executor(None, first)
    if answer is None:
        raise StepError(Code.STAGE_ERROR, "a decoupled stage gave no response")
    return answer


def _decoded(response: Any, result_cls: type[Any], model: str) -> Any:
    """A stage's response as its result, or its error raised (the stage's code, or stage_error)."""
    if response is None:
        raise StepError(Code.STAGE_ERROR, f"{model}: its stream ended before its answer")
    if response.has_error():
        raise from_wire(response.error().message(), model)
    outputs_by_name = {t.name(): t.as_numpy()[0] for t in response.output_tensors()}
    return io.decode(result_cls, outputs_by_name.get)


def _spoken(response: Any, voiced: bool) -> io.TtsResult | io.VoicedSpeech:
    """The llm model's answer from its TTS (`tts_in_llm`): the codes, or their audio where it runs token2wav too
    (`voiced`: `token2wav_in_llm`), or the refusal raised with its code."""
    refused = _decoded(response, io.SpeechRefused, "llm").error()
    if refused is not None:
        raise refused
    return _decoded(response, io.VoicedSpeech if voiced else io.TtsResult, "llm")


def _flags(call: StageCall[Any]) -> int:
    flags = 0
    if call.start:
        flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    if call.end:
        flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
    return flags


class TritonBlsStages:
    def __init__(self, voiced: bool = False) -> None:
        """`voiced`: the llm model runs token2wav too (`token2wav_in_llm`): its speech answers are audio."""
        self.voiced = voiced
        self.finished = FinishedStreams()
        # each session's llm call that spoke: the rest of its stream, being read (`speech` takes it)
        self._speaking: dict[int, asyncio.Future[Any]] = {}

    @staticmethod
    def _infer(model: str, request: Any, outputs: list[str], call: StageCall[Any] | None,
               parameters: dict[str, Any] | None = None, also: Any = None) -> Any:
        """`also`: a second request whose tensors ride along (a name both have: the first's)."""
        encoded = {**(io.encode(also) if also is not None else {}), **io.encode(request)}
        tensors = [pb_utils.Tensor(name, value[None]) for name, value in encoded.items()]
        kwargs: dict[str, Any] = {}
        if call is not None:
            kwargs = {"correlation_id": call.corr_id, "flags": _flags(call)}
        if parameters:
            kwargs["parameters"] = parameters
        return pb_utils.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs, **kwargs)

    async def _exec(self, model: str, request: Any, result_cls: type[Any], call: StageCall[Any] | None = None,
                    ready: Ready | None = None) -> Any:
        infer = self._infer(model, request, [f.name for f in dataclasses.fields(result_cls)], call)
        if ready is not None:
            # Built first: steps released from the door together reach the batcher together.
            await ready()
        with tracing.stage_span(model):
            response = await _answer(infer, model in io.DECOUPLED_STAGES, self.finished)
        return _decoded(response, result_cls, model)

    async def audio_encoder(self, request: io.AudioEncoderRequest) -> io.AudioEncoderResult:
        return await self._exec("audio_encoder", request, io.AudioEncoderResult)

    async def vision_encoder(self, request: io.VisionEncoderRequest) -> io.VisionEncoderResult:
        return await self._exec("vision_encoder", request, io.VisionEncoderResult)

    async def llm(self, call: StageCall[io.LlmRequest], ready: Ready | None = None) -> io.LlmResult:
        if not call.request.speak:
            return await self._exec("llm", call.request, io.LlmResult, call, ready)
        # Its stream carries the TTS's codes after its result when it spoke: the result is read, the codes wait
        # (`speech`) on an executor thread, while the step emits the text.
        loop = asyncio.get_running_loop()
        infer = self._infer("llm", call.request, io.output_names("llm"), call)
        if ready is not None:
            await ready()
        with tracing.stage_span("llm"):
            responses = iter(await loop.run_in_executor(None, functools.partial(infer.exec, decoupled=True)))
            result = _decoded(await loop.run_in_executor(None, _next, responses, self.finished), io.LlmResult, "llm")
        if io.spoke(call.request, result):
            self._speaking[call.corr_id] = loop.run_in_executor(None, _last, responses, self.finished)
        else:  # its final flag came with the result: the iterator ends at once
            await loop.run_in_executor(None, _drain, responses, self.finished)
        return result

    async def speech(self, corr_id: int) -> io.TtsResult | io.VoicedSpeech:
        with tracing.stage_span("tts"):
            response = await self._speaking.pop(corr_id)
        return _spoken(response, self.voiced)

    async def speak(self, call: StageCall[io.TtsRequest], voice: io.Token2WavRequest | None = None
                    ) -> io.TtsResult | io.VoicedSpeech:
        """A TTS chunk on the llm model's TTS (`tts_in_llm`), with token2wav's call for its codes where it runs there
        too (`voice`): no sequence flags (the session's llm sequence is live; its TTS and token2wav sequences are the
        llm model's to start and end)."""
        infer = self._infer("llm", call.request, io.output_names("llm"), StageCall(call.request, call.corr_id),
                            {io.SPEECH_CALL: True}, also=voice if self.voiced else None)
        with tracing.stage_span("tts"):
            response = await _answer(infer, True, self.finished)
        if response is not None and response.has_error():
            raise from_wire(response.error().message(), "tts")
        return _spoken(response, self.voiced)

    async def tts(self, call: StageCall[io.TtsRequest]) -> io.TtsResult:
        return await self._exec("tts", call.request, io.TtsResult, call)

    async def token2wav(self, call: StageCall[io.Token2WavRequest]) -> io.Token2WavResult:
        return await self._exec("token2wav", call.request, io.Token2WavResult, call)

"""Bounded work and memory that returns in the stages: many images are encoded in bounded requests, stage state
made at START is freed on every refusal path, and an END reaches every started stage, whichever of them fails."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest

from minicpmo_triton.duplex_contract import StepEvent, StepInput
from minicpmo_triton.errors import StepError
from minicpmo_triton.media.tokenizer import ByteTokenizer
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.rules.image_prompt import CHAT
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import DuplexPipeline, DuplexSession
from minicpmo_triton.stage_io import LlmRequest
from minicpmo_triton.stages.base import StageCall

from .conftest import MODEL_REPOSITORY, ensure_exported
from .helpers import append_message, init_message

LONG_PROMPT = "A very long system prompt. " * 400  # ~11,000 tokens: past the 8192-token context


@pytest.fixture(scope="module")
def stages() -> InProcessStages:
    ensure_exported()
    return InProcessStages(MODEL_REPOSITORY)


async def test_a_refused_first_step_leaves_no_stage_state(stages: InProcessStages) -> None:
    """`context_full` at the first LLM call: the LLM state its START made is gone at once, not at the TTL."""
    pipeline = stages.pipeline()
    before = stages.llm_stage.live_sequences
    options = DuplexOptions.from_config({"system_prompt": LONG_PROMPT})

    async def emit(event: StepEvent) -> None:
        pass

    with pytest.raises(StepError) as info:
        await pipeline.step(41, True, False, StepInput(audio=np.zeros(16_000, np.float32), options=options), emit)
    assert info.value.code == "context_full"
    assert stages.llm_stage.live_sequences == before
    await pipeline.step(41, False, True, StepInput(), emit)  # the session's END: nothing left to free
    assert 41 not in pipeline.sessions


def test_an_end_for_state_that_is_gone_frees_nothing_and_fails_nothing(stages: InProcessStages) -> None:
    [result] = stages.llm_stage.run([StageCall(LlmRequest(decode=False), 4242, end=True)])
    assert not isinstance(result, Exception), result


class VisionRecorder:
    """A vision stage that records how many images each request brings."""

    def __init__(self, stages: InProcessStages) -> None:
        self.stages = stages
        self.sizes: list[int] = []

    async def vision_encoder(self, request):
        self.sizes.append(len(request.images))
        return await self.stages.vision_encoder(request)


async def test_many_images_are_encoded_in_bounded_requests(stages: InProcessStages) -> None:
    """The shared vision encoder takes a message's images a few at a time: other sessions' frames go between."""
    from PIL import Image

    frames = []
    for shade in range(10):
        buf = io.BytesIO()
        Image.new("RGB", (64 + shade, 48), (20 * shade, 30, 30)).save(buf, format="PNG")
        frames.append(buf.getvalue())
    recorder = VisionRecorder(stages)
    pipeline = DuplexPipeline(recorder, stages.preset, stages.tokenizer, 600.0)
    ids, embeds, slices = await pipeline._vision(frames, [1] * 10, CHAT)
    assert recorder.sizes == [4, 4, 2] and len(ids) == 10 and slices == 10
    alone = [await pipeline._vision([f], [1], CHAT, i) for i, f in enumerate(frames)]
    assert ids == [a[0][0] for a in alone]  # numbered on across requests, as in one
    np.testing.assert_allclose(embeds, np.concatenate([a[1] for a in alone]), atol=1e-5)


class EndRecorder:
    """Stages that record the ENDs they get; the LLM's END fails."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    async def _end(self, stage: str, call: StageCall) -> None:
        assert call.end
        self.ended.append(stage)
        if stage == "llm":
            raise StepError("stage_error", "llm: the END failed")

    async def llm(self, call: StageCall, ready=None) -> None:
        await self._end("llm", call)

    async def tts(self, call: StageCall) -> None:
        await self._end("tts", call)

    async def token2wav(self, call: StageCall) -> None:
        await self._end("token2wav", call)


async def test_a_failing_end_still_reaches_every_later_stage(stages: InProcessStages) -> None:
    recorder = EndRecorder()
    pipeline = DuplexPipeline(recorder, stages.preset, ByteTokenizer(), 600.0)
    state = DuplexSession(DuplexOptions(), ByteTokenizer().decoder(), started={"llm", "tts", "token2wav"})
    pipeline.sessions.start(7, state)
    with pytest.raises(StepError):
        await pipeline.end(7, state)
    assert recorder.ended == ["llm", "tts", "token2wav"] and not state.started


async def test_refused_sessions_leave_no_live_sequences(gateway_factory, triton) -> None:
    """Over the real servers: sessions whose first step is refused `context_full` (the prompt bound raised past
    the context, as an operator may) end with no stage state left behind."""
    import websockets

    gw = gateway_factory(max_prompt_bytes="20000")
    second = np.zeros(16_000, np.float32)
    for i in range(3):
        async with websockets.connect(gw.ws, max_size=1 << 24) as ws:
            await ws.send(init_message(system_prompt=LONG_PROMPT))
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(append_message(second, f"in_{i}"))
            async with asyncio.timeout(30):
                while (ev := json.loads(await ws.recv()))["type"] != "session.closed":
                    pass
            assert ev["reason"] == "context_full", ev
    live = await asyncio.to_thread(triton.wait_live, lambda lv: not any(lv.values()), 10)
    assert not any(live.values()), live  # not one llm state waiting for its 600 s TTL


class HeldLlm:
    """The in-process stages, recording each stage call in order; the first LLM call waits for `go`."""

    def __init__(self, stages: InProcessStages) -> None:
        self.stages = stages
        self.calls: list[str] = []
        self.entered, self.go = asyncio.Event(), asyncio.Event()

    def __getattr__(self, stage: str):
        inner = getattr(self.stages, stage)

        async def call(request, *args, **kwargs):
            end = isinstance(request, StageCall) and request.end
            self.calls.append(f"{stage} END" if end else stage)
            if stage == "llm" and not end and not self.entered.is_set():
                self.entered.set()
                await self.go.wait()
            return await inner(request, *args, **kwargs)
        return call


async def test_an_end_that_comes_during_a_step_waits_for_it(stages: InProcessStages) -> None:
    """The entry model keeps a session to one step at a time for any caller (`DuplexSession.lock`): an END that
    comes while the session's step still runs (the gateway's close after it stopped reading that step, an orphan's
    END from another connection) is carried out after the step, never beside it."""
    held = HeldLlm(stages)
    pipeline = DuplexPipeline(held, stages.preset, stages.tokenizer, 600.0)

    async def emit(event: StepEvent) -> None:
        pass

    step = asyncio.create_task(pipeline.step(43, True, False, StepInput(audio=np.zeros(16_000, np.float32)), emit))
    await asyncio.wait_for(held.entered.wait(), 30)
    end = asyncio.create_task(pipeline.step(43, False, True, StepInput(), emit))
    await asyncio.sleep(0.2)  # the END has come: it waits
    assert not end.done() and not any(c.endswith("END") for c in held.calls), held.calls
    held.go.set()
    await asyncio.wait_for(asyncio.gather(step, end), 60)
    ends = [i for i, c in enumerate(held.calls) if c.endswith("END")]
    assert ends and min(ends) > max(i for i, c in enumerate(held.calls) if not c.endswith("END")), held.calls
    assert 43 not in pipeline.sessions

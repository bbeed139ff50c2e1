"""Over the real servers, the duplex audio stream's Whisper on its paged encoder (`audio_engine=paged`, on the CPU
here), with the LLM on ONNX and on its paged in-flight engine: the llm model loads it from the export's weights, a
conversation's greedy text is the one the stream.onnx graph gives (the session-wide server), and the sessions
leave no stage state behind."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch  # noqa: F401 (the llm model serves the paged encoder, torch, in tritonserver: the torch-less subset leaves this module out)

from minicpmo_client.backend import converse

from .conftest import RunningTriton, start_gateway, stop_gateway, triton_with
from .helpers import GREEDY, SPEAKING_TEXT, deltas

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.engines]  # engines: a .ci/run step of its own


@pytest.fixture(scope="module", params=["onnx", "paged"], ids=["llm-onnx", "llm-paged-inflight"])
def paged_whisper_triton(request: pytest.FixtureRequest,
                         tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """The paged Whisper beside the LLM on ONNX (execute() encodes), and on the paged engine (its in-flight loop
    encodes the admitted rows' audio)."""
    env = {"MINICPMO_AUDIO_ENGINE": "paged", "MINICPMO_LLM_ENGINE": request.param}
    yield from triton_with(env, tmp_path_factory.mktemp("triton_paged_whisper"))


async def _text(endpoint: str, audio, log) -> str:
    gw = start_gateway(endpoint, log)
    try:
        result = await converse(gw.ws, audio, realtime=False, config=GREEDY)
    finally:
        stop_gateway(gw)
    assert not [e for e in result.events if e.get("type") == "error"], result.events
    return "".join(e.get("text", "") for e in deltas(result.events, "text"))


async def test_the_paged_whisper_hears_as_the_graph_does(paged_whisper_triton, triton, speech, tmp_path) -> None:
    audio = speech(SPEAKING_TEXT)
    audio = audio[: min(6, len(audio) // 16_000) * 16_000]
    paged = await _text(paged_whisper_triton.endpoint, audio, tmp_path / "paged.log")
    graph = await _text(triton.endpoint, audio, tmp_path / "graph.log")
    print(f"greedy text: {paged!r}")
    assert paged == graph
    live = await asyncio.to_thread(paged_whisper_triton.wait_live, lambda lv: not any(lv.values()), 10)
    assert not any(live.values()), live

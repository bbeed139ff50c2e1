"""Over the real servers, the TTS on its paged engine (`tts_engine=paged`, on the CPU here): the tts model loads
it from the export's weights and a spoken reply comes as one-second audio deltas, 25 speech tokens each."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch  # noqa: F401 (the tts model serves the paged engine, torch, in tritonserver: the torch-less subset leaves this module out)

from gateway.audio import decode_f32_base64
from minicpmo_client.backend import converse

from .conftest import RunningTriton, start_gateway, stop_gateway, triton_with
from .helpers import GREEDY, SPEAKING_TEXT, deltas

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture(scope="module")
def paged_tts_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with({"MINICPMO_TTS_ENGINE": "paged"}, tmp_path_factory.mktemp("triton_paged_tts"))


async def test_the_paged_tts_speaks_over_triton(paged_tts_triton, speech, tmp_path) -> None:
    gw = start_gateway(paged_tts_triton.endpoint, tmp_path / "gateway.log")
    try:
        audio = speech(SPEAKING_TEXT)
        result = await converse(gw.ws, audio[: min(8, len(audio) // 16_000) * 16_000], realtime=False,
                                config=GREEDY)
    finally:
        stop_gateway(gw)
    spoken = deltas(result.events, "audio")
    assert spoken, "the tiny model speaks on this input"
    for ev in spoken:
        wav = decode_f32_base64(ev["audio"], 1 << 30)
        assert len(wav) == ev["audio_samples"] == 24_000 and np.isfinite(wav).all()
    usage = [e["usage"] for e in result.events if "usage" in e]
    assert usage[-1]["output_speech_tokens"] == 25 * len(spoken)

"""Over the real servers, the TTS on its paged engine (`tts_engine=paged`, on the CPU here): the tts model loads
it from the export's weights and a spoken reply comes as one-second audio deltas, 25 speech tokens each. The `tts`
model is decoupled there, with one engine thread (`InflightTts`): called directly over gRPC, two sessions speaking
at once say what each says alone, END mid-turn gives the session's blocks back (the `minicpmo_<model>_kv_free_blocks`
gauge), and a call refused at the door fails alone beside a row that decodes on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import torch  # noqa: F401 (the tts model serves the paged engine, torch, in tritonserver: the torch-less subset leaves this module out)
import tritonclient.grpc.aio as grpcclient

from gateway.audio import decode_f32_base64
from minicpmo_client.backend import converse
from minicpmo_triton.errors import from_wire
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import TtsRequest, TtsResult

from .conftest import MODEL_REPOSITORY, RunningTriton, start_gateway, stop_gateway, triton_with
from .helpers import GREEDY, SPEAKING_TEXT, deltas
from .test_isolation_e2e import stage_call

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.engines]  # engines: a .ci/run step of its own


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


def turn(texts: int, n_tokens: int, seed: int, **kw: object) -> list[TtsRequest]:
    """A turn of three chunks (its start resets the cache, its end drops it), one session's inputs."""
    preset = load_stage_config(MODEL_REPOSITORY / "tts" / "1")
    rng = np.random.default_rng(seed)
    flags = [{"turn_start": True}, {}, {"turn_end": True}]
    return [TtsRequest(text_ids=rng.integers(0, preset.tts.num_text_tokens, texts).astype(np.int64),
                       tts_hidden=rng.standard_normal((texts, preset.llm.hidden)).astype(np.float32),
                       n_tokens=n_tokens, seed=seed, **f, **kw) for f in flags]  # type: ignore[arg-type]


def spoken(result: TtsResult | Exception) -> list[int]:
    assert isinstance(result, TtsResult), result
    return result.speech_tokens.tolist()




async def test_two_sessions_in_flight_speak_as_each_alone(paged_tts_triton) -> None:
    # a greedy session of 25-code chunks and a sampled one of 10-code chunks (rows finish at different iterations)
    sessions = {1: turn(9, 25, 11, temperature=0.0), 2: turn(3, 10, 12)}
    client = grpcclient.InferenceServerClient(paged_tts_triton.grpc_url)
    try:
        alone = {}
        for s, chunks in sessions.items():
            alone[s] = [spoken(await stage_call(client, "tts", req, 100 + s, start=i == 0, end=i == len(chunks) - 1))
                        for i, req in enumerate(chunks)]
        for i in range(3):
            both = await asyncio.gather(*(stage_call(client, "tts", chunks[i], 200 + s, start=i == 0, end=i == 2)
                                          for s, chunks in sessions.items()))
            for s, result in zip(sessions, both, strict=True):
                assert spoken(result) == alone[s][i], (s, i)
        assert [len(c) for c in alone[1]] == [25] * 3 and [len(c) for c in alone[2]] == [10] * 3
    finally:
        await client.close()


async def test_end_mid_turn_gives_the_sessions_blocks_back(paged_tts_triton) -> None:
    client = grpcclient.InferenceServerClient(paged_tts_triton.grpc_url)
    free_blocks = lambda: asyncio.to_thread(paged_tts_triton.stage_metric, "kv_free_blocks", "tts")  # noqa: E731
    try:
        free = await free_blocks()
        first, second, _ = turn(4, 25, 21, temperature=0.0)
        spoken(await stage_call(client, "tts", first, 301, start=True))
        spoken(await stage_call(client, "tts", second, 301))
        assert await free_blocks() < free  # mid-turn: the turn's cache is held
        spoken(await stage_call(client, "tts", second, 301, end=True))  # END with the turn still open
        assert await free_blocks() == free
    finally:
        await client.close()


async def test_a_refused_call_fails_alone_beside_a_row_that_decodes(paged_tts_triton) -> None:
    """A call with a text id past the vocabulary is refused at its admission (`invalid_input`) while another
    session's long chunk decodes in the loop; that chunk's codes are what it speaks alone."""
    client = grpcclient.InferenceServerClient(paged_tts_triton.grpc_url)
    try:
        long = turn(5, 200, 31, temperature=0.0)[0]
        alone = spoken(await stage_call(client, "tts", long, 401, start=True, end=True))
        talking = asyncio.create_task(stage_call(client, "tts", long, 402, start=True, end=True))
        bad = turn(2, 25, 32)[0]
        bad.text_ids[0] = 1 << 40
        refused = await stage_call(client, "tts", bad, 403, start=True, end=True)
        assert isinstance(refused, Exception) and from_wire(refused.message(), "tts").code == "invalid_input", refused
        assert spoken(await talking) == alone
    finally:
        await client.close()

"""Over real servers, token2wav in the llm model's process too (`token2wav_in_llm`, forced on the CPU, token2wav on its
device path in both servers, as a GPU would place it): a speaking duplex step is ONE llm request, its text then its
audio on the same stream, where the two-request path (`tts_in_llm` alone) sends the codes on to the token2wav model;
the caller hears and reads exactly what that path says (greedy). A turn-based reply's voice, its reference changed
mid-session, too. The session's END frees its LLM, TTS and token2wav state in the llm model (gauges back to 0); the
token2wav model serves nothing.

Hops are counted from Triton's own `nv_inference_request_success` per model, before and after the conversation."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch  # noqa: F401 (the llm model serves the paged engine, torch, in tritonserver: the torch-less subset leaves this module out)

from .conftest import MODEL_REPOSITORY, RunningTriton, triton_with
from .helpers import deltas
from .test_one_request_e2e import says_the_same, voiced_chat

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.engines]  # engines: a .ci/run step of its own

DEVICE = {"MINICPMO_LLM_ENGINE": "paged", "MINICPMO_TTS_ENGINE": "paged", "MINICPMO_TTS_IN_LLM": "1"}  # on the CPU
AUTO = '{ key: "stage_engine" value: { string_value: "auto" } }'
ON_DEVICE = '{ key: "stage_engine" value: { string_value: "device" } }'


def device_token2wav(folder: Path, in_llm: bool) -> Path:
    """A copy of the exported repository whose token2wav runs its device path (the encoders keep theirs: on the CPU
    `device` would be TensorRT plans): in the token2wav model, or in the llm model (its config's `stage_engine`)."""
    repository = folder / "models"
    shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
    config = repository / "token2wav" / "config.pbtxt"
    config.write_text(config.read_text().replace(AUTO, ON_DEVICE))
    if in_llm:
        config = repository / "llm" / "config.pbtxt"
        config.write_text(config.read_text().replace("parameters [\n", f"parameters [\n  {ON_DEVICE},\n"))
    return repository


@pytest.fixture(scope="module")
def two_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """The two-request path: the TTS in the llm model, token2wav a hop of its own."""
    folder = tmp_path_factory.mktemp("voice_two")
    yield from triton_with({**DEVICE, "MINICPMO_TOKEN2WAV_IN_LLM": "0"}, folder, device_token2wav(folder, False))


@pytest.fixture(scope="module")
def one_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    folder = tmp_path_factory.mktemp("voice_one")
    yield from triton_with({**DEVICE, "MINICPMO_TOKEN2WAV_IN_LLM": "1"}, folder, device_token2wav(folder, True))


async def gauges(triton: RunningTriton) -> dict[str, float]:
    """The llm model's live sessions on each of its stages."""
    names = {"llm": ("live_sequences", "llm"), "tts": ("tts_live_sequences", "llm"),
             "token2wav": ("token2wav_live_sequences", "llm")}
    return {k: await asyncio.to_thread(triton.stage_metric, *v) for k, v in names.items()}


async def test_a_speaking_step_is_one_request_and_says_what_two_requests_say(two_triton, one_triton, speech,
                                                                             tmp_path) -> None:
    before, two, after, one = await says_the_same(speech, tmp_path, two_triton, one_triton)
    speaking = two["token2wav"] - 1  # each voiced step once, and the session's END
    assert speaking >= 2 and two["tts"] == 0, two
    # the same llm requests (one per step, the END), and none to token2wav: one request per speaking step
    assert one == {"llm": two["llm"], "tts": 0, "token2wav": 0}, (one, two)
    usage = lambda r: [e["chunk_usage"] for e in r.events if e.get("chunk_usage")]  # noqa: E731
    assert usage(after) == usage(before), "the speech codes counted as before"
    # the END freed the session's LLM, TTS and token2wav state in the llm model
    assert await gauges(one_triton) == {"llm": 0, "tts": 0, "token2wav": 0}
    assert await asyncio.to_thread(one_triton.stage_metric, "live_sequences", "token2wav") == 0


async def test_a_voice_set_mid_session_changes_the_voice_as_on_two_requests(two_triton, one_triton, speech,
                                                                            tmp_path) -> None:
    ref = speech("This is how I sound when I speak.", voice="en+f3")[: 2 * 16_000]
    # the session's voice, a reference of its own for the second reply (set mid-session), the session's again
    before, two = await voiced_chat(two_triton, tmp_path / "gateway_two.log", (None, ref, None), 20)
    after, one = await voiced_chat(one_triton, tmp_path / "gateway_one.log", (None, ref, None), 20)
    assert [e["type"] for e in before if e["type"] != "response.output.delta"].count("response.done") == 3, before
    said = lambda events: ([(e["input_id"], e["text"]) for e in deltas(events, "text")],  # noqa: E731
                           [(e["input_id"], e["audio"]) for e in deltas(events, "audio")])
    assert said(after) == said(before), "the same words and the same voices, turn by turn, sample for sample"
    audio = {e["input_id"] for e in deltas(before, "audio")}
    assert audio == {"t0", "t1", "t2"}, audio
    assert two["token2wav"] >= 3 and one["token2wav"] == 0 and one["tts"] == 0, (two, one)
    # each of the token2wav model's calls rode in a TTS call to the llm model, but its END: the llm's END ends it
    assert one["llm"] == two["llm"], (one, two)
    assert await gauges(one_triton) == {"llm": 0, "tts": 0, "token2wav": 0}

"""A checkpoint folder in MiniCPM-o 4.5's published layout, built from the reference modules, exported with
`python -m export --preset minicpm-o-4.5 --checkpoint DIR` into a model repository of its own, served by a
real tritonserver behind a real gateway: duplex steps with the real special-token ids and tokenizer."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from export.checkpoint import TOKEN2WAV_ASSETS
from export.presets import MINICPMO45_TOKENS
from gateway.triton import TritonServer, free_ports
from minicpmo_client.backend import converse
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import StepEvent, StepInput

from .conftest import MODEL_REPOSITORY, REPO, RunningGateway, RunningTriton, start_gateway, stop_gateway
from .helpers import GREEDY, SPEAKING_TEXT, default_ref_tokens, deltas, transcript
from .reference_checkpoint import to_1_0_7_layout, write_checkpoint

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.checkpoints]  # .ci/run step
CHUNKS = 5


@pytest.fixture(scope="module", params=["1.0.5", "1.0.7"])
def real_repository(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tracked model repository (configs, model.py) with the real preset's artefacts exported into it; its
    assets/token2wav in minicpmo-utils 1.0.5's layout, or 1.0.7's (a causal vocoder the stage runs in torch)."""
    ckpt = write_checkpoint(tmp_path_factory.mktemp("reference_ckpt")).folder
    if request.param == "1.0.7":
        to_1_0_7_layout(ckpt / TOKEN2WAV_ASSETS)
    repo = tmp_path_factory.mktemp("real") / "model_repository"
    shutil.copytree(MODEL_REPOSITORY, repo, ignore=shutil.ignore_patterns(
        "model.onnx*", "*.plan", "stage.json", "tokenizer", "__pycache__"))
    done = subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5", "--checkpoint", str(ckpt),
                           "--model-repository", str(repo)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (repo / "token2wav" / "1" / "causal_vocoder").is_dir() == (request.param == "1.0.7")
    return repo


@pytest.fixture(scope="module")
def real_server(real_repository: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[RunningTriton, RunningGateway]]:
    logs = tmp_path_factory.mktemp("real_triton")
    server = TritonServer(real_repository, free_ports(), work_dir=logs / "work", log_path=logs / "tritonserver.log")
    server.start()
    try:
        server.wait_ready(240)
        triton = RunningTriton(server)
        gateway = start_gateway(triton.grpc_url, logs / "gateway.log")
        try:
            yield triton, gateway
        finally:
            stop_gateway(gateway)
    finally:
        server.stop()


async def test_the_real_layout_serves_duplex_steps(real_repository, real_server, speech) -> None:
    triton, gateway = real_server
    preset = load_stage_config(real_repository / "duplex" / "1")
    assert preset.name == "minicpm-o-4.5" and preset.tokens == MINICPMO45_TOKENS and preset.llm.vocab == 151_748
    audio = speech(SPEAKING_TEXT)[: CHUNKS * 16_000]
    served = await converse(gateway.ws, audio, realtime=False, config=GREEDY)
    steps = deltas(served.events)
    assert {e["input_id"] for e in steps} == {f"in_{i}" for i in range(CHUNKS)}  # every step answered
    assert [e["kind"] for e in steps[:3]] == ["listen"] * 3  # force_listen_count, as MiniCPM-o does
    usage = [e["usage"] for e in served.events if "usage" in e]
    # the checkpoint's own assets/system_ref_audio.wav is the system prompt's default voice reference
    assert usage[-1]["input_audio_tokens"] == 10 * CHUNKS + default_ref_tokens(real_repository) > 10 * CHUNKS
    assert usage[0]["input_text_tokens"] > 0  # the system prompt through the checkpoint's tokenizer
    spoken = deltas(served.events, "audio")
    assert spoken, "greedy on this fixture the model speaks: the TTS and token2wav serve too"
    assert usage[-1]["output_speech_tokens"] == 25 * len(spoken)  # 25 + 1 sampled, 25 kept per chunk
    assert triton.wait_live(lambda lv: not any(lv.values())) == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}

    # The same steps through the same artefacts in process: Triton's path changes nothing.
    stages = InProcessStages(real_repository)
    pipeline = stages.pipeline()
    events: list[tuple[int, StepEvent]] = []
    options = DuplexOptions.from_config(GREEDY)
    for i in range(CHUNKS):
        async def emit(ev: StepEvent, i: int = i) -> None:
            events.append((i, ev))

        chunk = audio[i * 16_000:(i + 1) * 16_000]
        await pipeline.step(77, i == 0, i == CHUNKS - 1, StepInput(audio=chunk, options=options), emit)
    assert [(f"in_{i}", e.kind, e.text) for i, e in events] == transcript(served.events)
    print("real-layout transcript:", transcript(served.events))

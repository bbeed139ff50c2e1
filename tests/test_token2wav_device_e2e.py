"""Over a real tritonserver and gateway: token2wav on its device path (`stage_engine=device` in its config, which a
GPU instance gets from `auto`; here the CPU runs it: torch, ring caches, the in-flight loop) voices a reply; the
gateway's /health lists where each model runs; and a model asked to run where it cannot (an encoder's TensorRT
plan on a CPU instance) refuses to load with its code, which /health shows."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator

import pytest
import torch  # noqa: F401 (token2wav's device path runs torch in tritonserver: the torch-less subset leaves this out)
import tritonclient.grpc as grpcclient

import minicpmo_client as mc

from .conftest import MODEL_REPOSITORY, RunningGateway, RunningTriton, start_gateway, stop_gateway, triton_with
from .helpers import GREEDY

pytestmark = pytest.mark.engines  # a .ci/run step of its own
AUTO = '{ key: "stage_engine" value: { string_value: "auto" } }'
DEVICE = '{ key: "stage_engine" value: { string_value: "device" } }'


@pytest.fixture(scope="module")
def device_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    """A copy of the exported repository whose token2wav config says `stage_engine: device`."""
    folder = tmp_path_factory.mktemp("t2w_device")
    repository = folder / "models"
    shutil.copytree(MODEL_REPOSITORY, repository)
    config = repository / "token2wav" / "config.pbtxt"
    assert AUTO in config.read_text()
    config.write_text(config.read_text().replace(AUTO, DEVICE))
    yield from triton_with({}, folder, repository)


@pytest.fixture(scope="module")
def device_gateway(device_triton: RunningTriton, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[RunningGateway]:
    gw = start_gateway(device_triton.endpoint, tmp_path_factory.mktemp("gateway") / "gateway.log")
    yield gw
    stop_gateway(gw)


def devices(gw: RunningGateway) -> dict[str, str]:
    [endpoint] = gw.health()["endpoints"]
    return endpoint["devices"]


@pytest.mark.asyncio(loop_scope="function")
async def test_a_reply_is_voiced_on_the_device_path_and_health_says_where(device_gateway: RunningGateway) -> None:
    s = await mc.connect(device_gateway.realtime, input_rate=16_000, session={**GREEDY, "max_output_tokens": 24},
                         turn_detection=None)
    await s.send_text("What will the weather be like tomorrow?")
    audio = 0
    async with asyncio.timeout(90):
        async for ev in s.converse():
            if isinstance(ev, mc.AudioChunk):
                audio += len(ev.pcm)
            if isinstance(ev, (mc.TurnFinal, mc.Error)):
                break
    await s.close()
    assert isinstance(ev, mc.TurnFinal) and ev.had_audio and audio > 24_000, ev
    listed = devices(device_gateway)
    assert listed["token2wav"] == "cpu (device path)"
    assert listed["audio_encoder"] == listed["vision_encoder"] == "cpu (onnxruntime)"
    assert {"llm", "tts"} <= listed.keys()


def test_a_model_that_cannot_run_where_it_is_asked_to_refuses_and_health_says_why(
        device_triton: RunningTriton, device_gateway: RunningGateway) -> None:
    """vision_encoder reloaded with `stage_engine: device` on this CPU instance: its TensorRT plan needs a GPU, so
    it refuses to load (nothing runs on the CPU instead), its reason coded; /health lists it. Last in this module:
    the server is not whole afterwards."""
    client = grpcclient.InferenceServerClient(device_triton.grpc_url)
    config = client.get_model_config("vision_encoder", as_json=True)["config"]
    config["parameters"]["stage_engine"]["string_value"] = "device"
    client.unload_model("vision_encoder")
    with pytest.raises(Exception, match=r"\[device_unavailable\]"):
        client.load_model("vision_encoder", config=json.dumps(config))
    deadline = time.monotonic() + 30
    while not devices(device_gateway).get("vision_encoder", "").startswith("not loaded"):  # the next probe's
        assert time.monotonic() < deadline, devices(device_gateway)
        time.sleep(0.5)
    why = devices(device_gateway)["vision_encoder"]
    assert why.startswith("not loaded: ") and "[device_unavailable] vision_encoder" in why, why
    assert "need a GPU instance" in why

"""A dead stage stub under a Triton the gateway did not start is healed by reloading its one model (Triton's model
control API, Triton in explicit mode, as `gateway.triton` starts it), by whichever gateway finds it first:

- one gateway in front of it: its session told `backend_unavailable`, the model reloaded, the same Triton;
- `gateway.serve --workers 2` in front of it: both workers find the stage broken, one reloads it (once), both are
  ready again;
- a Triton in another model control mode cannot be reloaded: the stage stays broken and /health says why;
- a Triton started with a control key takes model control calls only with it (the gateway's reload has it).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from gateway.triton import TritonServer, free_port, free_ports
from gateway.triton.reload import GRPC_CONTROL_HEADER

from .conftest import MODEL_REPOSITORY, REPO, RunningTriton, ensure_exported, start_gateway, stop_gateway
from .test_supervision import kill_stub_and_heal, stubs_of, wait_status

pytestmark = pytest.mark.healing  # .ci/run step of its own (pyproject's markers)


def start_triton(folder: Path, model_control: str) -> TritonServer:
    ensure_exported()
    server = TritonServer(MODEL_REPOSITORY, free_ports(), work_dir=folder / "work",
                          log_path=folder / "tritonserver.log", model_control=model_control)
    server.start()
    server.wait_ready(240)
    return server


@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    server = start_triton(tmp_path_factory.mktemp("explicit"), "explicit")
    yield server
    server.stop()


HEALTH = {"health_period_s": "0.5", "health_timeout_s": "3"}


def loads(server: TritonServer, model: str) -> int:
    assert server.log_path is not None
    return len(re.findall(rf'"loading: {model}:1"', server.log_path.read_text()))


async def test_an_external_triton_in_explicit_mode_is_healed_by_a_reload(explicit: TritonServer,
                                                                         tmp_path: Path) -> None:
    gw = start_gateway(explicit.ports.endpoint, tmp_path / "gateway.log", **HEALTH)
    try:
        before = loads(explicit, "llm")
        took_s = await kill_stub_and_heal(gw.port, explicit.pid, "llm")
        assert explicit.process is not None and explicit.process.poll() is None  # the same Triton
        assert loads(explicit, "llm") == before + 1
        assert 'minicpmo_gateway_heals_total{action="reload"} 1.0' in httpx.get(f"{gw.http}/metrics").text
        live = RunningTriton(explicit).wait_live(lambda lv: not any(lv.values()))
        assert not any(live.values()), live  # the told session's sequences ended in every stage
        print(f"kill -9 of the llm stub to a new session speaking: {took_s:.1f} s")
    finally:
        stop_gateway(gw)


async def test_with_two_workers_one_reloads_and_both_are_ready(explicit: TritonServer, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "workers.log"
    env = {**os.environ, **{f"MINICPMO_{k.upper()}": v for k, v in HEALTH.items()}}
    with open(log, "ab") as out:
        parent = subprocess.Popen(
            [sys.executable, "-m", "gateway.serve", "--workers", "2", "--port", str(port),
             "--triton-url", explicit.ports.endpoint], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    own = (port + 1, port + 2)
    try:
        for p in own:
            wait_status(p, "ready", 60)
        before = loads(explicit, "tts")
        await kill_stub_and_heal(port, explicit.pid, "tts", ports=own)
        assert loads(explicit, "tts") == before + 1, log.read_text()[-3000:]  # one reload, not one per worker
        assert len(stubs_of(explicit.pid, "tts")) == 1
        # the reload counted once, by the worker that made it, in the exposition every worker answers for both
        assert 'minicpmo_gateway_heals_total{action="reload"} 1.0' in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        live = RunningTriton(explicit).wait_live(lambda lv: not any(lv.values()))
        assert not any(live.values()), live
        text = log.read_text()
        assert text.count("reloading the broken model tts") == 1, text[-3000:]
        assert "Traceback" not in text
    finally:
        parent.terminate()
        parent.wait(timeout=60)


def test_a_triton_in_another_mode_stays_broken_and_health_says_why(tmp_path: Path) -> None:
    server = start_triton(tmp_path, "none")
    gw = start_gateway(server.ports.endpoint, tmp_path / "gateway.log", **HEALTH)
    try:
        os.kill(stubs_of(server.pid, "audio_encoder")[0], signal.SIGKILL)
        wait_status(gw.port, "loading", 10)
        deadline = time.monotonic() + 20
        why, body = "", {}
        while "not healed" not in why and time.monotonic() < deadline:
            body = httpx.get(f"{gw.http}/health", timeout=5).json()
            why = body["endpoints"][0]["stages_why"]
        assert body["backend_state"] == "broken" and "not healed" in why and "explicit" in why, body
        assert loads(server, "audio_encoder") == 1  # never reloaded
    finally:
        stop_gateway(gw)
        server.stop()


def test_with_a_control_key_only_its_holder_may_unload_a_model(tmp_path: Path) -> None:
    """Explicit mode opens Triton's model control API to whoever reaches its ports; with a control key (what
    gateway.serve gives the Triton it starts) a call without it is refused, and the gateway's, with it, heals."""
    ensure_exported()
    server = TritonServer(MODEL_REPOSITORY, free_ports(), work_dir=tmp_path / "work",
                          log_path=tmp_path / "tritonserver.log", control_key="k3y")
    server.start()
    server.wait_ready(240)
    gw = start_gateway(server.ports.endpoint, tmp_path / "gateway.log", triton_control_key="k3y", **HEALTH)
    try:
        client = grpcclient.InferenceServerClient(server.ports.grpc_url)
        for headers in (None, {GRPC_CONTROL_HEADER: "wrong"}):
            with pytest.raises(InferenceServerException):
                client.unload_model("llm", headers=headers)
        assert client.is_model_ready("llm")
        asyncio.run(kill_stub_and_heal(gw.port, server.pid, "llm"))  # the gateway's reload, with the key
        assert loads(server, "llm") == 2
    finally:
        stop_gateway(gw)
        server.stop()

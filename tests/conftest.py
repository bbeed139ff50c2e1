"""Real processes: one tritonserver on free ports for the whole run, gateways in front of it, espeak-ng speech."""

from __future__ import annotations

import ast
import functools
import importlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.audio import read_wav
from gateway.triton import TritonServer, free_port, free_ports

REPO = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO / "model_repository"


# MINICPMO_TEST_SUBSET=installed (CI's run on the container's Python, .ci/python_subset.sh): a test module whose
# imports are not installed there (torch, playwright) is left out, a test importing one in its body skipped, not
# failed. Unset, every module is collected and every test runs: a missing package fails loudly.
SUBSET = os.environ.get("MINICPMO_TEST_SUBSET") == "installed"


def _imports(path: Path) -> set[str]:
    """The modules a test file imports at its top level, through the helpers beside it (`from .x import`)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level and node.module:
            sibling = path.parent / f"{node.module}.py"
            names |= _imports(sibling) if sibling.exists() else set()
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@functools.cache
def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not SUBSET or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    return True if not all(_importable(name) for name in _imports(collection_path)) else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """In that subset, a test that imports what is not installed there inside its body is skipped, named."""
    try:
        return (yield)
    except ModuleNotFoundError as exc:
        if SUBSET:
            pytest.skip(f"needs {exc.name}, not installed in this subset")
        raise


def ensure_exported() -> None:
    if not all((MODEL_REPOSITORY / path).exists()
               for path in ("llm/1/model.onnx", "audio_encoder/1/stream.onnx", "token2wav/1/campplus.onnx",
                            "duplex/1/default_ref_audio.wav", "llm/1/weights.safetensors",
                            "tts/1/weights.safetensors", "audio_encoder/1/weights.safetensors",
                            "token2wav/1/device_modules/flow.pt")):
        subprocess.run([sys.executable, "-m", "export", "--preset", "tiny"], cwd=REPO, check=True)


@pytest.fixture(scope="session")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], np.ndarray]:
    """Real speech from espeak-ng, as 16 kHz float32."""
    folder = tmp_path_factory.mktemp("speech")
    cache: dict[str, np.ndarray] = {}

    def make(text: str, voice: str = "en") -> np.ndarray:
        key = f"{voice}:{text}"
        if key not in cache:
            path = folder / f"{len(cache)}.wav"
            subprocess.run(["espeak-ng", "-v", voice, "-w", str(path), text], check=True, capture_output=True)
            cache[key] = read_wav(path)
        return cache[key]

    return make


class RunningTriton:
    def __init__(self, server: TritonServer, voices_dir: Path | None = None) -> None:
        self.server = server
        self.grpc_url = server.ports.grpc_url
        self.endpoint = server.ports.endpoint  # as the gateway lists it: with its metrics port
        self.voices_dir = voices_dir  # its named voices (MINICPMO_VOICES_DIR): tests write <name>.wav there

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.server.ports.metrics_url, timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str, model: str) -> float:
        """One of Triton's own series for a model (`nv_inference_count{model="llm",...}`)."""
        prefix = f'{name}{{model="{model}"'
        for line in self.metrics_text().splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} for {model} not on the metrics page")

    def stage_metric(self, what: str, model: str) -> float:
        """A stage's own series, `minicpmo_<model>_<what>` (minicpmo_triton/serving/triton_models.py stage_metric)."""
        name = f"minicpmo_{model}_{what}"
        for line in self.metrics_text().splitlines():
            if line.startswith(f"{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not on the metrics page")

    def live(self) -> dict[str, float]:
        return {m: self.stage_metric("live_sequences", m) for m in ("duplex", "llm", "tts", "token2wav")}

    def wait_live(self, expected: Callable[[dict[str, float]], bool], timeout_s: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        live = self.live()
        while not expected(live) and time.monotonic() < deadline:
            time.sleep(0.2)
            live = self.live()
        return live


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    ensure_exported()
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    voices = tmp_path_factory.mktemp("voices")
    server = TritonServer(MODEL_REPOSITORY, free_ports(), work_dir=log.parent / "work", log_path=log)
    saved = os.environ.get("MINICPMO_VOICES_DIR")
    os.environ["MINICPMO_VOICES_DIR"] = str(voices)  # tritonserver's environment is this process's
    try:
        server.start()
    finally:
        if saved is None:
            os.environ.pop("MINICPMO_VOICES_DIR")
        else:
            os.environ["MINICPMO_VOICES_DIR"] = saved
    try:
        server.wait_ready(240)
        yield RunningTriton(server, voices)
    finally:
        server.stop()


def triton_with(env: dict[str, str], folder: Path, repository: Path = MODEL_REPOSITORY) -> Iterator[RunningTriton]:
    """A tritonserver of its own, started with these MINICPMO_<KEY> settings in its environment (for a fixture),
    on `repository` (a copy of the exported one whose configs a test edits)."""
    ensure_exported()
    log = folder / "tritonserver.log"
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # tritonserver's environment is this process's
    server = TritonServer(repository, free_ports(), work_dir=folder / "work", log_path=log)
    try:
        server.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    try:
        server.wait_ready(240)
        yield RunningTriton(server, folder)
    finally:
        server.stop()


class RunningGateway:
    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process = process
        self.port = port
        self.http = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/backend"
        self.realtime = f"ws://127.0.0.1:{port}/v1/realtime"

    def health(self) -> dict:
        return httpx.get(f"{self.http}/health", timeout=5).json()


def start_gateway(triton_url: str, log: Path, wait_ready: bool = True, port: int | None = None,
                  **env: str) -> RunningGateway:
    port = port or free_port()
    environ = {**os.environ, **{f"MINICPMO_{k.upper()}": v for k, v in env.items()}}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.serve", "--triton-url", triton_url, "--port", str(port)],
            cwd=REPO, env=environ, stdout=out, stderr=subprocess.STDOUT)
    gw = RunningGateway(process, port)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited with {process.returncode}; see {log}")
        try:
            status = gw.health()["status"]
            if status == "ready" or (not wait_ready and status == "loading"):
                return gw
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise TimeoutError(f"gateway not ready; see {log}")


def stop_gateway(gw: RunningGateway) -> None:
    gw.process.terminate()
    try:
        gw.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        gw.process.kill()


@pytest.fixture(scope="session")
def gateway(triton: RunningTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    gw = start_gateway(triton.endpoint, tmp_path_factory.mktemp("gateway") / "gateway.log")
    yield gw
    stop_gateway(gw)


@pytest.fixture
def gateway_factory(triton: RunningTriton, tmp_path: Path) -> Iterator[Callable[..., RunningGateway]]:
    started: list[RunningGateway] = []

    def make(triton_url: str | None = None, wait_ready: bool = True, **env: str) -> RunningGateway:
        gw = start_gateway(triton_url or triton.endpoint, tmp_path / f"gateway{len(started)}.log", wait_ready, **env)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        stop_gateway(gw)

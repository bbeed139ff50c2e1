"""The voice-agent frameworks against a real gateway: tritonserver and the gateway run from the project's
`.venv` (`python -m gateway.serve`, its own free ports), the frameworks from `.venv-frameworks`
(`scripts/frameworks.sh` builds it from tests_frameworks/requirements.txt), the speech from espeak-ng.

Nothing here imports the project: the frameworks pin their own numpy, websockets, starlette.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.request
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
PROJECT_PYTHON = REPO / ".venv" / "bin" / "python"
API_KEY = "fw-test-key"  # the frameworks send it as `Authorization: Bearer`, as they do to OpenAI
RATE = 24_000  # OpenAI's audio/pcm rate, which every framework sends and expects
GREETING = "Greet the caller in one short sentence."
QUESTION = "Good morning. What will the weather be like tomorrow in Paris?"
INTERRUPTION = "Stop, stop. Wait a moment please, I have another question."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def realtime(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def errors_since(self, offset: int) -> list[str]:
        """The gateway's ERROR lines written after `offset` (a log size taken earlier): our bugs, not the client's."""
        with open(self.log, "rb") as f:
            f.seek(offset)
            return [line for line in f.read().decode(errors="replace").splitlines() if " ERROR " in line]

    def log_size(self) -> int:
        return self.log.stat().st_size


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """`python -m gateway.serve` from the project's .venv: tritonserver on the tiny model, then the gateway."""
    assert PROJECT_PYTHON.exists(), f"{PROJECT_PYTHON} is missing: run scripts/setup.sh first"
    folder = tmp_path_factory.mktemp("gateway")
    port, ports = _free_port(), ",".join(str(_free_port()) for _ in range(3))
    log = folder / "gateway.log"
    env = {**os.environ, "MINICPMO_API_KEYS": API_KEY}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(PROJECT_PYTHON), "-m", "gateway.serve", "--port", str(port), "--triton-ports", ports,
             "--triton-log", str(folder / "tritonserver.log")],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    gw = Gateway(process, port, log)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, f"the gateway exited ({process.returncode}): {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{gw.http}/health", timeout=5) as resp:
                    if b'"ready"' in resp.read():
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the gateway was not ready in 300 s: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield gw
    finally:
        process.send_signal(signal.SIGTERM)  # gateway.serve stops its tritonserver too
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], bytes]:
    """Real speech from espeak-ng as audio/pcm: 16-bit little-endian mono at 24 kHz."""
    folder = tmp_path_factory.mktemp("speech")

    def make(text: str) -> bytes:
        path = folder / f"{abs(hash(text))}.wav"
        subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32)
            rate = w.getframerate()
        n = len(pcm) * RATE // rate
        return np.interp(np.arange(n) * rate / RATE, np.arange(len(pcm)), pcm).astype(np.int16).tobytes()

    return make


def silence(seconds: float) -> bytes:
    return bytes(2 * int(seconds * RATE))


def chunks(pcm: bytes, ms: int = 100) -> list[bytes]:
    """Audio in pieces of `ms`, as a microphone delivers it."""
    step = 2 * RATE * ms // 1000
    return [pcm[i:i + step] for i in range(0, len(pcm), step)]


# ---- what a framework says went wrong ----

class ErrorLogs(logging.Handler):
    """ERROR records any framework logs (through the standard logging module) during one test."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}"[:600])


@dataclass
class Seen:
    """What one framework session reported, in order: (kind, detail). Kinds are the framework's own."""

    items: list[tuple[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # error events the framework surfaced
    dead: str | None = None  # why the framework will hear nothing more from the server, if it will not
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, kind: str, detail: Any = None) -> None:
        self.items.append((kind, detail))
        self.changed.set()

    def error(self, text: str) -> None:
        self.errors.append(text[:1500])
        self.changed.set()

    def end(self, why: str) -> None:
        self.dead = why
        self.changed.set()

    def count(self, kind: str) -> int:
        return sum(1 for k, _ in self.items if k == kind)

    async def until(self, what: str, predicate: Callable[[Seen], bool], timeout_s: float) -> None:
        """Wait until `predicate(self)`; on timeout fail, saying what was awaited and what the framework saw."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate(self):
            left = deadline - asyncio.get_running_loop().time()
            if self.dead:
                raise AssertionError(f"{what} cannot come: {self.dead}; its errors: {self.errors or 'none'}")
            if left <= 0:
                kinds = [k for k, _ in self.items]
                tail = ", ".join(kinds[-25:])
                raise AssertionError(f"waited {timeout_s:.0f} s for {what}; the framework saw {len(kinds)} events "
                                     f"(last: {tail}); its errors: {self.errors or 'none'}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass


@dataclass
class Clean:
    """The rule for every framework test: no error event, no ERROR log, no gateway ERROR."""

    logs: ErrorLogs
    gateway: Gateway
    offset: int
    allowed: dict[str, str] = field(default_factory=dict)  # text in a problem -> why it is not one

    def allow(self, text: str, why: str) -> None:
        self.allowed[text] = why

    def problems(self, seen: Seen) -> list[str]:
        found = ([f"error event: {e}" for e in seen.errors] + [f"ERROR log: {r}" for r in self.logs.records]
                 + [f"gateway ERROR: {line}" for line in self.gateway.errors_since(self.offset)])
        return [p for p in found if not any(text in p for text in self.allowed)]

    def check(self, seen: Seen) -> None:
        found = self.problems(seen)
        assert not found, "\n".join(["", *found])


@pytest.fixture
def clean(gateway: Gateway) -> Iterator[Clean]:
    handler = ErrorLogs()
    logging.getLogger().addHandler(handler)
    try:
        yield Clean(handler, gateway, gateway.log_size())
    finally:
        logging.getLogger().removeHandler(handler)

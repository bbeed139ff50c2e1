"""`python -m gateway.serve` keeps its tritonserver, and every stage in it (gateway/stage_health.py):

- kill -9 Triton: live sessions are told `backend_unavailable` (retryable, close 1013), /health says `loading`,
  the dead server's process group (its Python stubs) is gone with no zombie, and a new Triton is started;
  /health is `ready` again and new sessions work;
- stop Triton (SIGSTOP): /health is not ready within the health bound and live sessions are told
  `backend_unavailable`; once it runs again, /health is ready;
- kill -9 one stage's stub under a running Triton (what the OOM killer picks first): /health is not ready, live
  sessions are told `backend_unavailable`, that one model is reloaded (Triton's model control API; the same
  Triton, the dead stub's shared memory unlinked) and new sessions speak again.

One `gateway.serve` for the module (the tests run in order; the last one stops it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets

from gateway.triton import free_port, free_ports

from .conftest import REPO, ensure_exported
from .helpers import append_message, init_message, recv_until

pytestmark = pytest.mark.healing  # .ci/run step of its own (pyproject's markers)


def group(pgid: int) -> list[tuple[int, str, str]]:
    """(pid, state, command) of every process in a process group, zombies included."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm_end = stat.rindex(")")
        fields = stat[comm_end + 2:].split()
        if int(fields[2]) == pgid:  # state ppid pgrp ...
            found.append((int(entry.name), fields[0], stat[stat.index("(") + 1:comm_end]))
    return found


def regions(pgid: int) -> set[str]:
    """The /dev/shm regions the group's Python backend stubs were started with (an argument of theirs)."""
    return {name for pid, _, _ in group(pgid) for name in regions_of(pid)}


def left_in_shm(names: set[str]) -> list[str]:
    return sorted(n for n in names if (Path("/dev/shm") / n).exists())


def health(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()


def wait_status(port: int, status: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if health(port)["status"] == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"/health never said {status!r} in {timeout_s:.0f} s")


def triton_pid(log: Path) -> int:
    found = re.findall(r"tritonserver ready \(pid (\d+)\)", log.read_text())
    assert found, log.read_text()[-2000:]
    return int(found[-1])


HEALTH = {"MINICPMO_HEALTH_PERIOD_S": "0.5", "MINICPMO_HEALTH_TIMEOUT_S": "3"}  # not ready within ~4 s


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    ensure_exported()
    tmp_path = tmp_path_factory.mktemp("served")
    port, ports = free_port(), free_ports()
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.serve", "--port", str(port), "--triton-log", str(tmp_path / "triton.log"),
             "--triton-ports", f"{ports.http},{ports.grpc},{ports.metrics}"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **HEALTH})
    try:
        deadline = time.monotonic() + 300
        while "gateway on ws://" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        wait_status(port, "ready", 60)
        yield process, port, log
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


async def test_serve_restarts_a_triton_that_died(served) -> None:
    process, port, log = served
    first = triton_pid(log)
    assert any("triton_python_backend_stub" in cmd or "triton_python" in cmd for _, _, cmd in group(first)), \
        group(first)

    ws = await websockets.connect(f"ws://127.0.0.1:{port}/backend")
    await ws.send(init_message())
    assert json.loads(await ws.recv())["type"] == "session.created"
    shm = regions(first)
    assert len(shm) >= 6, shm  # a stub per model instance
    killed_at = time.monotonic()
    os.kill(first, signal.SIGKILL)

    events = []
    with pytest.raises(websockets.ConnectionClosed) as info:
        async with asyncio.timeout(20):  # the bound: the stream breaks at once; 20 s is generous
            while True:
                events.append(json.loads(await ws.recv()))
    told_after_s = time.monotonic() - killed_at
    errors = [e for e in events if e["type"] == "error"]
    assert errors and errors[0]["error"]["code"] == "backend_unavailable", events
    assert errors[0]["error"]["retryable"] is True
    assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "backend_unavailable", events
    assert info.value.rcvd.code == 1013

    await asyncio.to_thread(wait_status, port, "loading", 10)  # polled each second while ready
    await asyncio.to_thread(wait_status, port, "ready", 300)
    assert group(first) == [], group(first)  # no stub, no zombie of the dead server
    assert left_in_shm(shm) == []  # nor the stubs' shared memory (16 MiB of RAM each)
    second = triton_pid_from_log(log)
    assert second != first and group(second)
    text = log.read_text()
    assert f"tritonserver (pid {first}) exited with code -9" in text and "restarting in" in text
    assert "Traceback" not in text

    async with websockets.connect(f"ws://127.0.0.1:{port}/backend") as again:  # a new session works
        await again.send(init_message())
        assert json.loads(await again.recv())["type"] == "session.created"
    print(f"told backend_unavailable {told_after_s:.2f} s after kill -9")


async def told_unavailable(ws: websockets.ClientConnection, timeout_s: float) -> tuple[list[dict], int]:
    """What a session hears until the server closes it, and the close code."""
    events = []
    with pytest.raises(websockets.ConnectionClosed) as info:
        async with asyncio.timeout(timeout_s):
            while True:
                events.append(json.loads(await ws.recv()))
    errors = [e for e in events if e["type"] == "error"]
    assert errors and errors[0]["error"]["code"] == "backend_unavailable", events
    assert errors[0]["error"]["retryable"] is True and events[-1]["reason"] == "backend_unavailable", events
    return events, info.value.rcvd.code


async def not_ready_within(port: int, bound_s: float) -> float:
    started = time.monotonic()
    await asyncio.to_thread(wait_status, port, "loading", bound_s)
    return time.monotonic() - started


async def speaks(port: int) -> None:
    """A new session's first step runs every stage it needs: the LLM answers."""
    async with websockets.connect(f"ws://127.0.0.1:{port}/backend") as ws:
        await ws.send(init_message())
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(append_message(np.zeros(16_000, np.float32), "in_0"))
        events = await recv_until(ws, lambda e: e.get("chunk_usage") is not None or e["type"] == "error", 60)
        assert events[-1]["type"] == "response.output.delta", events


async def test_a_hung_triton_is_not_ready_and_its_sessions_are_told(served) -> None:
    process, port, log = served
    await asyncio.to_thread(wait_status, port, "ready", 300)
    pid = current_triton(log)
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/backend")
    await ws.send(init_message())
    assert json.loads(await ws.recv())["type"] == "session.created"
    os.kill(pid, signal.SIGSTOP)
    try:
        after_s = await not_ready_within(port, 10)
        _, code = await told_unavailable(ws, 30)
        assert code == 1013
        assert health(port)["backend_state"] == "unresponsive", health(port)  # the stages' own verdict, too
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.to_thread(wait_status, port, "ready", 60)
    print(f"/health not ready {after_s:.1f} s after SIGSTOP")
    await speaks(port)


async def test_a_dead_stage_stub_is_healed_by_reloading_its_model(served) -> None:
    process, port, log = served
    await asyncio.to_thread(wait_status, port, "ready", 300)
    triton = current_triton(log)
    took_s = await kill_stub_and_heal(port, triton, "llm")
    assert current_triton(log) == triton  # the same Triton: its other stages and their sessions' state untouched
    text = log.read_text()
    assert "reloading the broken model llm" in text and "restarting Triton" not in text, text[-3000:]
    assert "Traceback" not in text
    print(f"kill -9 of the llm stub to a new session speaking: {took_s:.1f} s (its model reloaded)")


DEAD_STUB_REGIONS: set[str] = set()


def wait_idle(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (active := health(port)["active_sessions"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert active == 0, health(port)


def stubs_of(pgid: int, model: str) -> list[int]:
    return [pid for pid, _, _ in group(pgid) if f"/{model}/" in Path(f"/proc/{pid}/cmdline").read_text()]


async def kill_stub_and_heal(port: int, triton: int, model: str, ports: tuple[int, ...] = ()) -> float:
    """kill -9 `model`'s stub under Triton `triton` with a session open on `port`: /health not ready, the session
    told `backend_unavailable`, then ready again (on `ports` too), the killed stub's shared memory unlinked, and a
    new session speaks. Returns the seconds from the kill to that."""
    stubs = stubs_of(triton, model)
    assert len(stubs) == 1, group(triton)
    killed_region = regions_of(stubs[0])
    assert len(killed_region) == 1, killed_region
    DEAD_STUB_REGIONS.update(killed_region)  # Triton keeps it mapped until it stops; then nothing may be left
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/backend")
    await ws.send(init_message())
    assert json.loads(await ws.recv())["type"] == "session.created"
    killed_at = time.monotonic()
    os.kill(stubs[0], signal.SIGKILL)
    await not_ready_within(port, 10)
    _, code = await told_unavailable(ws, 30)
    assert code == 1013
    for p in (port, *ports):
        await asyncio.to_thread(wait_status, p, "ready", 120)
    await speaks(port)
    took_s = time.monotonic() - killed_at
    for p in (port, *ports):  # every session ended once: the gateway holds no slot for the told one
        await asyncio.to_thread(wait_idle, p, 10)
    assert len([pid for pid in stubs_of(triton, model) if pid not in stubs]) == 1  # a new one in its place
    return took_s


def regions_of(pid: int) -> set[str]:
    with contextlib.suppress(OSError):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        return {a for a in args if a.startswith("triton_python_backend_shm_region_")}
    return set()


def test_a_clean_stop_leaves_nothing(served) -> None:
    process, port, log = served
    last = current_triton(log)
    shm = regions(last)
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    deadline = time.monotonic() + 5  # a stub that outlived its server is reparented to init, which reaps it
    while group(last) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group(last) == [], group(last)
    assert shm and DEAD_STUB_REGIONS and left_in_shm(shm | DEAD_STUB_REGIONS) == []


def triton_pid_from_log(log: Path) -> int:
    found = re.findall(r"tritonserver restarted \(pid (\d+)\)", log.read_text())
    assert found, log.read_text()[-3000:]
    return int(found[-1])


def current_triton(log: Path) -> int:
    found = re.findall(r"tritonserver (?:ready|restarted) \(pid (\d+)\)", log.read_text())
    assert found, log.read_text()[-3000:]
    return int(found[-1])

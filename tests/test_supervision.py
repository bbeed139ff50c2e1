"""`python -m gateway.serve` keeps its tritonserver, and every stage in it (gateway/stage_health.py):

- kill -9 Triton: live sessions are told `backend_unavailable` (retryable, close 1013), /health says `loading`,
  the dead server's process group (its Python stubs) is gone with no zombie, and a new Triton is started;
  /health is `ready` again and new sessions work;
- stop Triton (SIGSTOP): /health is not ready within the health bound and live sessions are told
  `backend_unavailable`; once it runs again, /health is ready;
- kill -9 one stage's stub under a running Triton (what the OOM killer picks first): /health is not ready, live
  sessions are told `backend_unavailable`, that one model is reloaded (Triton's model control API; the same
  Triton, the dead stub's shared memory unlinked) and new sessions speak again;
- sessions in flight when a stage dies, and new ones before /health knows, are told the retryable
  `backend_unavailable` (never 1011 `backend_error`); when the entry model's stub dies, its sessions' state in the
  other stages is freed at once (not by the 600 s TTL); a hung Triton's sessions are told within the failover bound
  and nothing of them is left live once it runs again;
- healing does not stop: a second stage dying during a reload, a reloaded stub dying again, and a stub killed while
  its model loads (Triton at `loading` forever: restarted at the heal deadline) all end healed.

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
from dataclasses import dataclass
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


HEALTH = {"MINICPMO_HEALTH_PERIOD_S": "0.5", "MINICPMO_HEALTH_TIMEOUT_S": "3",  # not ready within ~4 s
          # a load stuck for this long restarts Triton; every death here healed by a reload until then
          "MINICPMO_HEAL_DEADLINE_S": "15", "MINICPMO_RELOADS_BEFORE_RESTART": "20"}
FAILOVER_S = 5.0  # the default: a silent Triton's sessions are told within it and a probe period


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    metrics: int  # Triton's metrics port (the same for every Triton the supervisor starts)

    def __iter__(self):  # process, port, log = served
        return iter((self.process, self.port, self.log))

    def live(self) -> dict[str, float]:
        """Triton's live sequences per stateful model."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5).text
        found = dict.fromkeys(("duplex", "llm", "tts", "token2wav"), 0.0)
        for line in text.splitlines():
            for model in found:  # a stage's own series, minicpmo_<model>_live_sequences (triton_models.stage_metric)
                if line.startswith(f"minicpmo_{model}_live_sequences "):
                    found[model] = float(line.rsplit(" ", 1)[1])
        return found

    def wait_none_live(self, timeout_s: float = 20) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while any((live := self.live()).values()) and time.monotonic() < deadline:
            time.sleep(0.25)
        return live

    def since(self, mark: int) -> str:
        return self.log.read_text()[mark:]

    def mark(self) -> int:
        return len(self.log.read_text())


def as_in_a_terminal() -> None:
    """Ctrl-C's default, as a shell gives it (pytest-xdist's workers ignore SIGINT, and a child inherits that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **HEALTH}, preexec_fn=as_in_a_terminal)
    try:
        deadline = time.monotonic() + 300
        while "gateway on ws://" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        wait_status(port, "ready", 60)
        yield Served(process, port, log, ports.metrics)
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
    await ws.send(append_message(np.zeros(16_000, np.float32), "in_0"))  # state in the llm too
    await recv_until(ws, lambda e: e.get("chunk_usage") is not None, 30)
    assert served.live()["llm"] == 1
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        after_s = await not_ready_within(port, 10)
        _, code = await told_unavailable(ws, 30)
        told_s = time.monotonic() - stopped
        assert code == 1013
        # the documented bound: failover_s and a probe period (it waited 10 s more for an END a hung Triton never
        # answers, before closing)
        assert told_s < FAILOVER_S + 3, told_s
        assert health(port)["backend_state"] == "unresponsive", health(port)  # the stages' own verdict, too
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.to_thread(wait_status, port, "ready", 60)
    live = await asyncio.to_thread(served.wait_none_live)  # its sequences ENDed once Triton answered again
    assert not any(live.values()), live
    print(f"/health not ready {after_s:.1f} s after SIGSTOP, the session told after {told_s:.1f} s")
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


async def feeding(port: int) -> tuple[websockets.ClientConnection, asyncio.Task[None]]:
    """A session whose steps are always in flight: a second of audio sent every half second."""
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/backend")
    await ws.send(init_message())
    assert json.loads(await ws.recv())["type"] == "session.created"

    async def feed() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            for i in range(10_000):
                await ws.send(append_message(np.full(16_000, 0.01, np.float32), f"in_{i}"))
                await asyncio.sleep(0.5)

    return ws, asyncio.create_task(feed())


async def test_callers_in_flight_when_a_stage_dies_are_told_to_retry(served) -> None:
    """A step that meets the dead stub, and a session opened before /health knows, are told `backend_unavailable`
    (retryable, 1013): they used to get 1011 `backend_error`, as for a bug, for ~4 s after the death."""
    process, port, log = served
    await asyncio.to_thread(wait_status, port, "ready", 300)
    triton = current_triton(log)
    ws, feed = await feeding(port)
    await recv_until(ws, lambda e: e.get("chunk_usage") is not None, 30)
    [stub] = stubs_of(triton, "llm")  # the stage every step meets
    DEAD_STUB_REGIONS.update(regions_of(stub))
    os.kill(stub, signal.SIGKILL)
    late = await websockets.connect(f"ws://127.0.0.1:{port}/backend")  # before the health rounds call it broken
    await late.send(init_message())
    with contextlib.suppress(websockets.ConnectionClosed):
        if json.loads(await late.recv())["type"] == "session.created":
            await late.send(append_message(np.full(16_000, 0.01, np.float32), "in_0"))
    for sock in (ws, late):
        events = []
        with pytest.raises(websockets.ConnectionClosed) as info:
            async with asyncio.timeout(30):
                while True:
                    events.append(json.loads(await sock.recv()))
        told = [e["error"] for e in events if e["type"] == "error" and e["error"]["code"] != "input_backpressure"]
        assert told and told[-1]["code"] in ("backend_unavailable", "not_ready") and told[-1]["retryable"], told
        assert info.value.rcvd.code == 1013, (info.value.rcvd, told)
    feed.cancel()
    await asyncio.to_thread(wait_status, port, "ready", 120)
    await speaks(port)


async def test_the_entry_models_death_frees_its_sessions_state_in_every_stage(served) -> None:
    """kill -9 of the `duplex` stub: its sessions' llm (and tts, token2wav) state is freed at once, the gateway
    ENDing their sequences there itself; it used to wait for the stages' 600 s TTL."""
    process, port, log = served
    await asyncio.to_thread(wait_status, port, "ready", 300)
    triton = current_triton(log)
    sockets = [await websockets.connect(f"ws://127.0.0.1:{port}/backend") for _ in range(2)]
    for ws in sockets:
        await ws.send(init_message())
        assert json.loads(await ws.recv())["type"] == "session.created"
        await ws.send(append_message(np.zeros(16_000, np.float32), "in_0"))
        await recv_until(ws, lambda e: e.get("chunk_usage") is not None, 30)
    assert served.live()["llm"] == 2
    [stub] = stubs_of(triton, "duplex")
    DEAD_STUB_REGIONS.update(regions_of(stub))
    os.kill(stub, signal.SIGKILL)
    for ws in sockets:
        _, code = await told_unavailable(ws, 30)
        assert code == 1013
    live = await asyncio.to_thread(served.wait_none_live, 20)
    assert not any(live.values()), live
    await asyncio.to_thread(wait_status, port, "ready", 120)
    await speaks(port)


def wait_logged(served: Served, mark: int, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in served.since(mark):
        assert time.monotonic() < deadline, f"never logged {text!r}: {served.since(mark)[-2000:]}"
        time.sleep(0.05)


async def test_a_second_stage_dying_during_a_reload_is_healed(served) -> None:
    process, port, log = served
    await asyncio.to_thread(wait_status, port, "ready", 300)
    triton = current_triton(log)
    [llm], [tts] = stubs_of(triton, "llm"), stubs_of(triton, "tts")
    DEAD_STUB_REGIONS.update(regions_of(llm) | regions_of(tts))
    mark = served.mark()
    os.kill(llm, signal.SIGKILL)
    await asyncio.to_thread(wait_logged, served, mark, "reloading the broken model llm", 20)
    os.kill(tts, signal.SIGKILL)
    await asyncio.to_thread(wait_status, port, "ready", 120)  # it stayed broken, the episode's one heal spent
    await speaks(port)
    assert "reloading the broken model tts" in served.since(mark) and current_triton(log) == triton


async def kill_llm(served: Served) -> tuple[int, int, int]:
    """kill -9 of the `llm` stub of a ready endpoint: its Triton, the stub, where the log stood before."""
    await asyncio.to_thread(wait_status, served.port, "ready", 300)
    triton = current_triton(served.log)
    [first] = stubs_of(triton, "llm")
    DEAD_STUB_REGIONS.update(regions_of(first))
    mark = served.mark()
    os.kill(first, signal.SIGKILL)
    return triton, first, mark


async def test_a_reloaded_stub_that_dies_again_is_healed(served) -> None:
    process, port, log = served
    triton, first, mark = await kill_llm(served)
    await asyncio.to_thread(wait_logged, served, mark, "reloaded llm", 60)
    [second] = [pid for pid in stubs_of(triton, "llm") if pid != first]
    DEAD_STUB_REGIONS.update(regions_of(second))
    os.kill(second, signal.SIGKILL)  # before a round finds the endpoint ready: the same episode
    await asyncio.to_thread(wait_status, port, "ready", 120)
    await speaks(port)
    assert served.since(mark).count("reloading the broken model llm") == 2


async def test_a_stub_killed_while_its_model_loads_is_healed_by_a_new_triton(served) -> None:
    """Triton stays at `loading` forever, its load never answered: at the heal deadline (15 s here) the gateway gives
    the reload up and restarts the Triton it owns (it used to wait on the load with no deadline)."""
    process, port, log = served
    triton, first, mark = await kill_llm(served)
    await asyncio.to_thread(wait_logged, served, mark, "reloading the broken model llm", 20)
    deadline = time.monotonic() + 30
    while not (loading := [pid for pid in stubs_of(triton, "llm") if pid != first]):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    os.kill(loading[0], signal.SIGKILL)  # the new stub, while its model loads
    await asyncio.to_thread(wait_status, port, "ready", 180)
    await speaks(port)
    text = served.since(mark)
    assert "did not finish" in text and "restarting Triton" in text and current_triton(log) != triton, text[-3000:]


def test_a_clean_stop_leaves_nothing(served) -> None:
    process, port, log = served
    last = current_triton(log)
    shm = regions(last)
    mark = len(log.read_text())
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 128 + signal.SIGINT  # Ctrl-C's status, as SIGTERM's is 128 + 15
    assert "Traceback" not in log.read_text()[mark:], log.read_text()[mark:][-3000:]
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

"""How long a dead stage stub takes to heal: kill -9 the `llm` stub under `python -m gateway.serve` (which owns its
Triton) and time until a new session's first step is answered, healed by reloading the one model (the default) and
by restarting the whole Triton (MINICPMO_RELOADS_BEFORE_RESTART=0, what the gateway did before reloads).

    python bench/heal.py [--runs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import websockets
from common import ROOT

from gateway.audio import encode_f32_base64
from gateway.triton import free_port, free_ports

HEALTH = {"MINICPMO_HEALTH_PERIOD_S": "0.5", "MINICPMO_HEALTH_TIMEOUT_S": "3"}


def status(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["status"]
    except httpx.HTTPError:
        return "down"


def llm_stub(log: Path) -> int:
    triton = int(log.read_text().split("tritonserver ready (pid ")[1].split(")")[0])
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and os.getpgid(int(proc.name)) == triton and \
                "/llm/" in (proc / "cmdline").read_text():
            return int(proc.name)
    raise RuntimeError("no llm stub")


async def speaks(port: int) -> bool:
    """A new session's first step (a second of silence) is answered."""
    try:
        async with websockets.connect(f"ws://127.0.0.1:{port}/backend") as ws:
            await ws.send(json.dumps({"type": "session.init", "payload": {"mode": "full_duplex"}}))
            if json.loads(await ws.recv())["type"] != "session.created":
                return False
            silence = encode_f32_base64(np.zeros(16_000, np.float32))
            await ws.send(json.dumps({"type": "input.append", "input": {"input_id": "in_0", "audio": silence}}))
            async with asyncio.timeout(30):
                while True:
                    event = json.loads(await ws.recv())
                    if event["type"] == "error":
                        return False
                    if event.get("chunk_usage") is not None:
                        return True
    except (OSError, websockets.ConnectionClosed, TimeoutError):
        return False


async def heal_s(reloads_before_restart: int, work: Path) -> float:
    port, ports = free_port(), free_ports()
    log = work / f"serve-{reloads_before_restart}.log"
    env = {**os.environ, **HEALTH, "MINICPMO_RELOADS_BEFORE_RESTART": str(reloads_before_restart)}
    with open(log, "ab") as out:
        serve = subprocess.Popen([sys.executable, "-m", "gateway.serve", "--port", str(port), "--triton-ports",
                                  f"{ports.http},{ports.grpc},{ports.metrics}", "--triton-log",
                                  str(work / f"triton-{reloads_before_restart}.log")],
                                 cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while status(port) != "ready":
            assert serve.poll() is None, log.read_text()[-2000:]
            await asyncio.sleep(0.5)
        killed = time.monotonic()
        os.kill(llm_stub(log), signal.SIGKILL)
        while status(port) == "ready":  # the verdict turns first; until then a new session might slip in
            await asyncio.sleep(0.1)
        while not (status(port) == "ready" and await speaks(port)):
            await asyncio.sleep(0.1)
        return time.monotonic() - killed
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=90)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        restart = [await heal_s(0, Path(tmp)) for _ in range(args.runs)]
        reload = [await heal_s(3, Path(tmp)) for _ in range(args.runs)]
    print("| healed by | kill -9 of the llm stub to a new session speaking (s) |")
    print("|---|---|")
    print(f"| restarting Triton | {' / '.join(f'{s:.1f}' for s in restart)} |")
    print(f"| reloading llm | {' / '.join(f'{s:.1f}' for s in reload)} |")
    print(f"restart / reload: {np.mean(restart) / np.mean(reload):.1f}x")


if __name__ == "__main__":
    asyncio.run(main())

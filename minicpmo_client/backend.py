"""A client for `/backend`, the MiniCPM-o backend protocol: `python -m minicpmo_client.backend speech.wav --out
reply.wav` talks to the gateway like a caller would.

Streams the WAV in real time (1 s chunks of base64 float32 16 kHz), prints each event with its latency, writes
the reply audio (24 kHz). `--api realtime` is `minicpmo-triton talk` (this library's `/v1/realtime` client:
100 ms appends of 24 kHz audio/pcm, model-native duplex turns, or `--turn-detection server_vad`).
`converse` and `converse_realtime` are what the tests and benchmarks drive a session with.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from .cli import main as talk_main
from .events import AudioChunk
from .session import connect
from .talk import paced
from .wav import read_wav, write_wav
from .wire import http_base

INPUT_RATE = 16_000  # what /backend takes
OUTPUT_RATE = 24_000  # what it answers


def encode_f32(audio: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(audio, dtype="<f4").tobytes()).decode("ascii")


def decode_f32(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), "<f4").astype(np.float32)


def _close(url: str) -> None:
    """`POST /sessions/{id}/close`: the protocol's way to end a session."""
    req = urllib.request.Request(url, json.dumps({"reason": "client_done"}).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=15):
        pass


@dataclass
class ChunkTiming:
    input_id: str
    sent_at: float
    first_event_at: float | None = None


@dataclass
class ConversationResult:
    session_id: str
    events: list[dict[str, Any]] = field(default_factory=list)
    audio: list[np.ndarray] = field(default_factory=list)
    timings: list[ChunkTiming] = field(default_factory=list)
    first_audio_latency_s: list[float] = field(default_factory=list)

    @property
    def reply(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)

    def chunk_latencies_ms(self) -> list[float]:
        return [(t.first_event_at - t.sent_at) * 1000 for t in self.timings if t.first_event_at is not None]


async def converse(
    url: str,
    audio: np.ndarray,
    *,
    realtime: bool = True,
    config: dict[str, Any] | None = None,
    system_prompt: str | None = None,
    force_listen_chunks: set[int] | None = None,
    on_event: Any = None,
    quiet_s: float = 0.7,
    close: bool = True,
) -> ConversationResult:
    """One full-duplex session: init, stream `audio` (16 kHz) in 1 s appends, wait for the replies."""
    force_listen_chunks = force_listen_chunks or set()
    async with websockets.connect(url, max_size=32 * 1024 * 1024) as ws:
        payload: dict[str, Any] = {"mode": "full_duplex", "config": config or {}}
        if system_prompt:
            payload["system_prompt"] = system_prompt
        await ws.send(json.dumps({"type": "session.init", "payload": payload}))
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            raise RuntimeError(f"session not created: {created}")
        result = ConversationResult(created["session_id"])
        chunks = [audio[i:i + INPUT_RATE] for i in range(0, len(audio), INPUT_RATE)]
        by_id: dict[str, ChunkTiming] = {}
        turn_started_at: float | None = None
        done = asyncio.Event()
        last_event_at = time.perf_counter()

        async def receive() -> None:
            nonlocal turn_started_at, last_event_at
            async for raw in ws:
                ev = json.loads(raw)
                now = last_event_at = time.perf_counter()
                result.events.append(ev)
                timing = by_id.get(ev.get("input_id"))
                if timing is not None and timing.first_event_at is None:
                    timing.first_event_at = now
                if ev.get("type") == "response.output.delta":
                    if ev["kind"] == "text" and turn_started_at is None:
                        turn_started_at = timing.sent_at if timing else now
                    if ev["kind"] == "audio":
                        result.audio.append(decode_f32(ev["audio"]))
                        if turn_started_at is not None:
                            result.first_audio_latency_s.append(now - turn_started_at)
                            turn_started_at = None
                if on_event is not None:
                    on_event(ev, now)
                if sum(1 for t in result.timings if t.first_event_at is not None) == len(chunks):
                    done.set()
                if ev.get("type") in ("session.closed", "error"):
                    done.set()

        reader = asyncio.create_task(receive())
        start = time.perf_counter()
        for i, chunk in enumerate(chunks):
            if realtime:
                await asyncio.sleep(max(0.0, start + i - time.perf_counter()))
            input_id = f"in_{i}"
            message = json.dumps({"type": "input.append", "input": {
                "input_id": input_id, "audio": encode_f32(chunk), "force_listen": i in force_listen_chunks}})
            # Timed from the moment the message is ready to go: encoding it is the caller's own work.
            timing = ChunkTiming(input_id, time.perf_counter())
            by_id[input_id] = timing
            result.timings.append(timing)
            await ws.send(message)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), 120)
        while time.perf_counter() - last_event_at < quiet_s and not reader.done():  # a step's audio follows its text
            await asyncio.sleep(0.05)
        if close and not reader.done():
            await asyncio.to_thread(_close, f"{http_base(url)}/sessions/{result.session_id}/close")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader, 15)
        reader.cancel()
        return result


async def converse_realtime(url: str, audio: np.ndarray, *, turn_detection: str = "duplex", greedy: bool = False,
                            on_event: Any = None, quiet_s: float = 2.0) -> tuple[list[dict[str, Any]], np.ndarray]:
    """One /v1/realtime session through the client library: stream `audio` (24 kHz) in real time, 100 ms per
    append, then a second of silence; return the server's events and the reply audio (24 kHz)."""
    events: list[dict[str, Any]] = []

    def trace(ev: dict[str, Any]) -> None:
        events.append(ev)
        if on_event is not None:
            on_event(ev, time.perf_counter())

    session = await connect(url, turn_detection=turn_detection, session={"do_sample": False} if greedy else None,
                            on_server_event=trace)
    reply: list[np.ndarray] = []

    async def consume() -> None:
        async for ev in session.events():
            if isinstance(ev, AudioChunk):
                reply.append(ev.pcm)

    consumer = asyncio.create_task(consume())
    async for chunk in paced(audio, tail_s=1.0, max_tail_s=1.0, more=lambda: False):
        await session.send_audio(chunk)
    while True:  # until the server has been quiet for a while (the reply may still be streaming)
        seen = len(events)
        await asyncio.sleep(quiet_s)
        if len(events) == seen:
            break
    await session.close()
    await consumer
    return events, np.concatenate(reply) if reply else np.zeros(0, np.float32)


def _print_event(t0: float) -> Any:
    def show(ev: dict[str, Any], now: float) -> None:
        kind = ev.get("kind", "")
        extra = ""
        if kind == "text":
            extra = repr(ev.get("text"))
        elif kind == "audio":
            extra = f"{ev.get('audio_samples', 0) / OUTPUT_RATE:.2f} s of audio"
        m = ev.get("metrics", {})
        stage = " ".join(f"{k}={m[k]}" for k in ("wall_clock_ms", "prefill_ms", "cost_tts_ms") if k in m)
        print(f"{now - t0:7.2f}s {ev.get('type')} {kind} {ev.get('input_id') or ''} {extra} {stage}".rstrip())
    return show


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("wav", type=Path)
    parser.add_argument("--out", type=Path, default=Path("reply.wav"))
    parser.add_argument("--url", default="ws://127.0.0.1:8006/backend")
    parser.add_argument("--fast", action="store_true", help="send as fast as possible, not in real time")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (do_sample: false)")
    parser.add_argument("--api", choices=("backend", "realtime"), default="backend",
                        help="the MiniCPM-o backend protocol (/backend) or the OpenAI Realtime dialect (/v1/realtime)")
    parser.add_argument("--turn-detection", choices=("duplex", "server_vad"), default="duplex",
                        help="with --api realtime: the model decides when to speak, or server VAD turns")
    args = parser.parse_args(argv)
    if args.api == "realtime":  # the `minicpmo-triton talk` command
        url = args.url.replace("/backend", "/v1/realtime")
        return talk_main(["talk", "--wav", str(args.wav), "--out", str(args.out), "--url", url,
                          "--turn-detection", args.turn_detection, *(["--greedy"] if args.greedy else [])])
    audio = read_wav(args.wav, INPUT_RATE)
    result = asyncio.run(converse(args.url, audio, realtime=not args.fast,
                                  config={"do_sample": False} if args.greedy else None,
                                  on_event=_print_event(time.perf_counter())))
    lat = result.chunk_latencies_ms()
    write_wav(args.out, result.reply, OUTPUT_RATE)
    print(f"session {result.session_id}: {len(lat)} chunks, chunk latency p50 {np.percentile(lat, 50):.1f} ms "
          f"p95 {np.percentile(lat, 95):.1f} ms; wrote {len(result.reply) / OUTPUT_RATE:.2f} s to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hostile callers beside clean ones: does any caller's cost spill onto the others?

    python -m bench.hostile [--seconds 20] [--only long_prompt long_say]

Starts tritonserver and the gateway on free ports. Two clean sessions (`/backend` full duplex, espeak-ng speech
streamed in real time, greedy) run alone, then beside each hostile caller in turn; the table gives the clean
sessions' per-step latency (append -> the step's first event) p50 / p95 / max, p95 against the solo p95 (the goal:
at most x2), whether their transcripts equal the solo run's, and what the hostile caller got (its refusals by
code, bytes received). The hostile callers are the ones a public server meets, each as hard as the limits allow
(docs/security.md); tests/test_hostile_callers.py runs them too, for the outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from gateway.audio import encode_f32_base64
from gateway.limits import Limits
from minicpmo_client.backend import converse

LIMITS = Limits.default()
PNG_SIDE = 4096  # the largest image a stage takes


@dataclass(frozen=True)
class Urls:
    backend: str  # ws://host:port/backend
    realtime: str  # ws://host:port/v1/realtime?extensions=duplex,events (the close reasons are counted)
    # The hostile callers' own address (uvicorn takes X-Forwarded-For from loopback): the per-address bound is
    # theirs, not the clean sessions' (all on 127.0.0.1 here).
    headers: tuple[tuple[str, str], ...] = (("X-Forwarded-For", "10.66.6.6"),)

    @classmethod
    def of(cls, base: str) -> Urls:
        # Opted into the extensions: session.closed says why each socket was cut, and the old default (duplex)
        # is what long_say speaks in; the server's bounds are the same for a stock client.
        return cls(f"{base}/backend", f"{base}/v1/realtime?extensions=duplex,events")

    def connect(self, url: str, **kw: Any) -> Any:
        return websockets.connect(url, additional_headers=list(self.headers), **kw)


Outcome = Counter  # what a hostile caller got: refusal codes, close reasons, `bytes` received, `turns` done
Hostile = Callable[[Urls, asyncio.Event], Coroutine[Any, Any, Outcome]]


async def _events(ws: websockets.ClientConnection, out: Outcome, stop: asyncio.Event,
                  until: Callable[[dict[str, Any]], bool] = lambda e: False, timeout_s: float = 120) -> dict | None:
    """Read events (counting bytes and error codes) until `until` matches, the socket closes, or `stop`."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            raw = await asyncio.wait_for(ws.recv(), 0.5)
        except TimeoutError:
            continue
        except websockets.ConnectionClosed:
            out["closed"] += 1
            return None
        out["bytes"] += len(raw)
        ev = json.loads(raw)
        if ev.get("type") == "error":
            out[ev["error"]["code"]] += 1
        if ev.get("type") == "session.closed":
            out[f"closed:{ev['reason']}"] += 1
        if until(ev):
            return ev
    return None


def _loop(body: Callable[[Urls, asyncio.Event, Outcome], Awaitable[None]]) -> Hostile:
    """A hostile caller that does `body` again and again until stopped."""
    @functools.wraps(body)
    async def run(urls: Urls, stop: asyncio.Event) -> Outcome:
        out: Outcome = Counter()
        while not stop.is_set():
            try:
                await body(urls, stop, out)
            except (websockets.ConnectionClosed, OSError) as exc:
                out[type(exc).__name__] += 1
                await asyncio.sleep(0.2)
        return out
    return run


# ---- the hostile callers ----

@_loop
async def silent_sockets(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """Four sockets that never say a word, reopened as they are cut off."""
    sockets = [await urls.connect(urls.realtime) for _ in range(4)]
    await asyncio.gather(*(_events(ws, out, stop) for ws in sockets))
    for ws in sockets:
        await ws.close()


@_loop
async def heartbeats(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """A session that sends one event, then heartbeats only."""
    async with urls.connect(urls.realtime) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Hi."}}))
        reader = asyncio.create_task(_events(ws, out, stop))
        while not reader.done():
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(json.dumps({"type": "session.heartbeat"}))
            await asyncio.sleep(1.0)


@_loop
async def long_prompt(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """Sessions whose system prompt is over the bound (refused), then at it (prefilled), one step each."""
    for size in (LIMITS.prompt_bytes + 1, LIMITS.prompt_bytes):
        async with urls.connect(urls.backend) as ws:
            await ws.send(json.dumps({"type": "session.init", "payload": {"mode": "full_duplex",
                                                                          "system_prompt": "p" * size}}))
            first = await _events(ws, out, stop, lambda e: True)
            if first is None or first["type"] != "session.created":
                continue
            await ws.send(json.dumps({"type": "input.append", "input": {
                "input_id": "x", "audio": encode_f32_base64(np.zeros(16_000, np.float32))}}))
            if await _events(ws, out, stop, lambda e: e.get("chunk_usage") is not None):
                out["prompts_prefilled"] += 1


@_loop
async def long_history(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """A turn-based OpenAI conversation of items at the text bound, answered at once (the longest prefill the
    limits let one response ask for, below the context)."""
    async with urls.connect(urls.realtime) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "turn_detection": None, "output_modalities": ["text"], "max_output_tokens": 8}}))
        for i in range(3):
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {"role": "user", "content": [
                {"type": "input_text", "text": f"{i}" * LIMITS.text_bytes}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        if await _events(ws, out, stop, lambda e: e["type"] == "response.done"):
            out["responses"] += 1


@_loop
async def voice_echo(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """A 12 MB voice name (refused), then create/cancel pairs: the echo stays as small as the name."""
    async with urls.connect(urls.realtime, max_size=1 << 26) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"voice": "v" * (12 << 20)}}))
        await ws.send(json.dumps({"type": "session.update", "session": {
            "turn_detection": None, "output_modalities": ["text"], "max_output_tokens": 1}}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {"role": "user", "content": [
            {"type": "input_text", "text": "Hi."}]}}))
        for _ in range(20):
            await ws.send(json.dumps({"type": "response.create"}))
            await ws.send(json.dumps({"type": "response.cancel"}))
        await _events(ws, out, stop, timeout_s=2)
        out["pairs"] += 20


@_loop
async def long_say(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """An assistant text at the text bound, said in duplex again and again."""
    async with urls.connect(urls.realtime) as ws:
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {"role": "assistant", "content": [
            {"type": "output_text", "text": ("Say it all. " * LIMITS.text_bytes)[:LIMITS.text_bytes]}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        if await _events(ws, out, stop, lambda e: e["type"] == "response.done", timeout_s=600):
            out["said"] += 1


@functools.cache
def _png(side: int, shade: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (shade % 256, 90, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@_loop
async def many_images(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """Turn-based chat messages of 9 images (refused), an EPS (refused), then the most allowed: 4 images of
    4096 x 4096 (the pixels bound), each turn."""
    big = [_png(PNG_SIDE, i) for i in range(4)]
    eps = base64.b64encode(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n").decode()
    async with urls.connect(urls.backend, max_size=1 << 26) as ws:
        await ws.send(json.dumps({"type": "session.init", "payload": {"mode": "turn_based"}}))
        await _events(ws, out, stop, lambda e: True)
        for images in ([_png(8, 1)] * (LIMITS.images_per_message + 1), [eps], big):
            content = [*({"type": "image", "image": i} for i in images), {"type": "text", "text": "What is this?"}]
            await ws.send(json.dumps({"type": "input.append", "input": {
                "messages": [{"role": "user", "content": content}], "max_new_tokens": 4}}))
            if await _events(ws, out, stop, lambda e: e["type"] in ("response.done", "error")) is None:
                return
        out["image_turns"] += 1


@_loop
async def voice_churn(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """A fresh 30 s voice reference with every turn-based turn (each a new voice prompt for token2wav)."""
    rng = np.random.default_rng(int(time.time() * 1000) % 2**32)
    async with urls.connect(urls.backend, max_size=1 << 26) as ws:
        await ws.send(json.dumps({"type": "session.init", "payload": {"mode": "turn_based"}}))
        await _events(ws, out, stop, lambda e: True)
        while not stop.is_set():
            ref = (rng.standard_normal(30 * 16_000) * 0.05).astype(np.float32)
            await ws.send(json.dumps({"type": "input.append", "input": {
                "messages": [{"role": "user", "content": "Hello."}], "max_new_tokens": 6, "generate_audio": True,
                "tts_ref_audio": encode_f32_base64(ref)}}))
            if await _events(ws, out, stop, lambda e: e["type"] in ("response.done", "error")) is None:
                return
            out["turns"] += 1


@_loop
async def bogus_resumes(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """session.resume with made-up ids and tokens, as fast as answered."""
    async with urls.connect(urls.realtime + "&resume=1") as ws:
        await ws.send(json.dumps({"type": "session.resume", "session_id": "sess_bogus", "resume_token": "x"}))
        await _events(ws, out, stop, lambda e: e["type"] == "error", timeout_s=5)


HOSTILE: dict[str, Hostile] = {f.__name__: f for f in (silent_sockets, heartbeats, long_prompt, long_history,
                                                          voice_echo, long_say, many_images, voice_churn,
                                                          bogus_resumes)}


# ---- the clean sessions ----

@dataclass
class CleanRun:
    latencies_ms: list[float]
    transcripts: list[list[tuple[str, str, str]]]  # per session: (input_id, kind, text) per delta


async def clean_pair(urls: Urls, speech: list[np.ndarray]) -> CleanRun:
    """Two sessions streaming speech in real time, greedy; their step latencies and what they said (each session
    ends with its socket: an HTTP close would wait behind a busy backend)."""
    results = await asyncio.gather(*(converse(urls.backend, audio, realtime=True, config={"do_sample": False},
                                              quiet_s=3.0, close=False)
                                     for audio in speech[:2]))
    transcripts = [[(e["input_id"], e["kind"], e.get("text", "")) for e in r.events
                    if e.get("type") == "response.output.delta"] for r in results]
    return CleanRun([lat for r in results for lat in r.chunk_latencies_ms()], transcripts)


async def beside(urls: Urls, speech: list[np.ndarray], hostile: Hostile | None) -> tuple[CleanRun, Outcome]:
    """The clean pair, with `hostile` running from a second before it starts until it ends."""
    stop = asyncio.Event()
    task = asyncio.create_task(hostile(urls, stop)) if hostile else None
    if task is not None:
        await asyncio.sleep(1.0)
    try:
        run = await clean_pair(urls, speech)
    finally:
        stop.set()
    return run, (await task if task is not None else Counter())


async def beside_process(urls: Urls, speech: list[np.ndarray], name: str | None) -> tuple[CleanRun, Outcome]:
    """`beside`, the hostile caller in a process of its own: its own client-side work (a 12 MB frame to build)
    does not hold the clean clients' event loop."""
    if name is None:
        return await beside(urls, speech, None)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.hostile", "--hostile", name, "--url", urls.backend.rsplit("/", 1)[0],
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=Path(__file__).resolve().parent.parent)
    await asyncio.sleep(2.0)
    try:
        run = await clean_pair(urls, speech)
    finally:
        if child.stdin is not None:  # (a PIPE: always)
            child.stdin.close()  # the child stops when its stdin closes
    out, _ = await child.communicate()
    return run, Counter(json.loads(out or b"{}"))


async def run_hostile(name: str, base: str) -> None:
    """The child of `beside_process`: run one hostile caller until stdin closes; print what it got."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(HOSTILE[name](Urls.of(base), stop))
    await loop.run_in_executor(None, sys.stdin.read)
    stop.set()
    print(json.dumps(dict(await task)))


def main() -> None:
    from gateway.triton import DEFAULT_MODEL_REPOSITORY

    from .common import make_speech, pct, serving_stack

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--only", nargs="*", choices=list(HOSTILE))
    parser.add_argument("--gateway-log", type=Path, help="keep the gateway's log here")
    parser.add_argument("--hostile", choices=list(HOSTILE), help=argparse.SUPPRESS)  # beside_process's child
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile:
        asyncio.run(run_hostile(args.hostile, args.url))
        return
    with tempfile.TemporaryDirectory() as tmp, serving_stack(DEFAULT_MODEL_REPOSITORY, Path(tmp), 64,
                                                             gateway_log=args.gateway_log) as stack:
        speech = make_speech(Path(tmp), args.seconds)
        urls = Urls.of(stack.ws_url.rsplit("/", 1)[0])
        solo, _ = asyncio.run(beside_process(urls, speech, None))
        base = pct(solo.latencies_ms, 95)
        print(f"two clean sessions, {args.seconds} s of speech each, real time, greedy (tiny, this machine)\n")
        print("| beside | p50 ms | p95 ms | max ms | p95 / solo p95 | same words | the hostile caller got |")
        print("|---|---:|---:|---:|---:|---|---|")
        print(f"| (alone) | {pct(solo.latencies_ms, 50):.0f} | {base:.0f} | {max(solo.latencies_ms):.0f} | 1.00 | "
              "- | - |")
        for name in args.only or HOSTILE:
            try:
                run, got = asyncio.run(beside_process(urls, speech, name))
            except Exception as exc:  # noqa: BLE001 (a row that broke says so; the next one runs)
                print(f"| {name} | - | - | - | - | - | the clean pair failed: {type(exc).__name__} |", flush=True)
                continue
            lat = run.latencies_ms
            same = "yes" if run.transcripts == solo.transcripts else "NO"
            got_text = ", ".join(f"{k} {v}" for k, v in sorted(got.items()))
            print(f"| {name} | {pct(lat, 50):.0f} | {pct(lat, 95):.0f} | {max(lat):.0f} | {pct(lat, 95) / base:.2f} | "
                  f"{same} | {got_text} |", flush=True)


if __name__ == "__main__":
    main()

"""Hostile callers beside clean ones: does any caller's cost spill onto the others?

    python -m bench.hostile [--seconds 20] [--only long_prompt long_say] [--paged] [--paired]

Starts tritonserver and the gateway on free ports. Two clean sessions (`/backend` full duplex, espeak-ng speech
streamed in real time, greedy) run alone, then beside each hostile caller in turn; the table gives the clean
sessions' per-step latency (append -> the step's first event) p50 / p95 / max, p95 against the solo p95 (the goal:
at most x2), whether their transcripts equal the solo run's, and what the hostile caller got (its refusals by
code, bytes received). The hostile callers are the ones a public server meets, each as hard as the limits allow
(docs/security.md); tests/test_hostile_callers.py runs them too, for the outputs. Besides them: 15 MiB bodies of
each shape of JSON (`FLOOD_SHAPES`) on each route and dialect (`flood_*`), heartbeat-only sockets, resumes naming
another gateway, 12 voice-reference callers, stage stubs killed under the run (`stage_kills`: the encoders the
clean calls never use), and, with `--paged` (the LLM on the paged engine, a pool of room for four sessions),
`pool_filling`: sessions that fill the KV pool beside the clean pair. The stack's first-event deadline is 8 s
(`INIT_TIMEOUT_S`), so the sockets that send nothing real are cut within a row.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import websockets

from gateway.audio import encode_f32_base64
from gateway.limits import Limits
from minicpmo_client.backend import converse

LIMITS = Limits.default()
PNG_SIDE = 4096  # the largest image a stage takes
INIT_TIMEOUT_S = 8  # the stack's first-event deadline (MINICPMO_INIT_TIMEOUT_S), within a row
# room for four sessions of 2048 tokens (as tests/test_pool_full_e2e.py FOUR: a share of the memory plan's budget)
PAGED = {"MINICPMO_LLM_ENGINE": "paged", "MINICPMO_KV_POOL_SIZE": "0.0011", "MINICPMO_ADMIT_TOKENS": "2048"}


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

    def at(self, address: str) -> Urls:
        """The same server, reached from another client address."""
        return Urls(self.backend, self.realtime, (("X-Forwarded-For", address),))

    @property
    def http(self) -> str:
        return self.backend.replace("ws://", "http://").rsplit("/", 1)[0]


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


# ---- 15 MiB bodies of each shape, on each route and dialect ----

# a frame (and a body) is at most 16 MiB, an OpenAI-dialect event 15 MiB: every route parses what it is sent
FLOOD_BYTES = (15 << 20) - (64 << 10)
FLOOD_SHAPES = ("numbers", "objects", "strings", "keys", "nested", "text")


@functools.cache
def flood(shape: str) -> str:
    """A JSON value of ~15 MiB: millions of small values (what costs a parser per value), or one long string."""
    n = FLOOD_BYTES
    if shape == "numbers":
        return "[" + "0," * (n // 2) + "0]"
    if shape == "objects":
        return "[" + "{}," * (n // 3) + "{}]"
    if shape == "strings":
        return "[" + '"",' * (n // 3) + '""]'
    if shape == "keys":
        return "{" + ",".join(f'"{i:x}":0' for i in range(n // 12)) + "}"
    if shape == "nested":
        return "[" * (n // 2) + "]" * (n // 2)
    return '"' + "QUJD" * (n // 4) + '"'  # text: one 15 MiB string (base64-like), the shape a legit frame has


def flooded(template: str, shape: str) -> str:
    return template.replace("SHAPE", flood(shape))


async def _refusal(ws: websockets.ClientConnection, out: Outcome, stop: asyncio.Event) -> bool:
    """The answer to one flood frame (its error code counted); False when the socket closed."""
    return await _events(ws, out, stop, lambda e: e["type"] == "error", timeout_s=30) is not None


async def _flood_posts(urls: Urls, path: str, template: str, out: Outcome, stop: asyncio.Event) -> None:
    """An HTTP body of each shape to `path`, each sent as soon as the last is answered (its status and code counted)."""
    async with httpx.AsyncClient(timeout=60, headers=dict(urls.headers)) as client:
        for shape in FLOOD_SHAPES:
            if stop.is_set():
                return
            answer = await client.post(f"{urls.http}{path}", content=flooded(template, shape))
            out[f"{answer.status_code}:{answer.json().get('error', {}).get('code', 'ok')}"] += 1


@_loop
async def flood_voices_check(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """`POST /v1/voices/check` with a 15 MiB body of each shape."""
    await _flood_posts(urls, "/v1/voices/check", '{"x": SHAPE}', out, stop)


@_loop
async def flood_admin(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """The admin drain call with a 15 MiB body of each shape."""
    await _flood_posts(urls, "/admin/endpoints/drain", '{"endpoint": SHAPE}', out, stop)


@_loop
async def flood_backend_init(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """`/backend` sockets whose `session.init` is 15 MiB of each shape."""
    for shape in FLOOD_SHAPES:
        async with urls.connect(urls.backend, max_size=1 << 26) as ws:
            await ws.send(flooded('{"type": "session.init", "payload": {"mode": "full_duplex", "x": SHAPE}}', shape))
            await _refusal(ws, out, stop)


async def _flood_frames(ws: websockets.ClientConnection, template: str, out: Outcome, stop: asyncio.Event) -> bool:
    """A frame of each shape on an open session, each sent once the last is answered; False once it is closed."""
    for shape in FLOOD_SHAPES:
        await ws.send(flooded(template, shape))
        if not await _refusal(ws, out, stop):
            return False
    return True


@_loop
async def flood_backend_frames(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """A `/backend` session's later frames, 15 MiB of each shape (a refused frame closes it: the next one opens)."""
    async with urls.connect(urls.backend, max_size=1 << 26) as ws:
        await ws.send(json.dumps({"type": "session.init", "payload": {"mode": "full_duplex"}}))
        await _events(ws, out, stop, lambda e: True)
        await _flood_frames(ws, '{"type": "input.append", "input": {"input_id": "x", "audio": SHAPE}}', out, stop)


@_loop
async def flood_openai(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """OpenAI-dialect events of 15 MiB of each shape on one session (it goes on after each refusal)."""
    async with urls.connect(urls.realtime, max_size=1 << 26) as ws:
        template = '{"type": "session.update", "session": {"instructions": SHAPE}}'
        while not stop.is_set() and await _flood_frames(ws, template, out, stop):
            pass


@_loop
async def flood_minicpm(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """MiniCPM-o's dialect (`?mode=audio`): a session, then appends of 15 MiB of each shape."""
    async with urls.connect(urls.realtime.split("?")[0] + "?mode=audio", max_size=1 << 26) as ws:
        await _events(ws, out, stop, lambda e: e["type"] == "session.queue_done")
        await ws.send(json.dumps({"type": "session.update", "session": {}}))
        await _events(ws, out, stop, lambda e: e["type"] == "session.created")
        await _flood_frames(ws, '{"type": "input_audio_buffer.append", "audio": SHAPE}', out, stop)


FLOODS = (flood_voices_check, flood_backend_init, flood_backend_frames, flood_openai, flood_minicpm)


async def floods(urls: Urls, stop: asyncio.Event) -> Outcome:
    """Every route's flood in turn, a few seconds each, each from an address of its own (a caller's bytes are paced
    across its connections: one caller would have most of its bodies paced, not refused; tests/test_floods.py)."""
    out: Outcome = Counter()
    while not stop.is_set():
        for i, route in enumerate(FLOODS):
            turn = asyncio.Event()
            task = asyncio.create_task(route(urls.at(f"10.66.8.{i}"), turn))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 3.0)
            turn.set()
            out.update({f"{route.__name__}:{k}": v for k, v in (await task).items()})
            if stop.is_set():
                break
    return out


# ---- the slots, resumes, voices ----

@_loop
async def heartbeat_sockets(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """60 sockets from 4 addresses (15 each, under the per-address bound) that send heartbeats and nothing else: no
    first event (they used to hold their slots for the 300 s idle timeout: 64 such held every slot)."""
    sockets = [await urls.at(f"10.66.7.{i % 4}").connect(urls.realtime) for i in range(60)]

    async def beat(ws: websockets.ClientConnection) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            while not stop.is_set():
                await ws.send(json.dumps({"type": "session.heartbeat"}))
                await asyncio.sleep(1.0)

    beats = [asyncio.create_task(beat(ws)) for ws in sockets]
    await asyncio.gather(*(_events(ws, out, stop) for ws in sockets))
    for task in beats:
        task.cancel()
    for ws in sockets:
        await ws.close()


@_loop
async def resumes_elsewhere(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """session.resume with tokens naming another gateway, as fast as answered (they skipped the failure delay and
    the rate limit: 653/s)."""
    token = base64.urlsafe_b64encode(b"ws://10.9.9.9:8006").decode().rstrip("=") + ".x"
    async with urls.connect(urls.realtime + "&resume=1") as ws:
        await ws.send(json.dumps({"type": "session.resume", "session_id": "sess_bogus", "resume_token": token}))
        await _events(ws, out, stop, lambda e: e["type"] == "error", timeout_s=5)


async def _voice_caller(urls: Urls, stop: asyncio.Event, out: Outcome, seed: int) -> None:
    """Sessions that each bring a new 30 s voice reference (the LLM's and the TTS's), speak a second, and go; until
    the caller's budget refuses one, then again once the window allows."""
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        ref = encode_f32_base64((rng.standard_normal(30 * 16_000) * 0.05).astype(np.float32))
        try:
            async with urls.connect(urls.backend, max_size=1 << 26) as ws:
                await ws.send(json.dumps({"type": "session.init", "payload": {
                    "mode": "full_duplex", "ref_audio_base64": ref, "tts_ref_audio_base64": ref}}))
                first = await _events(ws, out, stop, lambda e: True)
                if first is None or first["type"] != "session.created":
                    await asyncio.sleep(1.0)
                    continue
                for i in range(3):
                    await ws.send(json.dumps({"type": "input.append", "input": {
                        "input_id": f"in_{i}", "audio": encode_f32_base64(np.zeros(16_000, np.float32))}}))
                    if await _events(ws, out, stop, lambda e: e.get("chunk_usage") is not None) is None:
                        break
                out["voices"] += 1
        except (websockets.ConnectionClosed, OSError) as exc:
            out[type(exc).__name__] += 1
            await asyncio.sleep(0.2)


async def voice_callers(urls: Urls, stop: asyncio.Event) -> Outcome:
    """12 callers, each from its own address (its own voice budget), bringing new voice references at once."""
    out: Outcome = Counter()
    await asyncio.gather(*(_voice_caller(urls.at(f"10.77.0.{i}"), stop, out, i) for i in range(12)))
    return out


# ---- the backend ----

def _stubs(model: str) -> list[int]:
    """The live Python-backend stubs of this model (any Triton on this machine serving the model repository)."""
    from gateway.triton import DEFAULT_MODEL_REPOSITORY

    marker = f"{DEFAULT_MODEL_REPOSITORY}/{model}/1/model.py".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (proc / "cmdline").read_bytes() and (proc / "stat").read_text().split()[2] != "Z":
                    found.append(int(proc.name))
    return found


async def stage_kills(urls: Urls, stop: asyncio.Event) -> Outcome:
    """kill -9 of a stage stub every few seconds, the encoders in turn (a clean audio call never uses them): each is
    reloaded in the same Triton, and the clean calls, which need neither, go on (a dead stage used to end every
    session on its endpoint)."""
    import os
    import signal

    out: Outcome = Counter()
    await asyncio.sleep(4.0)  # the clean pair is in
    turn = 0
    while not stop.is_set():
        model = ("vision_encoder", "audio_encoder")[turn % 2]
        turn += 1
        stubs = _stubs(model)
        for pid in stubs:
            os.kill(pid, signal.SIGKILL)
            out[f"killed:{model}"] += 1
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline and not set(_stubs(model)) - set(stubs):
            await asyncio.sleep(0.2)
        if set(_stubs(model)) - set(stubs):
            out[f"reloaded:{model}"] += 1
        await asyncio.sleep(4.0)
    return out


@_loop
async def pool_filling(urls: Urls, stop: asyncio.Event, out: Outcome) -> None:
    """(`--paged`) Sessions until the KV pool refuses one `pool_full`, then two of them closed: the clean pair takes
    the last room, and the pool is full while every session speaks (the gateway's health probe, refused by the full
    pool, used to end them all)."""
    held: list[websockets.ClientConnection] = []

    async def opened() -> websockets.ClientConnection | None:
        ws = await urls.connect(urls.backend, max_size=1 << 26)
        await ws.send(json.dumps({"type": "session.init", "payload": {"mode": "full_duplex"}}))
        await _events(ws, out, stop, lambda e: True)
        await ws.send(json.dumps({"type": "input.append", "input": {
            "input_id": "in_0", "audio": encode_f32_base64(np.zeros(16_000, np.float32))}}))
        answer = await _events(ws, out, stop, lambda e: e.get("chunk_usage") is not None or e["type"] == "error")
        if answer is None or answer["type"] == "error":
            await ws.close()
            return None
        return ws

    while len(held) < 16 and (ws := await opened()) is not None:
        held.append(ws)
    out["held"] = len(held)
    for ws in held[-2:]:
        await ws.close()  # room for the clean pair
    held = held[:-2]

    async def speak(ws: websockets.ClientConnection, i: int) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            second = 1
            while not stop.is_set():
                await ws.send(json.dumps({"type": "input.append", "input": {
                    "input_id": f"in_{second}", "audio": encode_f32_base64(np.full(16_000, 0.01, np.float32))}}))
                if await _events(ws, out, stop, lambda e: e.get("chunk_usage") is not None) is not None:
                    out["steps"] += 1
                second += 1
                await asyncio.sleep(1.0)

    await asyncio.gather(*(speak(ws, i) for i, ws in enumerate(held)))
    for ws in held:
        await ws.close()
    await stop.wait()  # the run is over (or every session of it was cut: refilling would take the clean pair's room)


HOSTILE: dict[str, Hostile] = {f.__name__: f for f in (silent_sockets, heartbeats, long_prompt, long_history,
                                                          voice_echo, long_say, many_images, voice_churn,
                                                          bogus_resumes, heartbeat_sockets, resumes_elsewhere,
                                                          voice_callers, flood_voices_check, flood_admin,
                                                          flood_backend_init, flood_backend_frames, flood_openai,
                                                          flood_minicpm, stage_kills)}
PAGED_ONLY: dict[str, Hostile] = {"pool_filling": pool_filling}
TESTS_ONLY: dict[str, Hostile] = {"floods": floods}


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
    task = asyncio.create_task({**HOSTILE, **PAGED_ONLY, **TESTS_ONLY}[name](Urls.of(base), stop))
    await loop.run_in_executor(None, sys.stdin.read)
    stop.set()
    print(json.dumps(dict(await task)))


def main() -> None:
    from gateway.triton import DEFAULT_MODEL_REPOSITORY

    from .common import make_speech, pct, serving_stack

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--only", nargs="*", choices=[*HOSTILE, *PAGED_ONLY])
    parser.add_argument("--paged", action="store_true",
                        help="the LLM on the paged engine with a small pool (what pool_filling needs)")
    parser.add_argument("--paired", action="store_true",
                        help="the clean pair alone again before each row, its ratio against that (a shared machine)")
    parser.add_argument("--gateway-log", type=Path, help="keep the gateway's log here")
    parser.add_argument("--hostile", choices=[*HOSTILE, *PAGED_ONLY, *TESTS_ONLY], help=argparse.SUPPRESS)  # a child
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile:
        asyncio.run(run_hostile(args.hostile, args.url))
        return
    triton_env = PAGED if args.paged else {}
    saved = {k: os.environ.get(k) for k in triton_env}
    os.environ.update(triton_env)  # tritonserver's environment is this process's
    gateway_env = {"MINICPMO_INIT_TIMEOUT_S": str(INIT_TIMEOUT_S)}
    with tempfile.TemporaryDirectory() as tmp, serving_stack(DEFAULT_MODEL_REPOSITORY, Path(tmp), 64,
                                                             env=gateway_env, gateway_log=args.gateway_log) as stack:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
        speech = make_speech(Path(tmp), args.seconds)
        urls = Urls.of(stack.ws_url.rsplit("/", 1)[0])
        solo, _ = asyncio.run(beside_process(urls, speech, None))
        base = pct(solo.latencies_ms, 95)
        engine = ", the LLM on the paged engine (a pool of room for 4 sessions)" if args.paged else ""
        print(f"two clean sessions, {args.seconds} s of speech each, real time, greedy (tiny{engine}, this machine); "
              f"{'each row against the clean pair alone just before it' if args.paired else ''}\n")
        print("| beside | p50 ms | p95 ms | max ms | alone p95 ms | p95 / alone p95 | same words | "
              "the hostile caller got |")
        print("|---|---:|---:|---:|---:|---:|---|---|")
        print(f"| (alone) | {pct(solo.latencies_ms, 50):.0f} | {base:.0f} | {max(solo.latencies_ms):.0f} | "
              f"{base:.0f} | 1.00 | - | - |")
        for name in args.only or (PAGED_ONLY if args.paged else HOSTILE):
            if args.paired:  # a shared machine's load drifts over a run: each row beside its own baseline
                base = pct(asyncio.run(beside_process(urls, speech, None))[0].latencies_ms, 95)
            try:
                run, got = asyncio.run(beside_process(urls, speech, name))
            except Exception as exc:  # noqa: BLE001 (a row that broke says so; the next one runs)
                print(f"| {name} | - | - | - | - | - | - | the clean pair failed: {type(exc).__name__}: "
                      f"{str(exc)[:160]} |", flush=True)
                continue
            lat = run.latencies_ms
            same = "yes" if run.transcripts == solo.transcripts else "NO"
            got_text = ", ".join(f"{k} {v}" for k, v in sorted(got.items()))
            print(f"| {name} | {pct(lat, 50):.0f} | {pct(lat, 95):.0f} | {max(lat):.0f} | {base:.0f} | "
                  f"{pct(lat, 95) / base:.2f} | {same} | {got_text} |", flush=True)

if __name__ == "__main__":
    main()

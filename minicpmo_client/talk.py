"""`minicpmo-triton talk`: a conversation from the terminal, one line per event.

    minicpmo-triton talk --wav speech.wav --out reply.wav      # a WAV at real-time pace, the reply to a file
    minicpmo-triton talk --mic                                 # microphone and speaker (needs sounddevice)
    minicpmo-triton talk --hello "Hi, I'm here." --text "What time is it?" --out reply.wav

Ctrl-C interrupts the reply being spoken; a second Ctrl-C (within 2 s, or with no reply playing) quits.
After a WAV, silence is streamed for `--tail` seconds and for as long as a reply goes on (the model hears
time pass, as it would from a microphone), up to `--max-tail`; talk quits once the server is quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np

from . import devices, events
from .session import Session, connect
from .wav import read_wav, write_wav

RATE = 24_000  # in and out: the OpenAI dialect's default
CHUNK_S = 0.1
DOUBLE_CTRL_C_S = 2.0
GIVE_UP_QUIET_S = 30.0  # waiting for an answer to typed input


def describe(ev: events.ClientEvent) -> str | None:
    """One line for an event (None: not worth a line)."""
    if isinstance(ev, events.AudioChunk):
        return None if ev.is_final else f"audio {ev.response_id} {ev.duration_s:.2f} s"
    if isinstance(ev, events.ReplyStarted):
        return f"reply {ev.response_id} started"
    if isinstance(ev, events.TranscriptDelta):
        return f"text {ev.response_id} {ev.text!r}"
    if isinstance(ev, events.TurnFinal):
        latency = f", first audio after {ev.latency_ms:.0f} ms" if ev.latency_ms is not None else ""
        return (f"final {ev.response_id} {ev.status}, {'with' if ev.had_audio else 'no'} audio{latency}: "
                f"{ev.transcript!r}")
    if isinstance(ev, events.BargeIn):
        return f"barge-in {ev.response_id} ({ev.reason})"
    if isinstance(ev, events.Listening):
        return "listening" + (" (end of turn)" if ev.end_of_turn else "")
    if isinstance(ev, events.UserTurn):
        return f"user {ev.kind}" + (f" {ev.text!r}" if ev.text else "")
    if isinstance(ev, events.Error):
        return f"error {ev.code}: {ev.message}" + (" (retryable)" if ev.retryable else "")
    if isinstance(ev, events.Resumed):
        return f"resumed after {ev.attempt} attempt(s), {ev.replayed} events replayed" + (
            ", some events were lost" if ev.gap else "")
    if isinstance(ev, events.Closed):
        return f"closed ({ev.reason})"
    return None


async def paced(audio: np.ndarray, tail_s: float, max_tail_s: float, more: Callable[[], bool]
                ) -> AsyncIterator[np.ndarray]:
    """`audio`, 100 ms at a time at real-time pace (as a microphone would), then silence: `tail_s` of it,
    and more while `more()` holds, up to `max_tail_s`."""
    step, start = int(CHUNK_S * RATE), time.monotonic()
    silence = np.zeros(step, np.float32)
    for i in itertools.count():
        tail_s_so_far = i * CHUNK_S - len(audio) / RATE
        if tail_s_so_far >= max_tail_s or (tail_s_so_far >= tail_s and not more()):
            return
        await asyncio.sleep(max(0.0, start + i * CHUNK_S - time.monotonic()))
        yield audio[i * step:(i + 1) * step] if i * step < len(audio) else silence


class Talk:
    def __init__(self, args: argparse.Namespace, session: Session, speaker: devices.Speaker | None) -> None:
        self.args = args
        self.session = session
        self.speaker = speaker
        self.t0 = time.monotonic()
        self.reply_audio: list[np.ndarray] = []
        self.awaiting = 0  # typed inputs not answered yet (a TurnFinal or an error each)
        self.last_event_at = time.monotonic()
        self.quit = asyncio.Event()
        self.turns = 0
        self.last_sigint = float("-inf")

    def say(self, line: str) -> None:
        print(f"{time.monotonic() - self.t0:7.2f}s {line}", flush=True)

    def busy(self) -> bool:
        return self.session.state.replying or self.awaiting > 0 or (self.speaker is not None and self.speaker.busy)

    def on_sigint(self) -> None:
        now = time.monotonic()
        previous, self.last_sigint = self.last_sigint, now
        if now - previous >= DOUBLE_CTRL_C_S and (
                self.session.state.replying or (self.speaker is not None and self.speaker.busy)):
            self.say("^C: interrupting the reply (Ctrl-C again to quit)")
            if self.speaker is not None:
                self.speaker.flush()  # silence now, not when the server confirms
            asyncio.get_running_loop().create_task(self.session.interrupt())
        else:
            self.say("^C: quitting")
            self.quit.set()

    async def feed(self) -> None:
        """The caller's side: the welcome line, the typed question, then the audio."""
        if self.args.hello:
            self.awaiting += 1
            await self.session.say_hello(self.args.hello)
        if self.args.text:
            self.awaiting += 1
            await self.session.send_text(self.args.text)
        if self.args.mic:
            source: AsyncIterator[np.ndarray] | None = devices.microphone(RATE)
        elif self.args.wav:
            source = paced(read_wav(self.args.wav, RATE), self.args.tail, self.args.max_tail, self.busy)
        else:
            source = None
        if source is not None:
            async for chunk in source:
                await self.session.send_audio(chunk)

    def idle(self) -> bool:
        """Nothing to wait for: the speaker is done and the server quiet (longer while an answer is due)."""
        quiet = time.monotonic() - self.last_event_at
        if self.speaker is not None and self.speaker.busy:
            return False
        return quiet >= (GIVE_UP_QUIET_S if self.awaiting else self.args.idle)

    async def finish(self, feeder: asyncio.Task[None]) -> None:
        """Close the session once the input is over and the server has gone quiet, or on the second Ctrl-C."""
        quit_wait = asyncio.create_task(self.quit.wait())
        await asyncio.wait({feeder, quit_wait}, return_when=asyncio.FIRST_COMPLETED)
        while not self.quit.is_set() and not self.idle():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(quit_wait), 0.1)
        quit_wait.cancel()
        feeder.cancel()
        await self.session.close()

    def on_event(self, ev: events.ClientEvent) -> None:
        self.last_event_at = time.monotonic()
        line = describe(ev)
        if line:
            self.say(line)
        if isinstance(ev, events.AudioChunk) and len(ev.pcm):
            self.reply_audio.append(ev.pcm)
            if self.speaker is not None:
                self.speaker.play(ev.pcm)
        elif isinstance(ev, events.BargeIn) and self.speaker is not None:
            self.speaker.flush()
        elif isinstance(ev, (events.TurnFinal, events.Error)):
            self.awaiting = max(0, self.awaiting - 1)
            self.turns += isinstance(ev, events.TurnFinal)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self.on_sigint)
        feeder = asyncio.create_task(self.feed())
        closer = asyncio.create_task(self.finish(feeder))
        try:
            async for ev in self.session.events():
                self.on_event(ev)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            closer.cancel()
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, events.ClientError, devices.DeviceUnavailable):
                await feeder


def session_settings(args: argparse.Namespace) -> dict[str, object]:
    settings: dict[str, object] = {"do_sample": False} if args.greedy else {}
    if args.max_output_tokens is not None:
        settings["max_output_tokens"] = args.max_output_tokens
    return settings


async def talk(args: argparse.Namespace) -> int:
    speaker = None
    try:
        if args.mic:
            devices.require("input")
        if args.out is None:
            speaker = devices.Speaker(RATE)
    except devices.DeviceUnavailable as exc:
        hint = "use --wav FILE" if args.mic else "use --out reply.wav"
        print(f"talk: {exc}; {hint}", flush=True)
        return 2
    try:
        session = await connect(args.url, api_key=args.api_key, voice=args.voice, instructions=args.instructions,
                                turn_detection=None if args.turn_detection == "manual" else args.turn_detection,
                                input_rate=RATE, output_rate=RATE,
                                session=session_settings(args))
    except events.ClientError as exc:
        print(f"talk: {exc}", flush=True)
        return 1
    t = Talk(args, session, speaker)
    t.say(f"session {session.session_id} on {args.url} ({args.turn_detection} turns)")
    try:
        await t.run()
    except events.ClientError as exc:
        t.say(f"talk: {exc}")
        return 1
    finally:
        if speaker is not None:
            speaker.close()
    reply = np.concatenate(t.reply_audio) if t.reply_audio else np.zeros(0, np.float32)
    if args.out is not None:
        write_wav(args.out, reply, RATE)
        t.say(f"{t.turns} replies; wrote {len(reply) / RATE:.2f} s to {args.out}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wav", type=Path, help="speak this WAV file (streamed at real-time pace)")
    source.add_argument("--mic", action="store_true", help="speak into the microphone (needs sounddevice)")
    parser.add_argument("--out", type=Path, help="write the reply audio to this WAV instead of playing it")
    parser.add_argument("--text", help="ask this question as typed text")
    parser.add_argument("--hello", help="the assistant speaks this welcome line first")
    parser.add_argument("--url", default=os.environ.get("MINICPMO_URL", "ws://127.0.0.1:8006/v1/realtime"))
    parser.add_argument("--api-key", default=os.environ.get("MINICPMO_API_KEY"))
    parser.add_argument("--voice", help="the assistant's voice (a name)")
    parser.add_argument("--instructions", help="the system prompt")
    parser.add_argument("--turn-detection", choices=("duplex", "server_vad", "semantic_vad", "manual"),
                        default="duplex", help="who decides when the assistant speaks: the model (duplex), "
                        "server VAD (semantic_vad: the same VAD, OpenAI's name), or you")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (do_sample: false)")
    parser.add_argument("--max-output-tokens", type=int, help="a reply's token budget (VAD and manual turns)")
    parser.add_argument("--tail", type=float, default=3.0, help="seconds of silence streamed after the WAV")
    parser.add_argument("--max-tail", type=float, default=30.0, help="at most this much silence after the WAV")
    parser.add_argument("--idle", type=float, default=2.0, help="quit after this many quiet seconds once done")

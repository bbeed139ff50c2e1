"""The one I/O shell every dialect runs in: admission, the session (its Triton stream, the socket it is
attached to, its journal), the receive loop, the send path and the close.

- `admitted(...)`: a session slot for the caller, or a refusal; MiniCPM-o's dialect waits in the FIFO.
  The slot is given back when the block ends, whatever ends it: that is the only place it is released.
- `running(...)`: a `Session` for a dialect's state, ended when the block ends, whatever ends it (the
  Triton sequence is ended in `Session.close`, once). A resumable session outlives its first socket:
  the block waits out its disconnect grace.
- `serve(...)`: the receive loop, with the idle timeout; each frame goes to the session's inbox.
- `Session`: one consumer per session (the `websockets` library's pattern): client frames and the step in
  flight's events go to one inbox, read by one task, the only caller of the dialect's state. A frame is read
  (`state.read_frame`: its decoding, resampling, VAD; a big frame's in a worker thread while the consumer waits)
  and then decided, so a step event that arrives while a big frame is read is decided after that frame. The
  consumer sends the session's steps to Triton one at a time, in order, each prepared as it goes out; a frame's
  steps are refused (`input_backpressure`) when `max_pending_steps` already wait.

With `resumable` (the Realtime dialects), each server event gets the next `server_event_seq` and goes
into the journal before it is sent, so a client that reconnects with `session.resume` is replayed what it
missed; a dropped socket leaves the session alive for the disconnect grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from minicpmo_triton.duplex_contract import ChatInput, StepEvent, StepInput
from minicpmo_triton.errors import CLIENT_ERRORS, CLOSE_REASONS, RETRYABLE, Code, describe

from . import peers
from .auth import ANONYMOUS
from .codes import ClientCode
from .dialects.realtime_events import Replaced, Resumed, ResyncRequired
from .dialects.state import DialectState, Effects, PlannedStep, Refusal, ServerEvent
from .fairness import Activity, ByteRate, EventRate, paced
from .journal import Journal
from .metrics import Metrics
from .registry import Gateway, QueueFull, SessionLimitReached
from .settings import Settings
from .tracing import StepTracer
from .triton.stream import TritonStream, TritonUnavailable
from .wire import (
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SERVER_ERROR,
    CLOSE_TRY_AGAIN,
    LARGE_FRAME_BYTES,
    LARGE_READS,
    ProtocolError,
    new_id,
)

log = logging.getLogger("gateway")

QUEUE_UPDATE_S = 3.0
END_TIMEOUT_S = 10.0  # a session's END on a Triton that answers
SOCKET_CLOSE_S = 30.0  # a slow consumer's close handshake: the library gives up on it well before

# Tests only (Settings.test_faults): this frame raises InjectedFault where it is read, to show that an
# exception anywhere in a session's handling still ends its Triton sequence and frees its slot.
FAULT_FRAME = "\x00minicpmo-test-fault\x00"


class Disconnected(Exception):
    pass


class InjectedFault(Exception):
    pass


async def receive_text(ws: WebSocket, timeout_s: float | None, test_faults: bool = False,
                       rate: ByteRate | None = None) -> str:
    """The next text (or UTF-8 binary) frame; Disconnected when the socket is gone. Past the caller's byte `rate`,
    it is handed on late (and the next one read late: the WebSocket library reads one frame ahead)."""
    try:
        message = await asyncio.wait_for(ws.receive(), timeout_s)
    except RuntimeError as exc:  # receiving on a socket that was closed
        raise Disconnected from exc
    if message["type"] == "websocket.disconnect":
        raise Disconnected
    text = message["text"] if message.get("text") is not None else \
        (message.get("bytes") or b"").decode("utf-8", errors="replace")
    if test_faults and text == FAULT_FRAME:
        raise InjectedFault("a test's fault frame")
    if rate is not None and (wait := rate.delay(len(text))) > 0:
        await asyncio.sleep(wait)
    return text


# ---- admission ----

QueueEvent = Callable[[bool, int, int, str, float], ServerEvent]  # (first, position, length, ticket, wait s)


@contextlib.asynccontextmanager
async def admitted(gw: Gateway, ws: WebSocket, queue_event: QueueEvent | None = None) -> AsyncIterator[str | None]:
    """A slot for this caller, held for the block. With `queue_event` (MiniCPM-o's dialect) the caller waits
    in the FIFO and is told where it stands; the block gets an event the caller sent before its turn (kept,
    not lost). Refusals raise ProtocolError; a caller who hangs up while waiting raises Disconnected."""
    ticket: asyncio.Future[None] | None = None
    try:
        gw.reserve()
    except SessionLimitReached:
        if queue_event is None:
            raise ProtocolError(ClientCode.TOO_MANY_SESSIONS,
                                f"all {gw.settings.max_sessions} session slots are taken; "
                                "retry later", close_code=CLOSE_TRY_AGAIN, error_type="server_error",
                                retryable=True) from None
        try:
            ticket = gw.enqueue()
        except QueueFull:
            raise ProtocolError(ClientCode.QUEUE_FULL, "the queue for a session is full; retry later",
                                close_code=CLOSE_TRY_AGAIN, error_type="server_error", retryable=True) from None
    try:
        yield None if ticket is None or queue_event is None else await _wait_in_queue(gw, ws, ticket, queue_event)
    finally:
        if ticket is not None and not ticket.done():
            gw.leave_queue(ticket)  # it never got a slot
        else:
            gw.release()  # the one place a slot is given back


async def _wait_in_queue(gw: Gateway, ws: WebSocket, ticket: asyncio.Future[None],
                         queue_event: QueueEvent) -> str | None:
    ticket_id = new_id("ticket")
    early: str | None = None
    watcher: asyncio.Task[str] | None = asyncio.create_task(  # a caller who hangs up
        receive_text(ws, None, gw.settings.test_faults))
    try:
        first = True
        while not ticket.done():
            position = gw.position(ticket)
            wait_s = round(position * gw.mean_session_s / max(1, gw.settings.max_sessions), 1)
            await ws.send_text(json.dumps(queue_event(first, position, gw.queue_length, ticket_id, wait_s).encode()))
            first = False
            waiting: set[asyncio.Future[Any]] = {ticket} if watcher is None else {ticket, watcher}
            await asyncio.wait(waiting, timeout=QUEUE_UPDATE_S, return_when=asyncio.FIRST_COMPLETED)
            if watcher is not None and watcher.done():
                early, watcher = watcher.result(), None  # raises Disconnected for a caller who left
        return early
    except (WebSocketDisconnect, RuntimeError) as exc:
        raise Disconnected from exc
    finally:
        if watcher is not None:
            watcher.cancel()


# ---- the consumer's inbox ----

@dataclass
class Frame:
    """A client frame; `decided` is settled once the consumer has decided it."""

    text: str
    decided: asyncio.Future[None]


@dataclass
class StepAnswer:
    """One event of the step in flight."""

    step: PlannedStep[Any]
    ev: StepEvent


@dataclass
class StepEnded:
    """The step in flight ended: all its events in, or a coded `error` event (`failed`), or its stream broke."""

    step: PlannedStep[Any]
    failed: StepEvent | None = None
    broke: Exception | None = None


Inbound = Frame | StepAnswer | StepEnded


def _settle(decided: asyncio.Future[None], exc: Exception | None = None) -> None:
    if decided.done():  # its caller stopped waiting
        return
    if exc is None:
        decided.set_result(None)
    else:
        decided.set_exception(exc)



# ---- the session ----

class Session:
    def __init__(self, state: DialectState, triton: TritonStream, settings: Settings, resumable: bool,
                 owner: str = ANONYMOUS, awaiting_first: bool = True, bytes_in: ByteRate | None = None,
                 metrics: Metrics | None = None, tracer: StepTracer | None = None) -> None:
        self.state = state
        self.metrics = metrics or Metrics(record=False)  # the gateway's (gateway/metrics.py); tests leave it out
        self.tracer = tracer or StepTracer()
        self.owner = owner
        self.session_id = state.session_id
        self.triton = triton
        self.settings = settings
        self.started_at = time.monotonic()
        self.ws: WebSocket | None = None
        self.seq = 0
        self.journal = Journal(settings.journal_s, settings.journal_bytes) if resumable else None
        self.resume_token = peers.new_token(settings.gateway_url)  # names this gateway (gateway/peers.py)
        self._send_lock = asyncio.Lock()
        self.offloaded = 0  # client frames read in a worker thread
        self.events = EventRate(settings.max_events_per_s, settings.max_event_burst)
        # the caller's byte rate (shared by its connections), else the connection's own
        self.bytes_in = bytes_in or ByteRate(settings.max_bytes_per_s, 2 * settings.ws_max_size)
        # the idle clock, heartbeats not counted; the first real event is due within init_timeout_s of the start
        # (`awaiting_first`: the dialect has not read it already), whatever heartbeats came before it
        self.activity = Activity(settings.idle_timeout_s, settings.init_timeout_s if awaiting_first else None)
        self._grace: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # The one consumer: it alone calls the state, in the order its inputs arrived.
        self._inbox: asyncio.Queue[Inbound] = asyncio.Queue()
        self._steps: deque[PlannedStep[Any]] = deque()  # planned, waiting behind the one in flight
        self._flight: asyncio.Task[None] | None = None  # the step in flight: its events to the inbox
        self._answered = False  # ... and whether its first event was decided
        self._halted = False  # a step failed: the session is ending, no more go out
        self._reading: asyncio.Future[Any] | None = None  # a big frame read in a worker thread
        self._consumer = asyncio.create_task(self._consume())
        self._closing: asyncio.Future[None] | None = None
        self._ended = asyncio.Event()
        self._lost = False
        self._socket_closing: asyncio.Task[None] | None = None  # a slow consumer's close handshake
        self._turn_at: float | None = None  # the spoken turn in progress: when the step that opened it was planned
        self._turn_heard = False  # ... and whether its first audio went out
        triton.on_lost = self.lost

    @property
    def resumable(self) -> bool:
        return self.journal is not None

    @property
    def closed(self) -> bool:
        return self._closing is not None

    # ---- out: the one send path ----
    async def emit(self, events: list[ServerEvent]) -> None:
        async with self._send_lock:
            for event in events:
                if isinstance(event, Refusal):
                    self.metrics.refused(self.state.dialect, event.code)
                ev = event.encode()
                if self.journal is not None:
                    if ev["type"] == "session.created":
                        ev["resume_token"] = self.resume_token
                    self.seq += 1
                    ev["server_event_seq"] = self.seq
                text = json.dumps(ev)
                if self.journal is not None:
                    self.journal.add(self.seq, text)
                await self._send_text(text)

    async def _send_text(self, text: str) -> None:
        ws = self.ws
        if ws is None or ws.application_state != WebSocketState.CONNECTED:
            return
        try:
            await asyncio.wait_for(ws.send_text(text), self.settings.send_timeout_s)
        except TimeoutError:
            self._drop_slow(ws)
        except Exception as exc:  # noqa: BLE001 (a send to a closed socket is a disconnect)
            log.info("session %s: a send failed (%s): the client is taken as gone", self.session_id, describe(exc))
            self.detach(ws)

    def _drop_slow(self, ws: WebSocket) -> None:
        """The slow-consumer policy: what waits to go out is bounded (the transport's write buffer, then one
        send for `send_timeout_s`); a client that reads nothing for that long is closed with `slow_consumer`
        (1008), and the session ends: nothing is buffered for it past the bound."""
        if self.ws is not ws:
            return
        self.ws = None
        log.info("session %s: the client read nothing for %.0f s: closing (slow_consumer)", self.session_id,
                 self.settings.send_timeout_s)

        async def close_socket() -> None:
            # Its close frame waits behind what it did not read; the WebSocket library keeps reading (and
            # dropping) what the client sends, and drops the connection if the close handshake does not finish
            # within its close timeout. Not cancelled: that would leave the connection to linger.
            with contextlib.suppress(Exception):
                await ws.close(code=CLOSE_POLICY, reason="slow_consumer")
        self._socket_closing = asyncio.get_running_loop().create_task(close_socket())
        self._spawn(self.close("slow_consumer", emit=False))

    def _control(self, event: ServerEvent) -> str:
        """A per-attachment event: it carries the current seq but is not journaled (replays do not repeat it)."""
        return json.dumps({**event.encode(), "server_event_seq": self.seq})

    async def apply(self, fx: Effects) -> None:
        if fx.cancel:
            self._spawn(self.triton.cancel())  # beside the step in flight, not behind it
        await self.emit(fx.events)
        if fx.steps and len(self._steps) >= self.settings.max_pending_steps:
            # the one bound on a session's queued steps: the caller sends faster than the model hears
            await self.emit([self.state.error_event(self.state.backpressure(len(self._steps)))])
        else:
            self._steps.extend(fx.steps)  # a long append's seconds all go in, in order
        if fx.close:
            self._spawn(self.close(fx.close))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        exc = None if task.cancelled() else task.exception()  # cancelled: a cancel that met the sequence's end
        if exc is not None:
            log.info("session %s: background task failed: %s", self.session_id, describe(exc))

    # ---- in: one consumer ----
    async def handle(self, text: str) -> None:
        """One client frame into the inbox; returns once the consumer has decided it (what deciding it raised
        is raised here)."""
        if self.closed:
            return
        decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(Frame(text, decided))
        await decided

    async def _consume(self) -> None:
        """The session's one consumer: each input decided in the order it arrived, then the next step sent when
        none is in flight. Ends with the session."""
        try:
            while not self.closed:
                item = await self._inbox.get()
                try:
                    if isinstance(item, Frame):
                        await self._take_frame(item)
                    else:
                        await self._on_step(item)
                    self._send_next()
                except Exception as exc:  # noqa: BLE001 (a step failed: the session ends, the server goes on)
                    log.error("session %s: step failed: %s", self.session_id, describe(exc))
                    self._halted = True
                    self.fail("backend_error", str(exc))
        finally:  # frames nobody will decide: their callers go on (the session is closing)
            while not self._inbox.empty():
                if isinstance(item := self._inbox.get_nowait(), Frame):
                    _settle(item.decided)

    async def _take_frame(self, frame: Frame) -> None:
        try:
            await self._on_frame(frame.text)
        except Exception as exc:  # noqa: BLE001 (the receive loop ends the session for it)
            _settle(frame.decided, exc)
        finally:  # decided, or the session closed as it was
            _settle(frame.decided)

    async def _on_frame(self, text: str) -> None:
        """One client frame: answered, applied, or refused with a coded error."""
        heard_at = time.monotonic()
        if (over := self.events.refusal()) is not None:  # a flood: refused unread, the session goes on
            await self.apply(Effects([self.state.error_event(over)]))
            return
        fx, err = await self._decide_frame(text)
        await self.apply(fx)
        if fx.cancel:  # a barge-in (or a cancel): what it said went out after any audio being sent; none follows
            self.metrics.barged_in(self.state.dialect, time.monotonic() - heard_at)
            self._turn_at = None
        if err is not None and err.close_code is not None:
            await self.close("protocol_error", message=err.message, ws_code=err.close_code)

    def _decide(self, read: Callable[[], Any]) -> tuple[Effects, ProtocolError | None]:
        """The state's answer to one frame (`read()` gives it read); a refusal is answered with its error (the
        error comes back too: one with a close code ends the session)."""
        try:
            return self.state.on_frame(read()), None
        except ProtocolError as err:
            return Effects([self.state.error_event(err)]), err
        except Exception as exc:  # noqa: BLE001 (our bug: say so, keep the session)
            log.error("session %s: a client event failed: %s", self.session_id, describe(exc))
            return Effects([self.state.error_event(ProtocolError(
                ClientCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}", error_type="server_error"))]), None

    async def _decide_frame(self, text: str) -> tuple[Effects, ProtocolError | None]:
        """A frame of `state.offload_frame_bytes` or more is read in a worker thread: its decoding, resampling and
        VAD would hold the loop longer than the hand-off costs (docs/realtime.md); the consumer waits for it (what
        comes meanwhile waits in the inbox) and the state decides it here. Smaller frames (a barge-in's 100 ms)
        are read inline: a hand-off would only make them later."""
        limit = self.state.offload_frame_bytes
        plan = self.state.frame_plan()
        if limit is None or len(text) < limit:
            return self._decide(lambda: self.state.read_frame(text, plan))
        self.offloaded += 1
        # a large frame on the one large-frame worker (wire.off_loop), an append's VAD on any
        executor = LARGE_READS if len(text) >= LARGE_FRAME_BYTES else None
        # the input stream (resampler, VAD) is the thread's till it ends, even if the session closes meanwhile
        work = self._reading = asyncio.get_running_loop().run_in_executor(executor, self.state.read_frame, text, plan)
        await asyncio.wait({work})
        return self._decide(work.result)  # what the reading raised is raised here: a refusal like any other

    # ---- steps: one at a time, in order ----
    def _send_next(self) -> None:
        """The next step waiting goes out, prepared now (its epoch, the first step's options), when none is in
        flight: the consumer is what keeps a session to one step at a time."""
        while self._flight is None and self._steps and not self._halted and not self.closed:
            step = self._steps.popleft()
            if not self.state.wanted(step):
                continue
            request = self.state.prepare(step)
            sent_at = time.monotonic()
            self.metrics.step_sent(self.state.dialect, sent_at - step.planned_at)
            self._answered = False
            self._flight = asyncio.get_running_loop().create_task(self._stream(step, request, sent_at))

    async def _stream(self, step: PlannedStep[Any], request: StepInput | ChatInput, sent_at: float) -> None:
        """The step in flight: its events from Triton into the inbox, then how it ended."""
        attributes = {"minicpmo.dialect": self.state.dialect, "minicpmo.session": self.session_id,
                      "minicpmo.kind": step.kind, "minicpmo.second": step.second}
        try:
            with self.tracer.step(step.planned_at, sent_at, attributes) as spans:
                first = True
                # The budget is per event, not per step: a long turn spoken chunk by chunk goes on; a stalled one ends.
                async for ev in paced(self.triton.step(request, trace=spans.traceparent), self.settings.step_timeout_s):
                    if ev.kind == "error":
                        spans.decided("error")
                        self._inbox.put_nowait(StepEnded(step, failed=ev))
                        return
                    if first:
                        first = False
                        spans.decided("listen" if ev.kind == "listen" else "speak")
                    self._inbox.put_nowait(StepAnswer(step, ev))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the consumer tells the session why)
            self._inbox.put_nowait(StepEnded(step, broke=exc))
            return
        self._inbox.put_nowait(StepEnded(step))

    async def _on_step(self, item: StepAnswer | StepEnded) -> None:
        step = item.step
        if isinstance(item, StepAnswer):
            ev = item.ev
            await self.apply(self.state.on_step_event(step, ev))
            if not self._answered:
                self._answered = True
                # a duplex step against its 1 s period (a chat turn has none); one a barge-in fenced off is heard
                # by nobody
                if step.kind == "duplex" and step.epoch == self.state.epoch:
                    self.metrics.step_answered(self.state.dialect, time.monotonic() - step.planned_at)
            self._follow_turn(step, ev)
            return
        self._flight = None
        if item.failed is not None:
            await self._step_failed(step, item.failed)
        elif isinstance(item.broke, TimeoutError):
            self._halted = True
            self.fail("step_timeout", f"a step made no progress for {self.settings.step_timeout_s:.0f} s")
        elif isinstance(item.broke, TritonUnavailable):
            self._halted = True
            self.lost()
        elif item.broke is not None:
            raise item.broke
        else:
            await self.apply(self.state.on_step_end(step))

    def _follow_turn(self, step: PlannedStep, ev: StepEvent) -> None:
        """A spoken turn opens with a step's first words or audio, and its first audio is timed from that step's
        input; a listen, the turn's end (or a barge-in) closes it."""
        if step.epoch != self.state.epoch:
            return
        if ev.kind in ("text", "audio") and self._turn_at is None:
            self._turn_at, self._turn_heard = step.planned_at, False
        if ev.kind == "audio" and len(ev.audio) and self._turn_at is not None and not self._turn_heard:
            self._turn_heard = True
            self.metrics.first_audio_sent(self.state.dialect, time.monotonic() - self._turn_at)
        if ev.kind in ("listen", "done") or ev.end_of_turn:
            self._turn_at = None

    async def _step_failed(self, step: PlannedStep, ev: StepEvent) -> None:
        code = ev.code or Code.STAGE_ERROR
        self._turn_at = None
        if code in CLIENT_ERRORS:  # the client's input: refused, the session goes on
            await self.apply(self.state.on_step_error(step, ClientCode(code), ev.message))
            return
        self._halted = True
        if code in RETRYABLE:  # no room now (its KV pool), or a stage Triton could not run: told to retry
            err = ProtocolError(ClientCode(CLOSE_REASONS[code]), ev.message, close_code=CLOSE_TRY_AGAIN,
                                error_type="server_error", retryable=True)
            await self.emit([self.state.error_event(err)])
            self._spawn(self.close(err.code, message=err.message, ws_code=CLOSE_TRY_AGAIN))
        else:
            reason = CLOSE_REASONS.get(code, "backend_error")
            # its type and place are in the Triton log (no caller data here: the message may quote it)
            log.warning("session %s: a step failed with %s (message of %d characters): closing (%s)",
                        self.session_id, code, len(ev.message), reason)
            self.fail(reason, f"{code}: {ev.message}")

    def lost(self) -> None:
        """Triton went away (its stream broke): the client is told `backend_unavailable`, retryable, and the
        session ends (its state died with Triton); a new session works once /health is ready again."""
        if self._lost or self.closed:
            return
        self._lost = True
        err = ProtocolError(ClientCode.BACKEND_UNAVAILABLE, "the model server went away; open a new session when "
                            "/health is ready", error_type="server_error", retryable=True)
        self._spawn(self._end_unavailable(err))

    async def _end_unavailable(self, err: ProtocolError) -> None:
        await self.emit([self.state.error_event(err)])
        await self.close("backend_unavailable", message=err.message, ws_code=CLOSE_TRY_AGAIN)

    def fail(self, reason: str, message: str) -> None:
        code = CLOSE_SERVER_ERROR if reason in ("backend_error", "step_timeout") else CLOSE_NORMAL
        self._spawn(self.close(reason, message=message, ws_code=code))

    # ---- attachment ----
    async def attach(self, ws: WebSocket, after_seq: int | None = None) -> None:
        """Attach a socket; with `after_seq` (a resume), first replay what came after it, or ask for a resync."""
        old = self.ws
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        async with self._send_lock:
            self.ws = ws
            if old is not None and old is not ws:
                with contextlib.suppress(Exception):
                    await old.send_text(self._control(Replaced(self.session_id)))
                    await old.close(code=CLOSE_NORMAL, reason="replaced")
            if after_seq is None or self.journal is None:
                return
            self.resume_token = peers.new_token(self.settings.gateway_url)
            missed = self.journal.since(after_seq)
            if missed is None:
                await ws.send_text(self._control(ResyncRequired(self.session_id, "journal_gap", self.resume_token)))
                return
            await ws.send_text(self._control(Resumed(self.session_id, self.resume_token, len(missed))))
            for text in missed:
                await ws.send_text(text)

    def detach(self, ws: WebSocket) -> None:
        """The socket went away: a resumable session waits `disconnect_grace_s` for a resume (one that has sent no
        real event yet, no longer than its first-event deadline: a silent socket's slot is not held past it by
        hanging up), then ends; any other ends now."""
        if self.ws is not ws or self.closed:
            return
        self.ws = None
        if self.resumable:
            grace = self.settings.disconnect_grace_s
            grace = grace if self.activity.started else min(grace, self.activity.remaining_s())
            self._grace = asyncio.get_running_loop().create_task(self._expire(grace))
        else:
            self._spawn(self.close("client_disconnected", emit=False))

    async def _expire(self, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        if self.ws is None:
            await self.close("disconnect_grace_expired")

    def check_token(self, token: Any) -> None:
        if not isinstance(token, str) or not secrets.compare_digest(token, self.resume_token):
            raise ProtocolError(ClientCode.INVALID_RESUME_TOKEN, "the resume token does not match", "resume_token",
                                close_code=CLOSE_POLICY)

    # ---- close: the one way a session ends ----
    async def wait_closed(self) -> None:
        await self._ended.wait()

    async def close(self, reason: str, *, message: str | None = None, emit: bool = True,
                    ws_code: int = CLOSE_NORMAL) -> None:
        """Idempotent: the first caller does the work, later callers wait for it."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        log.info("session %s: closing (%s)", self.session_id, reason)
        self.metrics.session_closed(self.state.dialect, reason)
        try:
            if self._grace is not None and self._grace is not asyncio.current_task():
                self._grace.cancel()
            if asyncio.current_task() is not self._consumer:  # else the consumer itself closes, and stops after
                await _stop(self._consumer, self.session_id)
            if self._flight is not None:
                await _stop(self._flight, self.session_id)
            try:
                # ends the Triton sequence: state is freed before we answer; a lost backend is not waited for (a hung
                # Triton would hold the close 10 s): its sequence is ENDed once the endpoint answers again
                await self.triton.close(timeout_s=0.0 if self._lost else END_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 (logged; the session still ends)
                log.error("session %s: ending the Triton sequence failed: %s", self.session_id, describe(exc))
            if self._reading is not None:  # the input stream is the reading thread's till it ends
                await asyncio.wait({self._reading})
            if emit:
                try:
                    await self.emit(self.state.on_close(reason, message))
                except Exception as exc:  # noqa: BLE001 (our bug: the session still ends, its socket closed)
                    log.error("session %s: the dialect's close failed: %s", self.session_id, describe(exc))
            ws, self.ws = self.ws, None
            if ws is not None and ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):  # the socket may be closed already
                    await ws.close(code=ws_code, reason=reason[:120])
            if self._socket_closing is not None:  # the handler (and the connection) stays until it is done
                await asyncio.wait({self._socket_closing}, timeout=SOCKET_CLOSE_S)
        finally:
            self._closing.set_result(None)
            self._ended.set()
            log.info("session %s: closed (%s); Triton sequence %d ended", self.session_id, reason, self.triton.corr_id)


async def _stop(task: asyncio.Task[Any], session_id: str) -> None:
    # Python 3.10/3.11's wait_for can swallow a cancel that lands as what it waits for completes; cancel again.
    for _ in range(5):
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            return
    log.error("session %s: a task would not stop", session_id)


@contextlib.asynccontextmanager
async def running(gw: Gateway, state: DialectState, ws: WebSocket, resumable: bool,
                  owner: str = ANONYMOUS, awaiting_first: bool = True,
                  bytes_in: ByteRate | None = None) -> AsyncIterator[Session]:
    """A session for `state`, attached to `ws`, its first events sent. However the block ends (a return, an
    exception, a cancel), the session is closed (the Triton sequence ended) and forgotten; a block that
    ends normally first waits for the session to end (a resumable one may outlive this socket)."""
    url, corr_id = gw.place()  # the endpoint with the most room (gateway/triton/placement.py), for its life
    triton = TritonStream(url, corr_id)
    try:
        await triton.open()
    except Exception as exc:
        raise ProtocolError(ClientCode.BACKEND_UNAVAILABLE, str(exc), close_code=CLOSE_SERVER_ERROR,
                            error_type="server_error") from exc
    session = Session(state, triton, gw.settings, resumable, owner, awaiting_first, bytes_in, gw.metrics, gw.tracer)
    triton.on_lost = lambda: gw.stream_lost(session)  # the endpoint takes no new sessions until it answers
    triton.on_unended = lambda: gw.pool.orphaned(url, corr_id)  # ENDed everywhere once the endpoint answers
    gw.add(session)
    gw.metrics.session_opened(state.dialect)
    try:
        await session.attach(ws)
        await session.emit(state.created())
        yield session
        await session.wait_closed()
    except Exception as exc:  # noqa: BLE001 (our bug: the session ends, the server goes on)
        log.error("session %s: failed: %s", session.session_id, describe(exc))
        await session.close("internal_error", message=f"{type(exc).__name__}: {exc}", ws_code=CLOSE_SERVER_ERROR)
    finally:
        await session.close("closed")  # a no-op unless the block was cancelled
        gw.forget(session)


async def serve(session: Session, ws: WebSocket, pending: str | None = None) -> None:
    """The receive loop: frames go to the session until the socket goes, idles out (or sends no real event by its
    first-event deadline) or is taken over."""
    activity = session.activity  # heartbeats are not activity
    try:
        if pending is not None:
            activity.heard(pending)
            await session.handle(pending)
        while not session.closed and session.ws is ws:
            try:
                text = await receive_text(ws, activity.remaining_s(), session.settings.test_faults, session.bytes_in)
            except TimeoutError:
                if activity.started:
                    await session.close("timeout")
                else:  # heartbeats only, since the socket came: as a silent one
                    await session.close("init_timeout", ws_code=CLOSE_POLICY)
                return
            except Disconnected:
                session.detach(ws)
                return
            if session.ws is not ws:
                return  # another socket took the session over
            activity.heard(text)
            await session.handle(text)
        if session.closed:  # the socket stays till the close has told it goodbye
            await session.wait_closed()
    except Exception as exc:  # noqa: BLE001 (our bug: the session ends, the server goes on)
        log.error("session %s: the receive loop failed: %s", session.session_id, describe(exc))
        await session.close("internal_error", message=f"{type(exc).__name__}: {exc}", ws_code=CLOSE_SERVER_ERROR)


async def resume(gw: Gateway, ws: WebSocket, msg: dict[str, Any], owner: str = ANONYMOUS) -> None:
    """`session.resume`: attach this socket to a resumable session within its grace, replay, serve. Only the
    principal that opened a session resumes it (another one is told it does not exist)."""
    session_id = msg.get("session_id")
    session = gw.sessions.get(session_id) if isinstance(session_id, str) else None
    if session is None:  # held by the gateway its token names, if another one: the client is sent there
        redirect = peers.redirect(msg.get("resume_token"), gw.settings.gateway_url, ws.url.path)
        if redirect is not None:
            raise redirect
    if not isinstance(session, Session) or session.closed or not session.resumable or session.owner != owner:
        raise ProtocolError(ClientCode.SESSION_RESUME_EXPIRED, "no such session, or its disconnect grace is over",
                            "session_id", close_code=CLOSE_POLICY)
    session.check_token(msg.get("resume_token"))
    last = msg.get("last_received_server_event_seq", 0)
    if isinstance(last, bool) or not isinstance(last, int) or last < 0:
        raise ProtocolError(ClientCode.INVALID_VALUE, "last_received_server_event_seq must be an integer >= 0",
                            "last_received_server_event_seq", close_code=CLOSE_POLICY)
    await session.attach(ws, after_seq=last)
    gw.metrics.resumed(session.state.dialect)
    await serve(session, ws)

"""One client session on `/backend`: a thin shell joining the WebSocket, the protocol state and Triton.

Appends queue in order and run one at a time on the session's Triton stream; close (HTTP, client
disconnect, idle timeout, server shutdown or failure) always ends the Triton sequence exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.websockets import WebSocket, WebSocketState

from minicpmo_triton.duplex_options import DuplexOptions

from .audio import encode_f32_base64
from .protocol import (
    CLOSE_NORMAL,
    CLOSE_SERVER_ERROR,
    ChatTurn,
    ClientMessage,
    InputAppend,
    InputContext,
    error_event,
)
from .session import DuplexProtocolState, new_response_id
from .settings import Settings
from .triton_stream import StepEvent, StepRequest, TritonSession

log = logging.getLogger("gateway")

# Step error codes that end the session with that reason instead of `backend_error`.
CLOSE_REASONS = {"context_full": "context_full"}
# Step error codes that are the client's input: rejected, the session goes on (its state is untouched).
CLIENT_ERRORS = {"invalid_chat", "bad_image"}


@dataclass
class _Step:
    message: ClientMessage
    options: dict[str, Any] | None
    voice: dict[str, np.ndarray] | None = None


class Connection:
    def __init__(self, ws: WebSocket, state: DuplexProtocolState, triton: TritonSession, options: DuplexOptions,
                 settings: Settings, voice: dict[str, np.ndarray] | None = None) -> None:
        self.ws = ws
        self.state = state
        self.triton = triton
        self.settings = settings
        # What travels with the first step only: the session's options and its voice references.
        self._first: tuple[dict[str, Any], dict[str, np.ndarray] | None] | None = (options.to_dict(), voice)
        self._queue: asyncio.Queue[_Step] = asyncio.Queue(maxsize=settings.max_pending_steps)
        self._send_lock = asyncio.Lock()
        self._worker = asyncio.create_task(self._run_steps())
        self._closing: asyncio.Future[None] | None = None

    @property
    def session_id(self) -> str:
        return self.state.session_id

    @property
    def closed(self) -> bool:
        return self._closing is not None

    async def send(self, data: dict[str, Any]) -> None:
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.send_json(data)

    def submit(self, message: ClientMessage) -> bool:
        """Queue a step; False when the session already has `max_pending_steps` waiting."""
        first, self._first = self._first, None
        options, voice = first if first is not None else (None, None)
        try:
            self._queue.put_nowait(_Step(message, options, voice))
        except asyncio.QueueFull:
            self._first = first
            return False
        return True

    async def _run_steps(self) -> None:
        while self._closing is None:
            step = await self._queue.get()
            try:
                await asyncio.wait_for(self._run_step(step), self.settings.step_timeout_s)
            except asyncio.CancelledError:
                raise
            except asyncio.TimeoutError:
                self._fail("step_timeout", f"a duplex step took over {self.settings.step_timeout_s:.0f} s")
                return
            except Exception as exc:  # noqa: BLE001 (Triton failed: the session ends, the server goes on)
                log.exception("session %s: step failed", self.session_id)
                self._fail("backend_error", str(exc))
                return

    async def _run_step(self, step: _Step) -> None:
        msg = step.message
        if isinstance(msg, ChatTurn):
            await self._run_turn(msg, step.options, step.voice)
            return
        if isinstance(msg, InputAppend):
            req = StepRequest(audio=msg.audio, force_listen=msg.force_listen, options=step.options, frames=msg.frames,
                              max_slice_nums=msg.max_slice_nums if msg.frames else [], voice=step.voice)
        else:
            req = StepRequest(context={"text": msg.text, "kind": msg.kind, "respond": msg.respond},
                              options=step.options, voice=step.voice)
        async for ev in self.triton.step(req):
            if ev.kind == "error":
                await self._step_error(ev)
                return
            await self.send(self.state.on_step_event(msg.input_id, ev))
        if isinstance(msg, InputContext):
            await self.send(self.state.context_accepted(msg.input_id, msg.operation_id, msg.kind, msg.respond))

    async def _run_turn(self, turn: ChatTurn, options: dict[str, Any] | None,
                        voice: dict[str, np.ndarray] | None) -> None:
        chat = {"messages": turn.messages, "max_new_tokens": turn.max_new_tokens, "generate_audio": turn.generate_audio}
        req = StepRequest(options=options, voice=voice, chat=chat)
        response_id = new_response_id()
        audio: list[np.ndarray] = []
        async for ev in self.triton.step(req):
            if ev.kind == "error":
                await self._step_error(ev)
                return
            if ev.kind == "audio":
                audio.append(ev.audio)
            whole = encode_f32_base64(np.concatenate(audio)) if ev.kind == "done" and audio else None
            out = self.state.on_chat_event(turn.input_id, response_id, ev, turn.streaming, whole)
            if out is not None:
                await self.send(out)

    async def _step_error(self, ev: StepEvent) -> None:
        if ev.code in CLIENT_ERRORS:  # the client's mistake, found by the stages: say so, keep the session
            await self.reject(ev.code, ev.message)
        else:
            self._fail(CLOSE_REASONS.get(ev.code, "backend_error"), f"{ev.code}: {ev.message}")

    def _fail(self, reason: str, message: str) -> None:
        code = CLOSE_SERVER_ERROR if reason in ("backend_error", "step_timeout") else CLOSE_NORMAL
        asyncio.get_running_loop().create_task(self.close(reason, message=message, ws_code=code))

    async def close(self, reason: str, *, message: str | None = None, emit: bool = True,
                    ws_code: int = CLOSE_NORMAL) -> None:
        """Idempotent: the first caller does the work, later callers wait for it."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        log.info("session %s: closing (%s)", self.session_id, reason)
        try:
            if asyncio.current_task() is not self._worker:
                await self._stop_worker()
            try:
                await self.triton.close()  # ends the Triton sequence: state is freed before we answer
            except Exception:  # noqa: BLE001
                log.exception("session %s: ending the Triton sequence failed", self.session_id)
            if emit:
                with contextlib.suppress(Exception):
                    await self.send(self.state.closed(reason, message))
            with contextlib.suppress(Exception):
                if self.ws.application_state == WebSocketState.CONNECTED:
                    await self.ws.close(code=ws_code, reason=reason[:120])
        finally:
            self._closing.set_result(None)
            log.info("session %s: closed (%s); Triton sequence %d ended", self.session_id, reason, self.triton.corr_id)

    async def _stop_worker(self) -> None:
        # Python 3.10/3.11's wait_for can swallow a cancel that lands as the step completes; cancel again.
        for _ in range(5):
            self._worker.cancel()
            done, _ = await asyncio.wait({self._worker}, timeout=1.0)
            if done:
                return
        log.error("session %s: the step worker would not stop", self.session_id)

    async def reject(self, code: str, message: str) -> None:
        """A client error that keeps the session open."""
        await self.send(error_event(code, message, self.session_id))

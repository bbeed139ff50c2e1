"""One client session on `/backend`: a thin shell joining the WebSocket, the protocol state and Triton.

Appends queue in order and run one at a time on the session's Triton stream; close (HTTP, client
disconnect, idle timeout, server shutdown or failure) always ends the Triton sequence exactly once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.websockets import WebSocket, WebSocketState

from minicpmo_triton.duplex_options import DuplexOptions

from .audio import encode_f32_base64
from .protocol import (
    ChatTurn,
    ClientMessage,
    InputAppend,
    InputContext,
    error_event,
)
from .session import DuplexProtocolState, new_response_id
from .session_core import SessionCore
from .settings import Settings
from .triton_stream import StepEvent, StepRequest, TritonSession


@dataclass
class _Step:
    message: ClientMessage
    options: dict[str, Any] | None
    voice: dict[str, np.ndarray] | None = None
    voice_name: str = ""


class Connection(SessionCore):
    def __init__(self, ws: WebSocket, state: DuplexProtocolState, triton: TritonSession, options: DuplexOptions,
                 settings: Settings, voice: dict[str, np.ndarray] | None = None, voice_name: str = "") -> None:
        super().__init__(state.session_id, triton, settings)
        self.ws = ws
        self.state = state
        # What travels with the first step only: the session's options and its voice (references, name).
        self._first: tuple[dict[str, Any], dict[str, np.ndarray] | None, str] | None = (
            options.to_dict(), voice, voice_name)
        self._send_lock = asyncio.Lock()

    async def send(self, data: dict[str, Any]) -> None:
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.send_json(data)

    def submit(self, message: ClientMessage) -> bool:
        """Queue a step; False when the session already has `max_pending_steps` waiting."""
        first, self._first = self._first, None
        options, voice, voice_name = first if first is not None else (None, None, "")
        if not self.enqueue(_Step(message, options, voice, voice_name)):
            self._first = first
            return False
        return True

    async def run_step(self, step: _Step) -> None:
        msg = step.message
        if isinstance(msg, ChatTurn):
            await self._run_turn(msg, step)
            return
        if isinstance(msg, InputAppend):
            req = StepRequest(audio=msg.audio, force_listen=msg.force_listen, options=step.options, frames=msg.frames,
                              max_slice_nums=msg.max_slice_nums if msg.frames else [], voice=step.voice,
                              voice_name=step.voice_name)
        else:
            req = StepRequest(context={"text": msg.text, "kind": msg.kind, "respond": msg.respond},
                              options=step.options, voice=step.voice, voice_name=step.voice_name)
        async for ev in self.triton.step(req):
            if ev.kind == "error":
                await self._step_error(ev)
                return
            await self.send(self.state.on_step_event(msg.input_id, ev))
        if isinstance(msg, InputContext):
            await self.send(self.state.context_accepted(msg.input_id, msg.operation_id, msg.kind, msg.respond))

    async def _run_turn(self, turn: ChatTurn, step: _Step) -> None:
        chat = {"messages": turn.messages, "max_new_tokens": turn.max_new_tokens, "generate_audio": turn.generate_audio,
                "tts_ref_audio": turn.tts_ref_audio}
        req = StepRequest(options=step.options, voice=step.voice, chat=chat, voice_name=step.voice_name)
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
        if self.step_failed(ev.code, ev.message):
            await self.reject(ev.code, ev.message)

    async def send_closed(self, reason: str, message: str | None) -> None:
        await self.send(self.state.closed(reason, message))

    async def close_transport(self, code: int, reason: str) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            await self.ws.close(code=code, reason=reason[:120])

    async def reject(self, code: str, message: str) -> None:
        """A client error that keeps the session open."""
        await self.send(error_event(code, message, self.session_id))

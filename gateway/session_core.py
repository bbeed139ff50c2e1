"""What every gateway session shares, whatever its protocol: one Triton stream, steps run one at a time
in the order they were queued, and a close that ends the Triton sequence exactly once.

Subclasses say how to run a step (`run_step`) and how to tell the client it is over
(`send_closed`, `close_transport`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .protocol import CLOSE_NORMAL, CLOSE_SERVER_ERROR
from .settings import Settings
from .triton_stream import TritonSession

log = logging.getLogger("gateway")

# Step error codes that end the session with that reason instead of `backend_error`.
CLOSE_REASONS = {"context_full": "context_full", "invalid_config": "invalid_config"}
# Step error codes that are the client's input: rejected, the session goes on (its state is untouched).
CLIENT_ERRORS = {"invalid_chat", "bad_image", "bad_audio"}


class SessionCore:
    def __init__(self, session_id: str, triton: TritonSession, settings: Settings) -> None:
        self.session_id = session_id
        self.triton = triton
        self.settings = settings
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=settings.max_pending_steps)
        self._worker = asyncio.create_task(self._run_steps())
        self._closing: asyncio.Future[None] | None = None

    @property
    def closed(self) -> bool:
        return self._closing is not None

    def enqueue(self, item: Any) -> bool:
        """Queue a step; False when `max_pending_steps` are already waiting."""
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            return False
        return True

    @property
    def pending_steps(self) -> int:
        return self._queue.qsize()

    async def run_step(self, item: Any) -> None:
        raise NotImplementedError

    async def send_closed(self, reason: str, message: str | None) -> None:
        raise NotImplementedError

    async def close_transport(self, code: int, reason: str) -> None:
        raise NotImplementedError

    async def _run_steps(self) -> None:
        while self._closing is None:
            item = await self._queue.get()
            try:
                await asyncio.wait_for(self.run_step(item), self.settings.step_timeout_s)
            except asyncio.CancelledError:
                raise
            except asyncio.TimeoutError:
                self.fail("step_timeout", f"a step took over {self.settings.step_timeout_s:.0f} s")
                return
            except Exception as exc:  # noqa: BLE001 (Triton failed: the session ends, the server goes on)
                log.exception("session %s: step failed", self.session_id)
                self.fail("backend_error", str(exc))
                return

    def step_failed(self, code: str, message: str) -> bool:
        """A step answered with a coded error: True when it is the client's input (the caller says so and the
        session goes on); otherwise the session ends, with that code's reason."""
        if code in CLIENT_ERRORS:
            return True
        self.fail(CLOSE_REASONS.get(code, "backend_error"), f"{code}: {message}")
        return False

    def fail(self, reason: str, message: str) -> None:
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
                try:
                    await self.send_closed(reason, message)
                except Exception:  # noqa: BLE001 (the client may be gone)
                    log.debug("session %s: closed event not delivered", self.session_id)
            try:
                await self.close_transport(ws_code, reason)
            except Exception:  # noqa: BLE001
                log.debug("session %s: socket already closed", self.session_id)
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

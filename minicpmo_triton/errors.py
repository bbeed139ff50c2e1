"""The one error type that carries a code, from a stage row to the client, and its form inside a Triton error.

A stage answers a bad row with a `StepError` in that row's response; Triton carries only a message, so
the code travels as a `[code] ` prefix (`to_wire`), which the caller turns back into the error (`from_wire`).
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path


class Code:
    """The error codes a step can answer with (`StepEvent.code`, `StepError.code`)."""

    CONTEXT_FULL = "context_full"  # the session ends with this reason
    BAD_IMAGE = "bad_image"  # the client's input: refused, the session goes on
    BAD_AUDIO = "bad_audio"  # ditto
    INVALID_CHAT = "invalid_chat"  # ditto
    INVALID_AUDIO = "invalid_audio"
    INVALID_CONFIG = "invalid_config"  # the session ends with this reason
    INVALID_VOICE = "invalid_voice"  # ditto (a named voice whose file is not a usable reference)
    INVALID_INPUT = "invalid_input"
    NUMERIC_ERROR = "numeric_error"
    SEQUENCE_NOT_STARTED = "sequence_not_started"
    STAGE_ERROR = "stage_error"  # a stage failed for a reason it did not code: the server's fault
    INTERNAL_ERROR = "internal_error"


# Codes that are the client's input: refused, the session goes on (its state untouched).
CLIENT_ERRORS = frozenset({Code.INVALID_CHAT, Code.BAD_IMAGE, Code.BAD_AUDIO})
# Codes that end the session with that reason instead of `backend_error`.
CLOSE_REASONS = {Code.CONTEXT_FULL: "context_full", Code.INVALID_CONFIG: "invalid_config",
                 Code.INVALID_VOICE: "invalid_voice"}

STAGE_ERROR = Code.STAGE_ERROR
_WIRE = re.compile(r"\[([a-z_]+)\] (.*)", re.DOTALL)


class StepError(Exception):
    """A step, or one stage row of it, failed in a way the client is told about by `code`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def to_wire(exc: Exception) -> str:
    if isinstance(exc, StepError):
        return f"[{exc.code}] {exc}"
    return f"{type(exc).__name__}: {exc}"


def from_wire(message: str, source: str) -> StepError:
    """The error a stage (`source`) answered, its code kept; `stage_error` when it had none."""
    match = _WIRE.fullmatch(message)
    code, text = (match[1], match[2]) if match else (STAGE_ERROR, message)
    return StepError(code, f"{source}: {text}")


def describe(exc: BaseException) -> str:
    """An exception for a log line: its type, its message's length and where it was raised, never the message
    itself (it may quote the caller's text, audio or tokens)."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)) or "?"
    code = f" [{exc.code}]" if isinstance(exc, StepError) else ""
    return f"{type(exc).__name__}{code} (message of {len(str(exc))} characters) at {where}"

"""The one error type that carries a code, from a stage row to the client, and its form inside a Triton error.

A stage answers a bad row with a `StepError` in that row's response; Triton carries only a message, so
the code travels as a `[code] ` prefix (`to_wire`; a stage's uncoded failure as `[stage_error] `), which the caller
turns back into the error (`from_wire`). A message with no prefix is not a stage's answer but Triton's own: the stage
did not run the call (its stub died, its model is reloading), `stage_unavailable`, which the client is told it may
retry.
Codes are `Code` members, never strings: a misspelt member fails where it is named (and `tests/test_errors.py`
checks every `StepError(...)` in the packages names one), so no typo reaches the client as `backend_error`.
"""

from __future__ import annotations

import re
import traceback
from enum import StrEnum
from pathlib import Path


class Code(StrEnum):
    """The error codes a step can answer with (`StepEvent.code`, `StepError.code`); on the wire, the value.

    What the gateway does with each: `CLIENT_ERRORS` are the client's input (refused, the session goes on),
    `CLOSE_REASONS` end the session with their own reason, any other ends it with `backend_error`."""

    CONTEXT_FULL = "context_full"
    BAD_IMAGE = "bad_image"
    BAD_AUDIO = "bad_audio"
    INVALID_CHAT = "invalid_chat"
    INVALID_AUDIO = "invalid_audio"
    INVALID_CONFIG = "invalid_config"
    INVALID_VOICE = "invalid_voice"  # a voice reference the voice stage cannot use
    INVALID_INPUT = "invalid_input"
    NUMERIC_ERROR = "numeric_error"
    POOL_FULL = "pool_full"  # the KV pool has no room for this session now: retryable, once others end
    QUEUE_FULL = "queue_full"  # a stage's queue of work (token2wav's new voices) is full now: retryable
    SEQUENCE_NOT_STARTED = "sequence_not_started"
    STAGE_ERROR = "stage_error"  # a stage failed for a reason it did not code: the server's fault
    STAGE_UNAVAILABLE = "stage_unavailable"  # Triton could not run the stage (its stub died, its model reloads)
    DEVICE_UNAVAILABLE = "device_unavailable"  # a model given a GPU cannot reach it: it refuses to load (/health)
    INTERNAL_ERROR = "internal_error"

    def __str__(self) -> str:  # the value, in f-strings and logs, on every Python version
        return self.value


CLIENT_ERRORS = frozenset({Code.INVALID_CHAT, Code.BAD_IMAGE, Code.BAD_AUDIO})
CLOSE_REASONS = {Code.CONTEXT_FULL: "context_full", Code.INVALID_CONFIG: "invalid_config",
                 Code.INVALID_VOICE: "invalid_voice", Code.POOL_FULL: "pool_full", Code.QUEUE_FULL: "queue_full",
                 Code.STAGE_UNAVAILABLE: "backend_unavailable"}
# A stage's refusal to take more work now (its KV pool, its queue): the stage is alive, and busy.
ADMISSION_REFUSALS = frozenset({Code.POOL_FULL, Code.QUEUE_FULL})
# The same request may succeed later (a new session, after a backoff): told to retry.
RETRYABLE = ADMISSION_REFUSALS | {Code.STAGE_UNAVAILABLE}

STAGE_ERROR = Code.STAGE_ERROR
_WIRE = re.compile(r"\[([a-z_]+)\] (.*)", re.DOTALL)


def as_code(value: str) -> Code:
    """A code read off the wire; one this build does not know is a stage's uncoded failure."""
    try:
        return Code(value)
    except ValueError:
        return STAGE_ERROR


class StepError(Exception):
    """A step, or one stage row of it, failed in a way the client is told about by `code`."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = Code(code)  # a string that is no member fails here, where it is raised
        self.message = message


def to_wire(exc: Exception) -> str:
    if isinstance(exc, StepError):
        return f"[{exc.code}] {exc}"
    return f"[{STAGE_ERROR}] {type(exc).__name__}: {exc}"


def from_wire(message: str, source: str) -> StepError:
    """The error a stage (`source`) answered, its code kept (`stage_error` for one this build does not know); a
    message that is no stage's answer (no code) is Triton's: `stage_unavailable`."""
    match = _WIRE.fullmatch(message)
    if match is None:
        return StepError(Code.STAGE_UNAVAILABLE, f"{source}: {message}")
    code = as_code(match[1])
    known = code is not STAGE_ERROR or match[1] == STAGE_ERROR
    return StepError(code, f"{source}: {match[2] if known else message}")


def describe(exc: BaseException) -> str:
    """An exception for a log line: its type, its message's length and where it was raised, never the message
    itself (it may quote the caller's text, audio or tokens)."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)) or "?"
    code = f" [{exc.code}]" if isinstance(exc, StepError) else ""
    return f"{type(exc).__name__}{code} (message of {len(str(exc))} characters) at {where}"

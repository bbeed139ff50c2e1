"""The one error type that carries a code, from a stage row to the client, and its form inside a Triton error.

A stage answers a bad row with a `StepError` in that row's response; Triton carries only a message, so
the code travels as a `[code] ` prefix (`to_wire`), which the caller turns back into the error (`from_wire`).
"""

from __future__ import annotations

import re

STAGE_ERROR = "stage_error"  # a stage failed for a reason it did not code: the server's fault
_WIRE = re.compile(r"\[([a-z_]+)\] (.*)", re.DOTALL)


class StepError(Exception):
    """A step, or one stage row of it, failed in a way the client is told about by `code`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def to_wire(exc: Exception) -> str:
    if isinstance(exc, StepError):
        return f"[{exc.code}] {exc}"
    return f"{type(exc).__name__}: {exc}"


def from_wire(message: str, source: str) -> StepError:
    """The error a stage (`source`) answered, its code kept; `stage_error` when it had none."""
    match = _WIRE.fullmatch(message)
    code, text = (match[1], match[2]) if match else (STAGE_ERROR, message)
    return StepError(code, f"{source}: {text}")

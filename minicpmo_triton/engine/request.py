"""A request of the engine core: one stage call's row (vLLM's `Request`), from WAITING to FINISHED.

It carries what the core needs and nothing of the stage's: the session's place in the pool (`seq`, `past`), its
prefill, and, when it decodes, its rules (`rules`: the device's share as numbers, `rules.row`, and the host's
confirmation of each token the device chose, `rules.confirm`). Its `length` is the host's truth of the positions
written for it; `error` a failure of its own (it fails alone).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol


class Status(enum.Enum):
    WAITING = "waiting"  # queued: its session busy, no row free, or past this iteration's prefill budget
    PREFILLING = "prefilling"  # its prefill runs over one or more iterations (a long one in chunks)
    RUNNING = "running"  # decoding: a row of the persistent batch
    FETCHING = "fetching"  # done; its hidden rows come back with the next iteration's download (else kept there)
    FINISHED = "finished"
    FAILED = "failed"


class Rules(Protocol):
    """A decoding row's rules: what the device is told once (`row`), and the host's reading of each token."""

    @property
    def row(self) -> Any: ...  # an LlmRow or a TtsRow (engine/protocol.py)

    @property
    def n_hidden(self) -> int: ...  # hidden rows to bring back when the row is done (the TTS's condition)

    @property
    def hidden_on_device(self) -> bool: ...  # they stay on the device (the TTS in this process takes them there)

    def confirm(self, token: int, flags: int) -> bool:
        """The device chose `token` (with `flags`): the host's rules read it. True: the row goes on. Raising fails
        this row alone."""
        ...

    def done(self) -> None:
        """The row is over (finished or failed): give back what it drew ahead (the rng's unused uniforms)."""
        ...

    def take_hidden(self, hidden: Any) -> None:
        """Its kept hidden rows (np.ndarray, a device tensor where `hidden_on_device`, or None), handed over when it
        is settled."""
        ...


@dataclass(eq=False)
class Request:
    session: Any  # the one-step-per-session key (a correlation ID)
    seq: int  # its pool session
    past: int  # tokens already in the pool for it
    prefill: Any  # a Prefill (the LLM) or a TtsFeed (the TTS): len() its positions, part(a, b) a piece
    rules: Rules | None = None  # None: a prefill only (nothing is chosen)
    status: Status = Status.WAITING
    slot: int = -1  # its row in the persistent batch, while RUNNING
    done_prefill: int = 0  # prefill positions written so far
    length: int = 0  # positions written for it (the host's truth; the device may have run one more, wasted)
    hidden: Any = None  # the hidden rows it kept (np.ndarray, or a device tensor), once brought back or copied
    error: Exception | None = None
    join_iteration: int = 0
    done_iteration: int = 0
    t_admitted: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0  # its prefill's results read
    t_done: float = 0.0
    tag: Any = None  # the caller's own (the in-flight loop's row)

    @property
    def decodes(self) -> bool:
        return self.rules is not None

    @property
    def finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILED)

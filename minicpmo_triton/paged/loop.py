"""The decode loop both paged engines run (the LLM's and the TTS's): a packed forward of every row's new positions,
then each row's next token decided on the device, until every row is done; new rows may join between iterations
(in-flight batching) and a row that finishes leaves at once.

An engine gives `forward` (its inputs and head around the paged decoder) and `decide` (its sampling rules on the
device, and what each row still going feeds next); the loop is the same for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from .attention import Rows
from .model import PagedDecoder
from .traffic import Traffic


class Sized(Protocol):
    def __len__(self) -> int: ...


Feed = TypeVar("Feed", bound=Sized)
Pick = TypeVar("Pick")
Out = TypeVar("Out")
Driver = TypeVar("Driver")

Admit = Callable[[], "list[tuple[int, int, Any]]"]  # -> new rows: (session id, its length, its feed)
Done = Callable[[int, int], None]  # (row, its new length): the row left the loop after this iteration


@dataclass
class LoopTiming:
    prefill_ms: float
    decode_ms: float
    steps: int


class DecodeLoop(Generic[Feed, Out, Driver]):
    iterations = 0  # forwards run by `run` since the engine was built: the in-flight loop's clock

    def forward(self, seqs: list[int], pasts: list[int], feeds: list[Feed]) -> Out:
        raise NotImplementedError

    def decide(self, out: Out, rows: list[int], driver: Driver) -> dict[int, Feed]:
        """Each row's next token, chosen on the device; what the rows still going feed next."""
        raise NotImplementedError

    def run(self, seqs: list[int], pasts: list[int], feeds: list[Feed], driver: Driver,
            admit: Admit | None = None, done: Done | None = None) -> tuple[list[int], LoopTiming]:
        """Prefill every row, then decode until every row is done. Returns each row's new length.

        `admit`, called before each decode iteration, may bring new rows (their session, its length, their
        feed): they join that iteration's forward, their prefill packed beside the others' one-token steps (no
        padding, nobody waits for them), and are decided from then on like the rest; they are numbered on from
        the rows given (the driver must know them) and their lengths are returned after them. `done`, when given,
        is told of each row in the iteration it finishes, so its caller can be answered before the others are."""
        t0 = time.perf_counter()
        seqs, lengths = list(seqs), list(pasts)
        feed: dict[int, Feed] = dict(enumerate(feeds))  # row -> what it feeds in the next forward
        prefill_ms, steps = 0.0, 0
        while feed:
            rows = list(feed)
            out = self.forward([seqs[r] for r in rows], [lengths[r] for r in rows], [feed[r] for r in rows])
            for r in rows:
                lengths[r] += len(feed[r])
            if not steps:
                prefill_ms = (time.perf_counter() - t0) * 1000
            steps += 1
            self.iterations += 1
            feed = self.decide(out, rows, driver)
            if done is not None:
                for r in rows:
                    if r not in feed:
                        done(r, lengths[r])
            for seq, past, pre in admit() if admit is not None else []:
                feed[len(seqs)] = pre
                seqs.append(seq)
                lengths.append(past)
        timing = LoopTiming(prefill_ms, (time.perf_counter() - t0) * 1000 - prefill_ms, max(0, steps - 1))
        return lengths, timing


def packed_forward(model: PagedDecoder, traffic: Traffic, seqs: list[int], pasts: list[int], counts: list[int],
                   x: torch.Tensor) -> tuple[torch.Tensor, Rows, torch.Tensor]:
    """The decoder over every row's new positions packed in `x` (row after row, no padding), their keys and values
    written into the pool at past .. past + count - 1. Returns the hidden states, the rows and each row's last
    position in them (on the device)."""
    pool, up, device = model.pool, traffic.upload, model.device
    for seq, past, n in zip(seqs, pasts, counts, strict=True):
        pool.reserve(seq, past + n)  # a no-op when the stage reserved the step at its check
    rows = Rows(pool.block_table(seqs, [p + n for p, n in zip(pasts, counts, strict=True)]), pasts, counts)
    positions = np.concatenate([np.arange(p, p + n) for p, n in zip(pasts, counts, strict=True)])
    slots = torch.cat([pool.slots(s, p, n) for s, p, n in zip(seqs, pasts, counts, strict=True)])
    hidden = model.forward(x, up("inputs", positions, device), up("inputs", slots, device), rows)
    last = up("inputs", [s + n - 1 for s, n in zip(rows.start, counts, strict=True)], device)
    return hidden, rows, last


def asking(logits: torch.Tensor, rows: list[int], pick: Callable[[int], Pick | None], traffic: Traffic,
           device: torch.device) -> tuple[list[int], list[Pick], torch.Tensor]:
    """The rows that want a token this iteration (their driver's `pick` is not None), their picks and their rows of
    the forward's logits (still on the device)."""
    asked = [(pos, row, p) for pos, row in enumerate(rows) if (p := pick(row)) is not None]
    at = traffic.upload("inputs", np.array([pos for pos, _, _ in asked], np.int64), device)
    return [row for _, row, _ in asked], [p for _, _, p in asked], logits[at]

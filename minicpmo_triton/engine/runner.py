"""The engine core's model runner: the weights, the pool, the persistent batch and the head's rules; `step(batch)`
runs one iteration and hands back where its picks will be, calling nothing of the stages.

One iteration:
1. the iteration's host changes go to the device in one copy (`staging`): rows admitted (their rules), rows
   retired, the pool's new blocks, the prefills' ids, positions, slots and embeddings;
2. the decode step over rows [0, bucket) of the persistent batch: embed each live row's next token, the decoder
   over the pool (`attention.Decode` from the batch's buffers), the head's rules choose each row's next token and
   move its state on (engine/llm_head.py, engine/tts_head.py) -- all of it fixed shapes over persistent buffers,
   replayed as one CUDA graph per (bucket, table width) on a GPU (engine/graphs.py), eager elsewhere;
3. the prefills, packed without padding through the varlen path; each last chunk's row chooses its first token by
   the same rules, at its row;
4. one non-blocking download of rows [0, extent)'s (token, flags) into pinned memory, an event after it.
The host waits for that event only when it reads the picks (`Launched.picks`): the one sync of an iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from .attention import Decode, Rows
from .graphs import DecodeGraphs
from .model import PagedDecoder
from .pool import KvPool
from .request import Request
from .scheduler import Batch, Prefilling
from .staging import Staging


class RowState:
    """The generic part of the persistent batch, one entry per row: what it feeds next and where, its pool session,
    whether it decodes, and its output (token, flags) of the last iteration."""

    def __init__(self, capacity: int, pool: KvPool) -> None:
        dev = pool.device
        self.ids = torch.zeros(capacity, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(capacity, dtype=torch.int64, device=dev)  # where `ids` goes
        self.seq = torch.full((capacity,), pool.trash_seq, dtype=torch.int64, device=dev)
        self.live = torch.zeros(capacity, dtype=torch.bool, device=dev)
        self.out = torch.zeros(capacity, 2, dtype=torch.int64, device=dev)


class Head(Protocol):
    """A decoder's own part (the LLM's, the TTS's): its input, its head, its rules over per-row buffers."""

    model: PagedDecoder
    head_bytes: int

    def admit(self, slots: list[int], rows: list[Any]) -> bool: ...

    def width(self, rows: list[Any]) -> int: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def prefill_input(self, staging: Staging, prefills: list[Any]) -> Callable[[], torch.Tensor]:
        """Stage the prefills' inputs; the returned function makes their packed input once the copy has landed."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def keep_decoded(self, hidden: torch.Tensor, b: int, was_live: torch.Tensor) -> None: ...

    def keep_prefilled(self, hidden: torch.Tensor, slots: torch.Tensor) -> None: ...

    def choose(self, raw: torch.Tensor, rows: slice | torch.Tensor, state: Any, was_live: torch.Tensor, width: int,
               chat: bool = True) -> None: ...


@dataclass
class Launched:
    """An iteration on its way: its picks land in pinned host memory; `picks()` waits for them (the one sync)."""

    batch: Batch
    host: torch.Tensor  # [extent, 2] (token, flags)
    event: Any  # a CUDA event after the download (None on the CPU: the copy has run)
    fetches: list[tuple[Request, torch.Tensor]]  # finished rows' hidden rows, brought back with it
    clock: int = 0  # the core's iteration count once this one has run

    def picks(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


class ModelRunner:
    def __init__(self, head: Head, capacity: int, graphs: bool | None = None) -> None:
        """`capacity`: rows of the persistent batch; `graphs`: CUDA graphs of the decode step (None: on CUDA)."""
        self.head = head
        self.model = head.model
        self.pool = self.model.pool
        self.device = self.pool.device
        self.staging = self.pool.writes.staging
        self.writes = self.pool.writes
        self.capacity = capacity
        self.state = RowState(capacity, self.pool)
        cuda = self.device.type == "cuda"
        # two: an iteration's picks land in one while the previous one's, not read yet, sit in the other
        self.pinned = [torch.zeros((capacity, 2), dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._turn = 0
        self.hidden_host: torch.Tensor | None = None
        self.graphs = DecodeGraphs(self._decode) if (cuda if graphs is None else graphs) else None
        self.narrow = head.width([])  # the decode step's top-k width, unless a row needs more
        self.topk = self.narrow
        self.chat = False  # some row of the batch is a chat row (the LLM's): its rules are computed
        self._wide: dict[int, int] = {}  # rows needing a wider top-k
        self._chat_rows: set[int] = set()
        self._fetches: list[tuple[Request, torch.Tensor]] = []

    # ---- one iteration ----
    def step(self, batch: Batch) -> Launched:
        self._admit(batch)
        prefill = self._stage_prefills(batch.prefills)
        self.writes.flush()  # the one copy: rules, retirements, pool tables, prefill inputs
        if batch.decode:
            lengths = np.array([r.length for r in batch.results if r.done_prefill == len(r.prefill)], np.int64)
            self.model.count(lengths, np.ones_like(lengths), batch.decode, self.head.head_bytes)
            key = (batch.decode, batch.width, self.topk, self.chat)
            if self.graphs is not None:
                self.graphs.run(key)
            else:
                self._decode(*key)
        if prefill is not None:
            self._prefill(*prefill)
        extent = batch.extent
        host = self.pinned[self._turn][:extent]
        self._turn ^= 1
        host.copy_(self.state.out[:extent], non_blocking=self.device.type == "cuda")
        self.pool.traffic.to_host["outputs"] += host.numel() * host.element_size()
        fetches, self._fetches = self._fetches, []
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return Launched(batch, host, event, fetches)

    def feed(self, seq: int, past: int, prefill: Any) -> None:
        """`prefill` into pool session `seq` at `past` now, alone (a window slide's closing tokens): a forward of
        its own between two iterations, no token chosen."""
        staged = self._stage_prefills([Prefilling(Request(None, seq, past, prefill), 0, len(prefill), False)])
        self.writes.flush()
        assert staged is not None
        self._prefill(*staged)

    def logits(self, seqs: list[int], pasts: list[int], prefills: list[Any]) -> torch.Tensor:
        """Each row's last-position logits [B, vocab] (fp32, on the device) of one varlen forward of `prefills` into
        pool sessions `seqs` at `pasts`, no token chosen (the parity checks compare backends and engines with it)."""
        rows = [Prefilling(Request(None, s, p, f), 0, len(f), False) for s, p, f in zip(seqs, pasts, prefills,
                                                                                       strict=True)]
        staged = self._stage_prefills(rows)
        last = self.staging.put(np.cumsum([len(f) for f in prefills]) - 1)
        self.writes.flush()
        assert staged is not None
        hidden = self._prefill(*staged)
        return self.head.logits(hidden.index_select(0, self.staging.view(last)))

    def copy_hidden(self, req: Request, n: int) -> torch.Tensor:
        """`req`'s first `n` kept hidden rows, copied on the device (in stream order, as `fetch_hidden`'s: before a row
        admitted to its slot writes there), for a consumer in this process (the TTS's condition)."""
        hidden = getattr(self.head, "hidden", None)
        assert hidden is not None, "this head keeps no hidden rows"
        return hidden[req.slot, :n].clone()

    def fetch_hidden(self, req: Request, n: int) -> None:
        """Bring `req`'s first `n` kept hidden rows back with the next iteration's download (its row is free: a
        row admitted there writes its own only after this copy, in stream order)."""
        hidden = getattr(self.head, "hidden", None)
        assert hidden is not None, "this head keeps no hidden rows"
        if self.hidden_host is None or self.hidden_host.shape != hidden.shape:
            self.hidden_host = torch.zeros(hidden.shape, dtype=hidden.dtype, pin_memory=self.device.type == "cuda")
        dst = self.hidden_host[req.slot, :n]
        dst.copy_(hidden[req.slot, :n], non_blocking=self.device.type == "cuda")
        self.pool.traffic.to_host["outputs"] += dst.numel() * dst.element_size()
        self._fetches.append((req, dst))

    def _admit(self, batch: Batch) -> None:
        state, put = self.state, self.writes.rows
        if batch.retired:
            put(state.live, batch.retired, np.zeros(len(batch.retired), bool))
        if batch.admitted:
            slots = [r.slot for r in batch.admitted]
            rows = [r.rules.row for r in batch.admitted]  # type: ignore[union-attr]
            put(state.live, slots, np.zeros(len(slots), bool))
            put(state.seq, slots, np.array([r.seq for r in batch.admitted], np.int64))
            if self.head.admit(slots, rows) and self.graphs is not None:
                self.graphs.clear()  # the head's per-step buffers grew: every captured graph read the old ones
            for slot, row in zip(slots, rows, strict=True):
                self._wide.pop(slot, None)
                self._chat_rows.discard(slot)
                if (width := self.head.width([row])) > self.narrow:
                    self._wide[slot] = width
                if getattr(row, "kind", 0) == 1:  # CHAT
                    self._chat_rows.add(slot)
        # what the decode step computes follows the rows in it (a graph per variant)
        rows_now = {r.slot for r in batch.results} | {p.request.slot for p in batch.prefills}
        self._wide = {s: w for s, w in self._wide.items() if s in rows_now}
        self._chat_rows &= rows_now
        self.topk = max([self.narrow, *self._wide.values()])
        self.chat = bool(self._chat_rows)

    # ---- the decode step: fixed shapes over persistent buffers (what a CUDA graph captures) ----
    def _decode(self, b: int, w: int, topk: int, chat: bool) -> None:
        state, pool, head = self.state, self.pool, self.head
        bs = pool.shape.block_size
        was_live = state.live[:b].clone()
        seq = torch.where(was_live, state.seq[:b], pool.trash_seq)
        pos = torch.where(was_live, state.positions[:b], 0)
        table = pool.device_tables.index_select(0, seq)[:, :w]
        slots = torch.where(was_live, table.gather(1, (pos // bs).clamp(max=w - 1)[:, None])[:, 0] * bs + pos % bs,
                            pool.trash_slot)
        meta = Decode(table, torch.where(was_live, pos + 1, 1), seq)
        hidden = self.model.forward(head.embed(state.ids[:b]), pos, slots, meta)
        head.keep_decoded(hidden, b, was_live)
        head.choose(head.logits(hidden), slice(0, b), state, was_live, topk, chat)

    # ---- the prefills: varlen, eager ----
    def _stage_prefills(self, prefills: list[Prefilling]) -> tuple[Any, ...] | None:
        if not prefills:
            return None
        pool, put, state = self.pool, self.staging.put, self.state
        pasts = [p.request.past + p.start for p in prefills]
        counts = [p.count for p in prefills]
        seqs = [p.request.seq for p in prefills]
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(pasts, counts, strict=True)])
        slots = np.concatenate([pool.slots(s, a, n) for s, a, n in zip(seqs, pasts, counts, strict=True)])
        starts = np.cumsum([0] + counts[:-1])
        choosers = [i for i, p in enumerate(prefills) if p.chooses]
        if choosers:  # their rows' generic state: at the prefill's last position, choosing from there
            c_slots = [prefills[i].request.slot for i in choosers]
            self.writes.rows(state.positions, c_slots, np.array([pasts[i] + counts[i] - 1 for i in choosers]))
        staged = (put(positions), put(slots), put(np.asarray(seqs, np.int64)),
                  put(np.array([starts[i] + counts[i] - 1 for i in choosers], np.int64)),
                  put(np.array([prefills[i].request.slot for i in choosers], np.int64)))
        width = max(self.pool.shape.blocks_for(a + n) for a, n in zip(pasts, counts, strict=True))
        x = self.head.prefill_input(self.staging, [p.request.prefill.part(p.start, p.start + p.count)
                                                    for p in prefills])
        first_hidden = [i for i, p in enumerate(prefills) if p.start == 0 and p.request.decodes
                        and getattr(p.request.rules.row, "hidden_at_prefill", False)]  # type: ignore[union-attr]
        wanted = (put(np.array([starts[i] for i in first_hidden], np.int64)),
                  put(np.array([prefills[i].request.slot for i in first_hidden], np.int64))) if first_hidden else None
        work = (np.asarray(pasts), np.asarray(counts), len(choosers))
        return staged, x, Rows(torch.empty(0), pasts, counts), width, wanted, work, len(choosers)

    def _prefill(self, staged: tuple[Any, ...], x: Any, rows: Rows, width: int, wanted: Any, work: tuple[Any, ...],
                 n_choose: int) -> torch.Tensor:
        view = self.staging.view
        positions, slots, seqs, last, choose_slots = (view(s) for s in staged)
        rows.seq = seqs
        rows.table = self.pool.device_tables.index_select(0, seqs)[:, :width]
        x = x()  # the head's input, made once the staging copy has landed
        self.model.count(work[0], work[1], work[2], self.head.head_bytes)
        hidden = self.model.forward(x, positions, slots, rows)
        if wanted is not None:  # a chat chunk's carried token: its hidden row is the TTS's too
            self.head.keep_prefilled(hidden.index_select(0, view(wanted[0])), view(wanted[1]))
        if n_choose:
            was_live = torch.ones(n_choose, dtype=torch.bool, device=self.device)
            raw = self.head.logits(hidden.index_select(0, last))
            self.head.choose(raw, choose_slots, self.state, was_live, self.topk, self.chat)
        return hidden

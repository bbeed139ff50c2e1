"""The engine core's scheduler: which requests an iteration runs, and where (vLLM v1's `Scheduler`, our rules).

- **Admission**: a waiting request joins when its session has no other request in the core (one step per
  session: a session's next call is prepared only after its previous answer, as the stage's state demands) and,
  when it decodes, a row of the persistent batch is free (the lowest, so the batch's bucket stays small). Its pool
  room was reserved before it was queued (the stage's `check`: `pool_full` is refused there, before the batch,
  never mid-step), so admission never fails.
- **Prefill chunking**: an iteration prefills at most `prefill_tokens` positions across the joining requests; a
  longer prefill goes on in the next iterations, its row chosen with its last chunk. The decoding rows run every
  iteration beside them (their static step; the prefills through the varlen path), so admitting a session never
  holds them up.
- **The batch**: rows [0, bucket) run the decode step, the bucket the smallest of `BUCKETS` holding every row in
  use; the table width (blocks a row may read) from the rows' host-known lengths, bucketed too.
A row the host ended that the device may still run (its last token ended it by a host-only rule) is retired:
made idle with the iteration's writes.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from .request import Request, Status

BUCKETS = tuple(1 << i for i in range(13))  # 1, 2, 4, ..., 4096 rows: CUDA graphs are captured per bucket


def bucket(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    return next(b for b in buckets if b >= n)


@dataclass
class Prefilling:
    request: Request
    start: int  # offset into the request's prefill
    count: int
    chooses: bool  # its last chunk of a decoding request: its row chooses its first token from it


@dataclass
class Batch:
    """One iteration's work, as the scheduler planned it."""

    decode: int = 0  # rows [0, decode) of the persistent batch run the decode step
    width: int = 1  # blocks of table each decoding row may read (bucketed)
    prefills: list[Prefilling] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # rows whose rules are written now
    retired: list[int] = field(default_factory=list)  # rows made idle now
    results: list[Request] = field(default_factory=list)  # the rows whose token comes back, by their slot

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefills

    @property
    def extent(self) -> int:
        """Rows [0, extent) hold this iteration's results."""
        return max([self.decode] + [p.request.slot + 1 for p in self.prefills if p.chooses])


class Scheduler:
    def __init__(self, capacity: int, block_size: int, max_blocks: int, prefill_tokens: int = 2048,
                 widths: tuple[int, ...] | None = None) -> None:
        """`capacity`: rows of the persistent batch; `prefill_tokens`: an iteration's most prefill positions;
        `widths`: the table widths decode may use (None: powers of two up to the pool's `max_blocks`)."""
        self.capacity = capacity
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.prefill_tokens = prefill_tokens
        self.widths = widths or tuple(sorted({min(1 << i, max_blocks) for i in range(max_blocks.bit_length() + 1)}))
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # taken in, its prefill not done
        self.running: dict[int, Request] = {}  # slot -> request
        self.sessions: set[object] = set()  # sessions with a request taken in
        self._free = list(range(capacity))  # a heap: the lowest row first
        self._retire: list[int] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def busy(self, session: object) -> bool:
        """The session has a request in the core (waiting or taken in)."""
        return session in self.sessions or any(r.session == session for r in self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self) -> Batch:
        batch = Batch(retired=self._retire)
        self._retire = []
        decoding = list(self.running.values())  # rows whose prefill is done: their next token (rows joining now
        # choose their first from their prefill, after the decode step)
        budget = self.prefill_tokens
        # prefills under way go first (their rows wait on them), then new requests in order
        for req in list(self.prefilling):
            budget -= self._prefill(batch, req, budget)
        held: deque[Request] = deque()
        while self.waiting:
            req = self.waiting.popleft()
            if budget <= 0 or req.session in self.sessions or (req.decodes and not self._free):
                held.append(req)
                continue
            self.sessions.add(req.session)
            req.status, req.length = Status.PREFILLING, req.past
            if req.decodes:
                req.slot = heapq.heappop(self._free)
            self.prefilling.append(req)
            budget -= self._prefill(batch, req, budget)
        self.waiting = held
        if decoding:
            batch.decode = bucket(max(r.slot for r in decoding) + 1)
            longest = max(r.length for r in decoding) + 2  # the device may be an iteration ahead of the host
            need = min(self.max_blocks, -(-longest // self.block_size))
            batch.width = next(w for w in self.widths if w >= need)
            batch.results = decoding + batch.results
        return batch

    def _prefill(self, batch: Batch, req: Request, budget: int) -> int:
        """The next chunk of `req`'s prefill into the batch (at most `budget` positions); how many it took."""
        left = len(req.prefill) - req.done_prefill
        count = min(left, max(budget, 0))
        if count <= 0:
            return 0
        last = count == left
        batch.prefills.append(Prefilling(req, req.done_prefill, count, last and req.decodes))
        req.done_prefill += count
        req.length = req.past + req.done_prefill  # written by this iteration
        if req.done_prefill == count and req.decodes:
            batch.admitted.append(req)
        if last:
            self.prefilling.remove(req)
            if req.decodes:
                self.running[req.slot] = req
                req.status = Status.RUNNING
                batch.results.append(req)
        return count

    def release(self, req: Request, retire: bool) -> None:
        """`req` is done (finished or failed): its row is free for a later iteration; `retire`: the device may
        still be running it (the host's rules ended it, or it failed), so it is made idle first."""
        if req.slot >= 0 and self.running.get(req.slot) is req:
            del self.running[req.slot]
            if retire:
                self._retire.append(req.slot)
            heapq.heappush(self._free, req.slot)
        if req in self.prefilling:
            self.prefilling.remove(req)
        self.sessions.discard(req.session)

    def clear(self) -> list[Request]:
        """Every request taken in, given up (after a forward that failed): the rows idle, the sessions free."""
        taken = list(self.prefilling) + list(self.running.values())
        for req in taken:
            self.release(req, retire=True)
        return taken

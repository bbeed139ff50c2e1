"""CUDA graphs of the decode step, one per (bucket, table width, top-k width, chat rules): the whole iteration -- the
embedding, every layer (compiled), the paged attention, the head, the rules -- replayed by one launch.

The step reads and writes only persistent buffers (the batch's rows, the head's rules, the pool), so a graph
captured once serves every later iteration of its key: the host writes what changed into them (engine/staging.py)
and replays. A key's first iteration runs eagerly (it compiles what it calls and warms the libraries' lazy state);
its second is captured, then replayed, and so is every later one. Capture records without running, so no
iteration runs twice. A buffer that is reallocated (the head's per-step buffers growing) makes every graph stale:
`clear` drops them.

Only on CUDA (`ModelRunner(graphs=None)`); elsewhere the same step runs eagerly, which the CPU tests hold to be
sync-free and to read the same storages every iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Key = tuple[Any, ...]


class DecodeGraphs:
    def __init__(self, step: Callable[..., None]) -> None:
        self.step = step
        self.graphs: dict[Key, Any] = {}
        self.seen: set[Key] = set()
        self.pool: Any = None  # one memory pool for every graph (their iterations never overlap)
        self.captures = 0
        self.replays = 0

    def run(self, key: Key) -> None:
        graph = self.graphs.get(key)
        if graph is None and key not in self.seen:
            self.seen.add(key)
            self.step(*key)  # eager: compiles, and is this iteration's work
            return
        if graph is None:
            torch.cuda.synchronize()  # once per key: the capture starts from a quiet stream
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.step(*key)
            self.pool = graph.pool()
            self.graphs[key] = graph
            self.captures += 1
        graph.replay()
        self.replays += 1

    def clear(self) -> None:
        self.graphs.clear()
        self.seen.clear()

"""The CFM's Euler steps (5 passes of the DiT estimator: most of token2wav's work) as one CUDA graph per batch
bucket: a whole chunk's rows (50 mel frames each) padded to the next bucket, their key lists padded to a multiple
of KEY_BLOCK, copied into a graph's static inputs and replayed, so a chunk's 5 steps cost a few launches instead
of thousands.

Padding rows are the streamer's scratch slot (a slot no turn holds: what they write there nobody reads) with one
real key each (slot 0's first frame, so their softmax is finite); padding keys are masked. What the graphs hold
are the pool's tensors by address: the pool's growth (`FlowPool.grow`) drops them (`version`), and they are made
again at their next use.

`capture=False` runs the same padded call without a graph: what the CPU runs of this module in the tests, so the
padding's correctness is checked where there is no GPU (tests/test_token2wav_ring.py); the capture and replay are
exercised by the GPU script (bench/gpu_check_token2wav.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from .token2wav_flow import RingFlow
from .token2wav_ring import FlowPool, FlowRows

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
KEY_BLOCK = 64  # key lists padded to a multiple of this: a few graphs per bucket as the voices' lengths vary


@dataclass
class _Graph:
    """One bucket's static inputs and outputs (and its CUDA graph, when captured)."""

    inputs: dict[str, torch.Tensor]
    rows: FlowRows
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None
    graph: Any = None


class CfmGraphs:
    def __init__(self, ring: RingFlow, t_span: np.ndarray, frames: int, capture: bool) -> None:
        """`frames`: the chunks graphed (a whole chunk's mel frames); others run eagerly."""
        self.ring, self.t_span, self.frames, self.capture = ring, t_span, frames, capture
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._version = -1
        self.calls = 0  # chunks' CFM run through a bucket
        self.replays = 0  # of them, graphs replayed (CUDA)

    def fits(self, rows: FlowRows, frames: int) -> bool:
        return frames == self.frames and rows.size <= BUCKETS[-1]

    def run(self, mu: torch.Tensor, x: torch.Tensor, spk: torch.Tensor, cond: torch.Tensor, rows: FlowRows,
            pool: FlowPool, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`RingFlow.cfm` for rows that `fit`, through the bucket's graph: mel [B, 80, n] and the new DiT conv
        caches [steps, depth, 2B, 2, 2*hidden]."""
        if pool.version != self._version:  # the pool's tensors were reallocated: graphs hold the old ones
            self._graphs, self._version = {}, pool.version
        b = rows.size
        bucket = next(n for n in BUCKETS if n >= b)
        width = -(-rows.est_keys.shape[1] // KEY_BLOCK) * KEY_BLOCK
        g = self._graphs.get((bucket, width))
        if g is None:
            g = self._graphs[(bucket, width)] = self._static(mu, x, spk, rows, bucket, width)
        self._load(g, mu, x, spk, cond, rows, scratch, pool.frames)
        self.calls += 1
        if not self.capture:
            g.outputs = self._cfm(g, pool)
        else:
            if g.graph is None:
                g.graph, g.outputs = self._capture(g, pool)
            g.graph.replay()
            self.replays += 1
        assert g.outputs is not None
        mel, cnn = g.outputs
        return mel[:b].clone(), torch.cat([cnn[:, :, :b], cnn[:, :, bucket:bucket + b]], dim=2)

    def _cfm(self, g: _Graph, pool: FlowPool) -> tuple[torch.Tensor, torch.Tensor]:
        i = g.inputs
        return self.ring.cfm(i["mu"], i["x"], i["spk"], i["cond"], self.t_span, g.rows, pool)

    @staticmethod
    def _static(mu: torch.Tensor, x: torch.Tensor, spk: torch.Tensor, rows: FlowRows, bucket: int,
                width: int) -> _Graph:
        def like(t: torch.Tensor, *shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=t.dtype, device=t.device)

        n = mu.shape[2]
        inputs = {"mu": like(mu, bucket, mu.shape[1], n), "x": like(x, bucket, x.shape[1], n),
                  "spk": like(spk, bucket, spk.shape[1]), "cond": like(mu, bucket, mu.shape[1], n)}
        static = {f.name: like(getattr(rows, f.name), bucket, *getattr(rows, f.name).shape[1:])
                  for f in fields(FlowRows)}
        for name in ("est_keys", "est_valid"):
            static[name] = like(getattr(rows, name), bucket, width)
        return _Graph(inputs, FlowRows(**static))

    @staticmethod
    def _load(g: _Graph, mu: torch.Tensor, x: torch.Tensor, spk: torch.Tensor, cond: torch.Tensor, rows: FlowRows,
              scratch: int, frames: int) -> None:
        """The call's rows into the static inputs; the padding rows are the scratch slot's, one real key each."""
        b = rows.size
        for name, value in (("mu", mu), ("x", x), ("spk", spk), ("cond", cond)):
            g.inputs[name][:b].copy_(value)
            g.inputs[name][b:].zero_()
        s = g.rows
        s.own[:b].copy_(rows.own)
        s.own[b:].fill_(scratch)
        width = rows.est_keys.shape[1]
        s.est_keys.zero_()
        s.est_keys[:b, :width].copy_(rows.est_keys)
        s.est_valid.zero_()
        s.est_valid[:b, :width].copy_(rows.est_valid)
        s.est_valid[b:, 0] = True
        s.est_new[:b].copy_(rows.est_new)
        s.est_new[b:] = 2 * scratch * frames + torch.arange(rows.est_new.shape[1], device=s.est_new.device)

    def _capture(self, g: _Graph, pool: FlowPool) -> tuple[Any, tuple[torch.Tensor, torch.Tensor]]:
        """Warm up on a side stream (as torch.cuda.graphs asks), then capture the call."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._cfm(g, pool)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self._cfm(g, pool)
        return graph, outputs


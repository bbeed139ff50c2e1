"""A lane: device work done off the engine's stream (a call's admission: its mel and streaming Whisper), and its
hand-off to the engine, which reads what it made.

On a GPU the lane is a CUDA stream of its own, so the preparation thread's kernels do not queue behind the engine
thread's iterations on one stream (nor those behind them). What the lane made is handed over with an event recorded
after it (`Handoff`): the engine's stream waits for that event before the request's first iteration (a wait on the
device, not on the host), and the tensors are marked in use on the engine's stream (`record_stream`), so the caching
allocator does not give their memory back to the lane while the engine may still read it. Elsewhere (the CPU) the
work is done when the call returns: the lane is the caller's thread and the hand-off waits for nothing (and torch
is not imported: the ONNX stream encoder has a lane too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Handoff:
    """What a lane made, for a consumer on another stream: `wait()` there before reading it."""

    def __init__(self, event: Any = None, tensors: tuple[Any, ...] = (), device: Any = None) -> None:
        self.event = event
        self.tensors = tensors
        self.device = device

    def wait(self) -> None:
        """The current stream (the consumer's) waits for the lane's work on the device; the host does not."""
        if self.event is None:
            return
        import torch

        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for t in self.tensors:
            t.record_stream(stream)


class Lane:
    def __init__(self, device: Any = None) -> None:
        """`device`: a torch device (None: the host, no stream)."""
        self.device = device
        self.stream: Any = None
        if getattr(device, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize(device)  # what the load queued (the pools, the weights) is there before the lane
            self.stream = torch.cuda.Stream(device)

    @contextmanager
    def work(self) -> Iterator[None]:
        """Device work launched inside goes on the lane's stream."""
        if self.stream is None:
            yield
            return
        import torch

        with torch.cuda.stream(self.stream):
            yield

    def handoff(self, tensors: list[Any]) -> Handoff:
        """The work launched so far, for a consumer on another stream (`tensors`: what it will read)."""
        if self.stream is None:
            return Handoff()
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
        return Handoff(event, tuple(t for t in tensors if getattr(t, "is_cuda", False)), self.device)

"""An asyncio loop on a virtual clock, for tests that assert time windows.

`loop.time()` starts at 0 and moves only when nothing is ready to run: it then jumps to the next timer
(`asyncio.sleep`, `call_later`, timeouts). Callbacks run in the order of their deadlines, as on a real loop, but
no wall time passes, so a window of 20 ms is exactly 20 ms however loaded the machine is.
`@virtual_time` runs an async test function on such a loop; code under test reads the loop's clock
(`asyncio.get_running_loop().time()`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        # nothing ready: jump to the earliest live timer (a cancelled one must not move the clock)
        if not self._ready:  # type: ignore[attr-defined]
            live = [h.when() for h in self._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
            if live:
                self._virtual_now = max(self._virtual_now, min(live))
        super()._run_once()  # type: ignore[misc]


def virtual_time(test: Callable[P, Awaitable[T]]) -> Callable[P, T]:
    """An async test run to completion on a fresh VirtualClockLoop."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        loop = VirtualClockLoop()
        try:
            return loop.run_until_complete(test(*args, **kwargs))  # type: ignore[arg-type]
        finally:
            loop.close()

    return run


def now() -> float:
    """The running loop's clock (virtual under `virtual_time`)."""
    return asyncio.get_running_loop().time()


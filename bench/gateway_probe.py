"""The gateway (`python -m gateway.serve ARGS`) with a memory probe, for bench/soak.py: on SIGUSR1 it writes
what it holds to the JSON file named by SOAK_PROBE_REPORT (on SIGUSR2: after malloc_trim). Bench-only: the
product has no such hook.

    SOAK_PROBE_REPORT=/tmp/probe.json python bench/gateway_probe.py --triton-url ... --port ...

The report: live objects of the gateway's own classes and of the libraries' per-session ones, asyncio tasks,
threads, the registry's and limiters' table sizes, glibc's heap (mallinfo2: in use vs free, so fragmentation
shows), and with SOAK_PROBE_TRACEMALLOC=1 the Python allocations that grew most since the last report.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import os
import re
import signal
import sys
import threading
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway import serve  # noqa: E402 (after the sys.path line: run as a file)

WATCHED = ("gateway.", "tritonclient.", "grpc.", "starlette.", "uvicorn.", "websockets.", "onnxruntime.")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap() -> dict[str, float]:
    """glibc's view: bytes handed out (in use) and held free in its arenas, in MiB."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    mib = 1 << 20
    return {"arena_mib": m.arena / mib, "mmap_mib": m.hblkhd / mib, "in_use_mib": m.uordblks / mib,
            "free_mib": m.fordblks / mib}


def arenas() -> list[dict[str, float]]:
    """malloc_info's per-arena figures (MiB): what each arena took from the system and what of it is free."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    except (OSError, AttributeError):
        return []
    path = f"/tmp/gateway_probe_malloc_{os.getpid()}.xml"
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    xml = Path(path).read_text()
    os.unlink(path)
    out = []
    for heap_xml in re.findall(r'<heap nr="\d+">(.*?)</heap>', xml, re.S):
        free = sum(int(n) for n in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', heap_xml))
        current = re.search(r'<system type="current" size="(\d+)"', heap_xml)
        out.append({"system_mib": int(current.group(1)) / (1 << 20) if current else 0.0, "free_mib": free / (1 << 20)})
    return out


def trim() -> None:
    """Give the arenas' free pages back to the system (what RSS is left is then what is in use)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def objects_by_type() -> Counter[str]:
    counts: Counter[str] = Counter()
    for obj in gc.get_objects():
        cls = type(obj)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name.startswith(WATCHED):
            counts[name] += 1
    return counts


def tables() -> dict[str, int]:
    """The gateway's per-session tables, found by type (the probe has no handle on the app)."""
    from gateway.auth import RateLimit, SessionCounts
    from gateway.registry import Gateway

    out: dict[str, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, Gateway):
            out["gateway.sessions"] = len(obj.sessions)
            out["gateway.waiters"] = obj.queue_length
        elif isinstance(obj, SessionCounts):
            out[f"session_counts.{obj.code}"] = len(obj._counts)
        elif isinstance(obj, RateLimit):
            out["resume_limiter"] = len(obj._seen)
    return out


_last: tracemalloc.Snapshot | None = None


def report(path: Path) -> dict[str, Any]:
    global _last
    gc.collect()
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # no running loop in this thread
        tasks = -1
    out: dict[str, Any] = {
        "asyncio_tasks": tasks,
        "threads_python": threading.active_count(),
        "threads_native": len(os.listdir("/proc/self/task")),
        "tables": tables(),
        "heap": heap(),
        "arenas": arenas(),
        "objects_total": len(gc.get_objects()),
        "objects": dict(objects_by_type().most_common(60)),
    }
    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        out["traced_mib"] = tracemalloc.get_traced_memory()[0] / (1 << 20)
        if _last is not None:
            out["growth"] = [f"{s.traceback[0].filename}:{s.traceback[0].lineno} {s.size_diff / 1024:+.0f} KiB "
                             f"({s.count_diff:+d})" for s in snap.compare_to(_last, "lineno")[:15]]
        _last = snap
    path.write_text(json.dumps(out))
    return out


def main() -> int:
    path = Path(os.environ["SOAK_PROBE_REPORT"])
    if os.environ.get("SOAK_PROBE_TRACEMALLOC") == "1":
        tracemalloc.start(1)

    def trimmed(signum: int, frame: object) -> None:
        trim()
        report(path)

    signal.signal(signal.SIGUSR1, lambda signum, frame: report(path))
    signal.signal(signal.SIGUSR2, trimmed)
    return serve.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

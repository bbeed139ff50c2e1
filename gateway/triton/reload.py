"""Heal a broken stage by reloading its one model through Triton's model control API.

A Python-backend stub killed under a running Triton (the OOM killer's first pick) leaves its model "ready" while
every request to it fails. Unloading and loading that model starts a new stub (the old one's shared-memory region
is unlinked by the backend as the old model unloads); the other stages, their stubs and their sequences are
untouched. A plain `load_model` is not enough: Triton reloads only a model whose files changed.

Triton allows this only in explicit model control mode (`--model-control-mode=explicit`, which
`gateway.triton.launcher` uses); any other mode refuses, and `ReloadRefused` says so.

Several gateway processes watch one Triton (`--workers N`, or gateways of one host in front of one endpoint):
they take a lock per endpoint, a file in the temporary folder, and the one that finds the model still broken once
it holds the lock reloads it; the others find it answering (or loading) and do nothing. Gateways on other hosts do
not share the lock; a second reload there costs a second stub start, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from tritonclient.grpc import aio as grpcaio

log = logging.getLogger("gateway.health")

LOCK_DIR = Path(tempfile.gettempdir())


class ReloadRefused(RuntimeError):
    """Triton would not reload a model (not in explicit model control mode, or the load failed)."""


def lock_path(url: str) -> Path:
    return LOCK_DIR / f"minicpmo-reload-{hashlib.sha256(url.encode()).hexdigest()[:16]}.lock"


@contextlib.asynccontextmanager
async def endpoint_lock(url: str) -> AsyncIterator[None]:
    """Held by one process of this host at a time, per Triton endpoint; waited for off the event loop."""
    with open(lock_path(url), "a") as f:
        await asyncio.to_thread(fcntl.flock, f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


async def reload_models(client: grpcaio.InferenceServerClient, url: str, models: list[str],
                        still_broken: Callable[[str], Awaitable[bool]]) -> list[str]:
    """Reload those of `models` that `still_broken` says are, once this process holds the endpoint's lock; returns
    the ones it reloaded (none: another process healed them first). Raises `ReloadRefused`."""
    async with endpoint_lock(url):
        broken = [m for m in models if await still_broken(m)]
        for model in broken:
            log.error("endpoint %s: reloading the broken model %s", url, model)
            try:
                await client.unload_model(model)
                await client.load_model(model)  # waits for the unload, then for the new stub to be ready
            except Exception as exc:  # Triton's refusal, whatever its type: the caller restarts
                raise ReloadRefused(f"Triton would not reload {model}: {str(exc).splitlines()[0][:200]}") from exc
        return broken

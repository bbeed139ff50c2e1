"""Heal a broken stage by reloading its one model through Triton's model control API.

A Python-backend stub killed under a running Triton (the OOM killer's first pick) leaves its model "ready" while
every request to it fails. Unloading and loading that model starts a new stub (the old one's shared-memory region
is unlinked by the backend as the old model unloads); the other stages, their stubs and their sequences are
untouched. A plain `load_model` is not enough: Triton reloads only a model whose files changed.

Triton allows this only in explicit model control mode (`--model-control-mode=explicit`, which
`gateway.triton.launcher` uses); any other mode refuses, and `ReloadRefused` says so. A Triton started with a control
key (MINICPMO_TRITON_CONTROL_KEY; `gateway.serve` makes one for the Triton it starts) takes these calls only with
that key in a header: whoever reaches its ports cannot unload a model.

Several gateway processes watch one Triton (`--workers N`, or gateways of one host in front of one endpoint):
they take a lock per endpoint, a file in the temporary folder that also says when each model's last reload began;
the first to hold it reloads the model, the others find a reload begun after their evidence of the dead stub and
do nothing. Gateways on other hosts do not share the file; a second reload there costs a second stub start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

from tritonclient.grpc import aio as grpcaio

from .launcher import CONTROL_HEADER

GRPC_CONTROL_HEADER = f"triton-grpc-protocol-{CONTROL_HEADER}"  # what Triton's gRPC front end reads it from

log = logging.getLogger("gateway.health")

LOCK_DIR = Path(tempfile.gettempdir())


class ReloadRefused(RuntimeError):
    """Triton would not reload a model (not in explicit model control mode, or the load failed)."""


def lock_path(url: str) -> Path:
    return LOCK_DIR / f"minicpmo-reload-{hashlib.sha256(url.encode()).hexdigest()[:16]}.lock"


@contextlib.asynccontextmanager
async def endpoint_lock(url: str) -> AsyncIterator[IO[str]]:
    """The endpoint's lock file, held by one process of this host at a time (waited for off the event loop); it
    holds when each model's last reload began (JSON: model -> Unix time)."""
    with open(lock_path(url), "a+") as f:
        await asyncio.to_thread(fcntl.flock, f.fileno(), fcntl.LOCK_EX)
        try:
            yield f
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _stamps(f: IO[str]) -> dict[str, float]:
    f.seek(0)
    with contextlib.suppress(ValueError):
        return {str(k): float(v) for k, v in json.loads(f.read() or "{}").items()}
    return {}


async def reload_models(client: grpcaio.InferenceServerClient, url: str, models: list[str],
                        broken_since: float, control_key: str = "") -> list[str]:
    """Reload `models`, found broken by requests sent from `broken_since` (Unix time) on, once this process holds
    the endpoint's lock, but not one whose reload another process began since then (that evidence predates the
    new stub); returns the ones it reloaded. `control_key`: what Triton's model control calls need (if it was
    started with one). Raises `ReloadRefused`."""
    headers = {GRPC_CONTROL_HEADER: control_key} if control_key else None
    async with endpoint_lock(url) as f:
        stamps = _stamps(f)
        broken = [m for m in models if stamps.get(m, 0.0) < broken_since]
        for model in broken:
            stamps[model] = time.time()
            f.seek(0)
            f.truncate()
            f.write(json.dumps(stamps))
            f.flush()
            log.error("endpoint %s: reloading the broken model %s", url, model)
            try:
                await client.unload_model(model, headers=headers)
                # waits for the unload, then for the new stub to be ready
                await client.load_model(model, headers=headers)
            except Exception as exc:  # Triton's refusal, whatever its type: the caller restarts
                raise ReloadRefused(f"Triton would not reload {model}: {str(exc).splitlines()[0][:200]}") from exc
        return broken

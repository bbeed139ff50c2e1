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
they take a lock per endpoint, a file that also says when each model's last reload began; the first to hold it
reloads the model, the others find a reload begun after their evidence of the dead stub and do nothing. Gateways on
other hosts do not share the file; a second reload there costs a second stub start.

The lock cannot be planted: it lives in a directory of this user's own (`<tmp>/minicpmo-<uid>`, made 0700, used
only if it is a real directory of this user's that no one else may write), is opened without following a link and
used only if it is a regular file of this user's; its content is read as stamps only where it is a JSON object of
times, and a stamp in the future is ignored (it would skip every reload). It is waited for at most `LOCK_WAIT_S`:
a process that holds it longer (hung) does not stop the reload. Whatever is wrong with it, the reload goes on,
alone (logged): a second reload by another process costs a stub start, never healing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import stat
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from tritonclient.grpc import aio as grpcaio

from .launcher import CONTROL_HEADER

GRPC_CONTROL_HEADER = f"triton-grpc-protocol-{CONTROL_HEADER}"  # what Triton's gRPC front end reads it from

log = logging.getLogger("gateway.health")

LOCK_DIR = Path(tempfile.gettempdir())  # the private directory is made in it
LOCK_WAIT_S = 30.0  # a reload (a stub's start) takes seconds; a holder past this is hung, not reloading
FUTURE_S = 5.0  # a stamp this far past now is not a reload that began: ignored
STAMPS_BYTES = 64 << 10  # of the file read: a stamp per model is a few dozen bytes


class ReloadRefused(RuntimeError):
    """Triton would not reload a model (not in explicit model control mode, or the load failed)."""


def private_dir() -> Path:
    return LOCK_DIR / f"minicpmo-{os.getuid()}"


def lock_path(url: str) -> Path:
    return private_dir() / f"reload-{hashlib.sha256(url.encode()).hexdigest()[:16]}.lock"


def _own(st: os.stat_result, kind: int) -> bool:
    """Of this user's, of this kind, and written by no one else."""
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _open_lock(url: str) -> int | None:
    """The endpoint's lock file, opened; None when its directory or the file is not safely this user's (logged)."""
    folder = private_dir()
    try:
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        if not _own(os.lstat(folder), stat.S_IFDIR) or os.lstat(folder).st_mode & 0o077:
            raise PermissionError(f"{folder} is not a directory of this user's alone")
        fd = os.open(lock_path(url), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # a link, a directory, another user's: planted
        log.error("endpoint %s: the reload lock is not usable (%s: %s); reloading without it", url,
                  type(exc).__name__, exc)
        return None
    if not _own(os.fstat(fd), stat.S_IFREG):
        os.close(fd)
        log.error("endpoint %s: the reload lock %s is not a file of this user's; reloading without it", url,
                  lock_path(url))
        return None
    return fd


async def _locked(fd: int, wait_s: float) -> bool:
    """Hold the lock, waiting at most `wait_s` (polled: a blocking flock could not be given up); False: not taken."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def endpoint_lock(url: str) -> AsyncIterator[int | None]:
    """The endpoint's lock, held by one process of this host at a time; its file (None: reloading without one, a
    planted or hung lock logged) holds when each model's last reload began (JSON: model -> Unix time)."""
    fd = _open_lock(url)
    if fd is None:
        yield None
        return
    try:
        if not await _locked(fd, LOCK_WAIT_S):
            log.error("endpoint %s: the reload lock is held past %.0f s (a hung process?); reloading without it",
                      url, LOCK_WAIT_S)
            yield None
            return
        try:
            yield fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_stamps(raw: bytes, now: float) -> dict[str, float]:
    """The file's stamps: a JSON object of model -> Unix time; anything else is no stamp (an empty or planted file),
    and a time in the future is ignored (it would say a reload began after any evidence, forever)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v) and v <= now + FUTURE_S}


def _read(fd: int | None) -> dict[str, float]:
    if fd is None:
        return {}
    os.lseek(fd, 0, os.SEEK_SET)
    return read_stamps(os.read(fd, STAMPS_BYTES), time.time())


def _write(fd: int | None, stamps: dict[str, float]) -> None:
    if fd is None:
        return
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(stamps).encode())


async def reload_models(client: grpcaio.InferenceServerClient, url: str, models: list[str],
                        broken_since: float, control_key: str = "") -> list[str]:
    """Reload `models`, found broken by requests sent from `broken_since` (Unix time) on, once this process holds
    the endpoint's lock, but not one whose reload another process began since then (that evidence predates the
    new stub); returns the ones it reloaded. `control_key`: what Triton's model control calls need (if it was
    started with one). Raises `ReloadRefused`."""
    headers = {GRPC_CONTROL_HEADER: control_key} if control_key else None
    async with endpoint_lock(url) as fd:
        stamps = _read(fd)
        broken = [m for m in models if stamps.get(m, 0.0) < broken_since]
        for model in broken:
            stamps[model] = time.time()
            _write(fd, stamps)
            log.error("endpoint %s: reloading the broken model %s", url, model)
            try:
                await client.unload_model(model, headers=headers)
                # waits for the unload, then for the new stub to be ready
                await client.load_model(model, headers=headers)
            except Exception as exc:  # Triton's refusal, whatever its type: the caller restarts
                raise ReloadRefused(f"Triton would not reload {model}: {str(exc).splitlines()[0][:200]}") from exc
        return broken

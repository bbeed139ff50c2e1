"""The reload lock cannot be planted (gateway/triton/reload.py): whatever another local user or process leaves where
the lock is kept (a future stamp, a directory, a file of `[]`, a symlink to a file of its choosing, the lock held and
never let go, the lock's directory made by someone else), a broken stage is still reloaded, and nothing outside the
lock's own file is written. Triton is faked here (its unload/load calls recorded): the lock is what is tested."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.triton import reload

URL = "127.0.0.1:8001"


class FakeTriton:
    """Triton's model control calls, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def unload_model(self, model: str, headers: object = None) -> None:
        self.calls.append(("unload", model))

    async def load_model(self, model: str, headers: object = None) -> None:
        self.calls.append(("load", model))


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(reload, "LOCK_DIR", tmp_path)
    monkeypatch.setattr(reload, "LOCK_WAIT_S", 0.5, raising=False)
    return tmp_path


def planted_at() -> Path:
    """Where the lock is kept, its folder made as the service would make it (the planter got there first)."""
    path = reload.lock_path(URL)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    return path


async def reloaded(broken_since: float | None = None) -> list[str]:
    triton = FakeTriton()
    since = time.time() - 1 if broken_since is None else broken_since
    done = await asyncio.wait_for(reload.reload_models(triton, URL, ["llm"], since), 10)  # type: ignore[arg-type]
    assert triton.calls == [("unload", "llm"), ("load", "llm")] if done else triton.calls == []
    return done


async def test_a_reload_leaves_its_stamp_and_a_later_one_finds_it() -> None:
    assert await reloaded() == ["llm"]
    folder = reload.lock_path(URL).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert await reloaded(broken_since=time.time() - 60) == []  # another gateway reloaded it after this evidence


async def test_a_planted_future_stamp_does_not_stop_healing() -> None:
    planted_at().write_text(json.dumps({"llm": time.time() + 10 * 365 * 86400}))
    assert await reloaded() == ["llm"]


@pytest.mark.parametrize("content", ["[]", "{\"llm\": \"x\"}", "{\"llm\": NaN}", "\xff\xfe", "{" * 100_000, "null"])
async def test_planted_content_is_no_stamp(content: str) -> None:
    planted_at().write_bytes(content.encode("utf-8", "surrogateescape"))
    assert await reloaded() == ["llm"]


async def test_a_planted_directory_does_not_stop_healing() -> None:
    planted_at().mkdir()
    assert await reloaded() == ["llm"]


async def test_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "etc-passwd"
    target.write_text("root:x:0:0\n")
    planted_at().symlink_to(target)
    assert await reloaded() == ["llm"]
    assert target.read_text() == "root:x:0:0\n"


async def test_a_lock_held_by_another_process_delays_healing_only_so_long() -> None:
    path = planted_at()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert await reloaded() == ["llm"]
    finally:
        holder.kill()
        holder.wait()


async def test_a_lock_folder_someone_else_made_is_not_used(lock_dir: Path) -> None:
    folder = reload.lock_path(URL).parent
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # anyone may write in it: anyone may have planted the file
    assert await reloaded() == ["llm"]
    assert list(folder.iterdir()) == []  # nothing written there

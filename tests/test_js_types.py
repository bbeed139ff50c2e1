"""Every server event the OpenAI dialect sends, checked against the official JS clients' own types: the `openai`
package's TypeScript types (`RealtimeServerEvent`, type-checked by `tsc`) and the OpenAI Agents SDK's
(`@openai/agents-realtime`: its transport's zod schemas, run by node as it parses what a server sends).

Their versions are pinned in tests/jstypes/package-lock.json; `npm ci --prefix tests/jstypes` installs them
(.ci/run does, then runs `pytest -m jstypes`). The events are tests/test_openai_spec.py's: every scenario, for a
stock client, one that opted into duplex and one that opted into both extensions.

What a JS client receives is JSON, not an object literal: a key its type does not name (an extension, or the
`id` OpenAI's own server sends on a session) is no error, but every key the type names must have its type. So
`null` where the spec makes a field optional (`status_details?: RealtimeResponseStatus`) is an error: leave it
out. The Python `openai` package's models (tests/test_openai_spec.py) take `None` for any optional field; these
types are stricter, and a JS client in strict TypeScript is typed by them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .test_openai_spec import SPEC_TYPES, pure_events

pytestmark = pytest.mark.jstypes

JSTYPES = Path(__file__).resolve().parent / "jstypes"
NODE_MODULES = JSTYPES / "node_modules"
ID = re.compile(r"^(event|item|resp|sess)_[0-9a-f]+$")


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    if not (NODE_MODULES / "openai").is_dir() or shutil.which("node") is None:
        pytest.fail("the JS clients are not installed: `npm ci --prefix tests/jstypes` (node and npm from apt)")


def _label(scenario: str, stock: bool) -> str:
    return f"{scenario} ({'stock' if stock else 'opted in'})"


def _normal(value: Any) -> Any:
    """The event with what only repeats (ids, audio) made the same, so events alike are checked once."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, str):
        return "id" if ID.match(value) else value if len(value) <= 64 else value[:8]
    return value


def events() -> list[tuple[str, dict[str, Any]]]:
    """Each distinct event the scenarios send, labelled with the first scenario that sent it."""
    seen: dict[str, tuple[str, dict[str, Any]]] = {}
    for scenario, stock, event in pure_events():
        seen.setdefault(json.dumps(_normal(event), sort_keys=True), (_label(scenario, stock), _normal(event)))
    return list(seen.values())


def test_every_spec_event_type_checks_against_the_openai_typescript_types(tmp_path: Path) -> None:
    checked = [(label, ev) for label, ev in events() if ev["type"] in SPEC_TYPES]
    # `json(...)` types its argument as the JSON it is (literal types, arrays mutable), not as a fresh object
    # literal: TypeScript's excess-property check is for literals a program writes, not for JSON it receives.
    lines = [f'import type {{ RealtimeServerEvent }} from "{NODE_MODULES}/openai/resources/realtime/realtime";',
             "type Json<T> = { -readonly [K in keyof T]: Json<T[K]> };",
             "declare function json<const T>(x: T): Json<T>;"]
    first = len(lines) + 1
    lines += [f"export const e{i}: RealtimeServerEvent = json({json.dumps(ev)});" for i, (_, ev) in enumerate(checked)]
    (tmp_path / "events.ts").write_text("\n".join(lines) + "\n")
    tsc = subprocess.run([str(NODE_MODULES / ".bin" / "tsc"), "--noEmit", "--strict", "--skipLibCheck",
                          "--target", "es2022", "--module", "nodenext", "events.ts"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    failed: dict[str, list[str]] = {}
    for error in re.split(r"\n(?=events\.ts\()", tsc.stdout.strip()):
        where = re.match(r"events\.ts\((\d+),\d+\)", error)
        if where is not None:  # the event's type and scenario: the innermost reason (the last line)
            label, ev = checked[int(where.group(1)) - first]
            failed.setdefault(f"{ev['type']} in {label}", []).append(error.splitlines()[-1].strip())
    assert tsc.returncode == 0 and not failed, failed or tsc.stdout[-3000:] + tsc.stderr[-3000:]
    assert len(checked) > 100  # the scenarios' spec events, each kind of them


def test_every_event_parses_as_the_agents_sdk_parses_it(tmp_path: Path) -> None:
    """A spec event by the SDK's schema of it; an extension event as the generic event it takes it for."""
    batch = [{"label": label, "event": ev, "known": ev["type"] in SPEC_TYPES} for label, ev in events()]
    (tmp_path / "events.json").write_text(json.dumps(batch))
    node = subprocess.run(["node", str(JSTYPES / "parse.mjs"), str(tmp_path / "events.json")],
                          capture_output=True, text=True, timeout=120)
    assert node.returncode == 0, node.stdout[-3000:] + node.stderr[-3000:]
    assert any(not b["known"] for b in batch) and sum(b["known"] for b in batch) > 100

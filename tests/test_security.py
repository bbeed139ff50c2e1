"""Who gets in (docs/security.md): API keys, Origins, per-key limits, ownership of sessions, resume rate,
/health without ids, the JSON limits, logs without the caller's text, Triton on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

import httpx
import pytest
import websockets

from gateway.auth import (
    ANONYMOUS,
    RateLimit,
    RedactKeys,
    SessionCounts,
    origin_allowed,
    presented_key,
    principal,
    redact,
)
from gateway.settings import api_keys
from gateway.triton import launcher
from gateway.triton.launcher import CONTROL_KEY_ENV, TritonInstall, TritonPorts, control_refusal, server_command
from gateway.wire import JSON_MAX_DEPTH, JSON_MAX_ITEMS, JSON_MAX_NUMBER_CHARS, ProtocolError, parse_json
from minicpmo_triton.errors import describe

from .helpers import init_message

KEYS = ("alpha-key", "beta-key")


# ---- pure parts ----

def test_keys_are_matched_whole_and_named_by_fingerprint() -> None:
    assert principal((), None) == ANONYMOUS
    assert principal(KEYS, None) is None
    assert principal(KEYS, "alpha") is None and principal(KEYS, "alpha-key-") is None
    who = principal(KEYS, "beta-key")
    assert who is not None and who.startswith("key_") and "beta" not in who
    assert principal(KEYS, "\ud800") is None  # a lone surrogate is just a wrong key


def test_a_key_comes_from_the_header_or_the_query() -> None:
    assert presented_key({"authorization": "Bearer abc"}, {}) == "abc"
    assert presented_key({"authorization": "bearer abc"}, {"key": "q"}) == "abc"
    assert presented_key({}, {"key": "q"}) == "q"
    assert presented_key({"authorization": "Basic abc"}, {}) is None


def test_keys_from_the_environment_and_a_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# ops keys\nfile-key\n\n  other-key  \n")
    assert api_keys({"MINICPMO_API_KEYS": "a, b,", "MINICPMO_API_KEYS_FILE": str(path)}) == \
        ("a", "b", "file-key", "other-key")
    assert api_keys({}) == ()


def test_keys_in_urls_are_redacted_from_log_lines() -> None:
    record = logging.LogRecord("uvicorn.error", logging.INFO, "x", 1, '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1:5", "/v1/realtime?mode=audio&key=alpha-key"), None)
    RedactKeys().filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "WebSocket /v1/realtime?mode=audio&key=***" [accepted]'
    assert redact("GET /health?key=k1&x=1") == "GET /health?key=***&x=1"


def test_origins() -> None:
    assert origin_allowed((), "https://any.example")
    assert origin_allowed(("https://ok.example",), None)  # not a browser
    assert origin_allowed(("https://ok.example",), "https://ok.example")
    assert not origin_allowed(("https://ok.example",), "https://evil.example")


def test_per_key_counts_and_the_resume_rate() -> None:
    counts = SessionCounts(1)
    with counts.held("a"):
        with pytest.raises(ProtocolError) as info, counts.held("a"):
            pass
        assert info.value.code == "key_session_limit"
        with counts.held("b"):
            pass
    with counts.held("a"):  # given back
        pass
    now = [0.0]
    rate = RateLimit(2, 60.0, clock=lambda: now[0])
    rate.check("x"), rate.check("x")
    with pytest.raises(ProtocolError) as info:
        rate.check("x")
    assert info.value.code == "rate_limited"
    rate.check("y")
    now[0] = 61.0
    rate.check("x")


@pytest.mark.parametrize("text, message", [
    ("[" * (JSON_MAX_DEPTH + 1) + "]" * (JSON_MAX_DEPTH + 1), "nested deeper"),
    ("[" * 100_000 + "]" * 100_000, "values"),  # past the count too, which is read first
    ('{"a": ' + "9" * (JSON_MAX_NUMBER_CHARS + 1) + "}", "a number of"),
    ('{"a": 1.' + "5" * 50_000 + "}", "a number of"),
    ('{"a": "\\ud800"}', "surrogate"),
    ('{"\\udfff": 1}', "surrogate"),
    (b"\xff\xfe{}", "not UTF-8"),
    ("{'a': 1}", "Expecting"),
    ("[" + "0," * JSON_MAX_ITEMS + "0]", "values"),
    ("[" + "{}," * JSON_MAX_ITEMS + "{}]", "values"),
    ('{"a": ["\\\\", ' + '"",' * JSON_MAX_ITEMS + '""]}', "values"),  # an escaped backslash ends no string
    ('["\\"",' + "0," * JSON_MAX_ITEMS + "0]", "values"),  # an escaped quote ends no string; the next one does
])
def test_json_limits(text: str | bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_json(text)


def test_json_values_are_counted_before_parsing(monkeypatch) -> None:
    """16 MiB of small values (8 M numbers: seconds of parsing on the event loop) is refused by its count, read in a
    few numpy passes over its bytes, before the parser sees it."""
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed"))
    for text in ("[" + "0," * (8 << 20) + "0]", b'{"a": [' + b'"",' * (4 << 20) + b'""]}'):
        with pytest.raises(ValueError, match="values"):
            parse_json(text)


def test_json_within_the_limits() -> None:
    nested: list = []  # with the object around it, JSON_MAX_DEPTH levels
    for _ in range(JSON_MAX_DEPTH - 2):
        nested = [nested]
    assert parse_json(json.dumps({"a": nested, "n": 1.5e300, "s": "\U0001f600"}))["n"] == 1.5e300
    # commas and brackets inside strings are text, not values, however many, escaped quotes and backslashes or not
    text = ',[{"\\' * (JSON_MAX_ITEMS // 2)
    assert parse_json(json.dumps({"t": text, "u": [text, "\\" + text]}))["u"][1] == "\\" + text
    assert len(parse_json("[" + "0," * (JSON_MAX_ITEMS - 1) + "0]")) == JSON_MAX_ITEMS


def test_a_log_line_of_an_exception_never_holds_its_message() -> None:
    secret = "the caller said: my PIN is 4711" * 1000
    try:
        secret.encode("ascii", "strict").decode("\ud800")
    except Exception as exc:  # noqa: BLE001 (whichever it raises: its log line is under test)
        line = describe(exc)
    assert "4711" not in line and "caller" not in line and "characters" in line and "test_security" in line


def test_triton_binds_to_loopback_unless_told() -> None:
    install = TritonInstall(Path("/bin/tritonserver"), None, None, None)
    cmd = server_command(install, Path("/m"), TritonPorts(1, 2, 3), None)
    assert {"--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(cmd)
    cmd = server_command(install, Path("/m"), TritonPorts(1, 2, 3), None, address="0.0.0.0")
    assert "--grpc-address=0.0.0.0" in cmd


def test_triton_beyond_loopback_needs_a_control_key(monkeypatch, capsys) -> None:
    """Explicit model control (how a gateway heals a dead stage) lets whoever reaches Triton unload its models:
    `python -m gateway.triton` refuses to bind beyond loopback without the key, before anything starts."""
    monkeypatch.delenv(CONTROL_KEY_ENV, raising=False)
    monkeypatch.setattr(launcher, "find_triton", lambda: pytest.fail("started without a control key"))
    assert launcher.main(["--address", "0.0.0.0"]) == 2
    assert CONTROL_KEY_ENV in capsys.readouterr().err
    assert control_refusal("127.0.0.1", "explicit", "", False) is None
    assert control_refusal("0.0.0.0", "explicit", "k", False) is None
    assert control_refusal("0.0.0.0", "none", "", False) is None and control_refusal("::", "explicit", "", True) is None


# ---- against the real server ----

@pytest.fixture
def gw(gateway_factory):
    return gateway_factory(api_keys=",".join(KEYS), allowed_origins="https://ok.example",
                           max_sessions_per_key="1", resume_attempts="2")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def refused(url: str, **connect: object) -> tuple[str, int]:
    async with websockets.connect(url, **connect) as ws:
        with contextlib.suppress(websockets.ConnectionClosed):  # refused at the door, before any init
            await ws.send(init_message())
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
    assert err["type"] == "error", err
    return err["error"]["code"], info.value.rcvd.code


async def test_keys_origins_and_limits(gw, tmp_path) -> None:
    for url in (gw.ws, gw.realtime, gw.realtime + "?mode=audio"):
        assert await refused(url) == ("unauthorized", 1008)
        assert await refused(url, additional_headers=bearer("alpha")) == ("unauthorized", 1008)
        assert await refused(url + ("&" if "?" in url else "?") + "key=nope") == ("unauthorized", 1008)
        assert await refused(url, additional_headers={**bearer("alpha-key"), "Origin": "https://evil.example"}) \
            == ("origin_not_allowed", 1008)
    assert gw.health()["active_sessions"] == 0

    alpha = await websockets.connect(gw.ws, additional_headers={**bearer("alpha-key"), "Origin": "https://ok.example"})
    await alpha.send(init_message())
    session_id = json.loads(await alpha.recv())["session_id"]
    # the same key again: its limit of 1
    assert await refused(gw.ws + "?key=alpha-key") == ("key_session_limit", 1013)
    beta = await websockets.connect(gw.realtime + "?key=beta-key")  # a browser's way; another key's slot
    assert json.loads(await beta.recv())["type"] == "session.created"

    open_health = gw.health()
    assert open_health["active_sessions"] == 2 and "active_session_ids" not in open_health
    own = httpx.get(f"{gw.http}/health", headers=bearer("alpha-key"), timeout=5).json()
    assert own["active_session_ids"] == [session_id]
    other = httpx.get(f"{gw.http}/health", headers=bearer("beta-key"), timeout=5).json()
    assert session_id not in other["active_session_ids"] and len(other["active_session_ids"]) == 1

    close = f"{gw.http}/sessions/{session_id}/close"
    assert httpx.post(close, timeout=5).status_code == 401
    assert httpx.post(close, headers=bearer("beta-key"), timeout=5).status_code == 404  # not beta's
    assert httpx.post(close, headers={**bearer("alpha-key"), "Origin": "https://evil.example"},
                      timeout=5).status_code == 403
    assert httpx.post(close, headers=bearer("alpha-key"), timeout=5).json()["closed"] is True
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            await asyncio.wait_for(alpha.recv(), 10)
    await beta.close()
    log = (tmp_path / "gateway0.log").read_text()
    assert "?key=***" in log and not any(key in log for key in KEYS), log[-3000:]


async def test_resume_attempts_are_rate_limited(gw) -> None:
    codes = []
    for _ in range(3):
        async with websockets.connect(gw.realtime + "?resume=1&key=alpha-key") as ws:
            await ws.send(json.dumps({"type": "session.resume", "session_id": "sess_nope", "resume_token": "x"}))
            codes.append(json.loads(await asyncio.wait_for(ws.recv(), 10))["error"]["code"])
    assert codes == ["session_resume_expired", "session_resume_expired", "rate_limited"]

"""Secure by default: `gateway.serve` will not listen on a non-loopback address with no API keys unless told so
explicitly (`--insecure`, or MINICPMO_INSECURE=1), and says why. The real command, on free ports; the Triton it
is pointed at is not there (its /health says `loading`), which is all these tests need of it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.serve import is_loopback, open_refusal
from gateway.settings import Settings
from gateway.triton import free_port

REPO = Path(__file__).resolve().parent.parent


def test_only_loopback_is_served_open_by_default() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "gateway.example.com"))
    assert open_refusal("127.0.0.1", Settings()) is None
    assert open_refusal("0.0.0.0", Settings(api_keys=("k",))) is None
    assert open_refusal("0.0.0.0", Settings(insecure=True)) is None
    why = open_refusal("0.0.0.0", Settings())
    assert why is not None and "no API keys" in why and "--insecure" in why and "MINICPMO_API_KEYS" in why


def serve(*args: str, **env: str) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MINICPMO_")} | env
    return subprocess.Popen([sys.executable, "-m", "gateway.serve", "--triton-url", f"127.0.0.1:{free_port()}",
                             *args], cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_an_open_gateway_on_a_public_address_is_refused_and_says_why() -> None:
    proc = serve("--host", "0.0.0.0", "--port", str(free_port()))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert "refusing to listen on 0.0.0.0 with no API keys" in err and "--insecure" in err


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_open_gateway_on_a_public_address_starts_when_asked_for_explicitly(how: str) -> None:
    port = free_port()
    args, env = (("--insecure",), {}) if how == "flag" else ((), {"MINICPMO_INSECURE": "1"})
    proc = serve("--host", "0.0.0.0", "--port", str(port), *args, **env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.2)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "insecure: no API keys" in err

"""`minicpmo-triton talk` end to end: the console script as a subprocess against the real server, fed an
espeak-ng WAV, its reply written with `--out`; Ctrl-C as a terminal sends it (SIGINT)."""

from __future__ import annotations

import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from minicpmo_client import devices
from minicpmo_client.wav import read_wav

from .conftest import REPO
from .helpers import SPEAKING_TEXT


def espeak(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    return path


def talk_command(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "minicpmo_client", "talk", "--url", url, "--greedy", *args]


def run_talk(url: str, *args: str, timeout_s: float = 180) -> tuple[int, list[str]]:
    done = subprocess.run(talk_command(url, *args), cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    print(done.stdout, done.stderr)
    return done.returncode, done.stdout.splitlines()


def lines_matching(lines: list[str], pattern: str) -> list[re.Match]:
    return [m for m in (re.search(pattern, line) for line in lines) if m]


def test_talk_streams_a_wav_and_writes_the_reply(gateway, tmp_path) -> None:
    wav, out = espeak(tmp_path, "Good morning. What will the weather be like tomorrow?"), tmp_path / "reply.wav"
    rc, lines = run_talk(gateway.realtime, "--wav", str(wav), "--out", str(out), "--turn-detection", "server_vad",
                         "--max-output-tokens", "32", "--tail", "1.5", "--idle", "1")
    assert rc == 0
    assert all(re.match(r"^\s*\d+\.\d\ds ", line) for line in lines), "one timed line per event"
    assert lines_matching(lines, r"session sess_\w+ on ws://")
    assert lines_matching(lines, r"user speech_started") and lines_matching(lines, r"user speech_stopped")
    rid = lines_matching(lines, r"reply (resp_\w+) started")[0].group(1)
    assert lines_matching(lines, rf"text {rid} '") and lines_matching(lines, rf"audio {rid} \d\.\d\d s")
    final = lines_matching(lines, rf"final {rid} (completed|incomplete), with audio, first audio after (\d+) ms")
    assert final and int(final[0].group(2)) > 0
    assert lines_matching(lines, r"closed \(client_closed\)")
    written = float(lines_matching(lines, r"1 replies; wrote (\d+\.\d\d) s to ")[0].group(1))
    reply = read_wav(out, 24_000)
    assert written > 0.5 and abs(len(reply) / 24_000 - written) < 0.01 and np.abs(reply).max() > 0


def test_ctrl_c_interrupts_the_reply_then_quits(gateway, tmp_path) -> None:
    wav, out = espeak(tmp_path, SPEAKING_TEXT), tmp_path / "reply.wav"
    proc = subprocess.Popen(talk_command(gateway.realtime, "--wav", str(wav), "--out", str(out), "--tail", "10"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read_until(pattern: str, timeout_s: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 0.2)[0]:
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line.rstrip())
                if m := re.search(pattern, line):
                    return m
        raise AssertionError(f"no {pattern!r} in:\n" + "\n".join(lines))

    try:
        rid = read_until(r"audio (resp_\w+) ").group(1)
        proc.send_signal(signal.SIGINT)
        read_until(r"interrupting the reply")
        read_until(rf"barge-in {rid} \(client_cancelled\)")
        read_until(rf"final {rid} cancelled, with audio")
        proc.send_signal(signal.SIGINT)  # the second Ctrl-C quits
        read_until(r"quitting")
        read_until(r"closed \(client_closed\)")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        print("\n".join(lines))
    assert len(read_wav(out, 24_000)) >= 24_000


def test_a_typed_question_from_talk(gateway, tmp_path) -> None:
    out = tmp_path / "reply.wav"
    rc, lines = run_talk(gateway.realtime, "--text", "What will the weather be like tomorrow?", "--out", str(out),
                         "--turn-detection", "manual", "--max-output-tokens", "24", "--idle", "1")
    assert rc == 0
    assert lines_matching(lines, r"user committed 'What will the weather be like tomorrow\?'")
    assert lines_matching(lines, r"final resp_\w+ (completed|incomplete), with audio")
    assert len(read_wav(out, 24_000)) > 0


def test_talk_says_hello_first(gateway, tmp_path) -> None:
    out = tmp_path / "reply.wav"
    rc, lines = run_talk(gateway.realtime, "--hello", "Hello! How can I help?", "--out", str(out), "--idle", "1",
                         timeout_s=90)
    assert rc == 0 and lines_matching(lines, r"final resp_\w+ completed, with audio.*'Hello! How can I help\?'")


def test_talk_without_a_sound_device_says_what_to_do() -> None:
    try:
        devices.require("input")
        pytest.skip("this machine has a microphone")
    except devices.DeviceUnavailable:
        pass
    done = subprocess.run([sys.executable, "-m", "minicpmo_client", "talk", "--mic"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "use --wav FILE" in done.stdout and "sounddevice" in done.stdout


def test_the_example_client_speaks_realtime_through_talk(gateway, tmp_path) -> None:
    wav, out = espeak(tmp_path, "Hello, how are you today?"), tmp_path / "reply.wav"
    done = subprocess.run([sys.executable, "-m", "minicpmo_client.backend", str(wav), "--out", str(out),
                           "--url", gateway.ws, "--api", "realtime", "--turn-detection", "server_vad", "--greedy"],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    print(done.stdout, done.stderr)
    assert done.returncode == 0 and lines_matching(done.stdout.splitlines(), r"final resp_\w+ \w+, with audio")
    assert lines_matching(done.stdout.splitlines(), r"closed \(client_closed\)") and len(read_wav(out, 24_000)) > 0

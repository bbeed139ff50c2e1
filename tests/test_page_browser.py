"""The page at `/` in headless Chromium (Debian's `chromium` package, driven by Playwright; nothing is
downloaded), its microphone faked from an espeak-ng WAV: audio goes up, the reply comes down and plays,
the indicator follows, the timeline draws each second the model heard (the caller's level, listen or speak, a
barge-in, the words, a turn's latency), the interrupt button cuts the reply. A screenshot is kept in the test's
tmp dir, or where `PAGE_SCREENSHOT` says (docs/page.png is made so)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from minicpmo_client.wav import read_wav, write_wav

# Debian's chromium package, which scripts/setup.sh installs: where it is missing, this test fails (no skip)
CHROMIUM = Path(shutil.which("chromium") or "/usr/bin/chromium")


def fake_microphone(tmp_path: Path) -> Path:
    """A few seconds of speech, then half a minute of quiet (Chromium loops the file): the model hears a
    question, then answers into silence, so only the button can cut its reply."""
    spoken = tmp_path / "spoken.wav"
    subprocess.run(["espeak-ng", "-w", str(spoken), "Good morning. Could you tell me the weather for tomorrow?"],
                   check=True, capture_output=True)
    audio = read_wav(spoken, 48_000)
    path = tmp_path / "microphone.wav"
    write_wav(path, np.concatenate([audio, np.zeros(30 * 48_000, np.float32)]), 48_000)
    return path


def test_the_page_talks_plays_and_interrupts(gateway, tmp_path) -> None:
    from playwright.sync_api import expect, sync_playwright

    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={fake_microphone(tmp_path)}"]
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=str(CHROMIUM),
                                                       headless=True, args=args)
        try:
            page = browser.new_page()
            console: list[str] = []
            page.on("console", lambda m: console.append(m.text))
            page.goto(f"{gateway.http}/?key=test-key")
            expect(page.get_by_role("status")).to_have_text("idle")
            page.get_by_label("Voice").select_option("verse")  # every control is reachable by its label
            page.get_by_role("button", name="Start").focus()
            page.keyboard.press("Enter")  # the keyboard starts it, as a click would
            page.wait_for_function("window.talk.appends > 10", timeout=30_000)
            # the page opts into the extensions it speaks (duplex turns, response.listen, ...); a stock client gets
            # the spec alone
            assert page.evaluate("window.talk.url").endswith("/v1/realtime?extensions=duplex%2Cevents&key=test-key")
            expect(page.get_by_role("status")).to_have_text("listening")
            # the reply: words and audio chunks that play (the worklet reports samples played); a chunk's words may
            # follow its audio (tiny's byte-level text: a character cut between two chunks waits for its last byte)
            page.wait_for_function("window.talk.chunks > 0 && window.talk.queued > 12000 && window.talk.deltas > 0",
                                   timeout=90_000)
            talk = page.evaluate("window.talk")
            assert talk["deltas"] > 0 and talk["states"][:2] == ["listening", "speaking"]
            expect(page.get_by_role("status")).to_have_text("speaking")
            expect(page.locator("#latency")).to_have_text(re.compile(r"first audio after: \d+ ms"))
            page.wait_for_function("window.talk.played > 0", timeout=10_000)
            # Interrupt: the queued audio stops at once, the server cuts the reply to what was heard (and stops
            # it if it is still going), the page listens again. Clicked as soon as playback starts: the audio still
            # queued then is what the cut is checked against (on a loaded machine the timeline's checks took 0.6 s).
            before = page.evaluate("({played: window.talk.played, queued: window.talk.queued, "
                                   "states: window.talk.states.length, reply: window.talk.replies.at(-1).id})")
            page.get_by_role("button", name="Interrupt (Esc)").click()
            page.wait_for_timeout(400)
            after = page.evaluate("window.talk")
            assert after["played"] - before["played"] < 6000, "playback went on after the interrupt"
            find = f"window.talk.replies.find(r => r.id === '{before['reply']}')"
            page.wait_for_function(f"{find}.truncatedMs !== undefined", timeout=10_000)
            reply = page.evaluate(find)
            print(f"the interrupted reply: {reply}")
            # cut where playback stopped: before the audio still queued at the click (at least 0.5 s of it)
            assert 0 <= reply["truncatedMs"] <= reply["receivedMs"] - 400, reply
            # still being made at the click: the server stopped it; already done: only its history was cut
            assert (reply["status"], reply.get("reason")) in (("cancelled", "client_cancelled"), ("completed", None))
            assert "listening" in page.evaluate("window.talk.states")[before["states"]:]
            expect(page.locator("#transcript li.assistant").first).to_contain_text("[cut]")
            expect(page.locator("#timeline li.barge-in")).not_to_have_count(0)
            assert not page.evaluate("window.talk.errors"), console
            # The timeline: one column per step, in the order of the seconds heard, each with the decision the
            # server reported for it; the first seconds are listened to (forced), the reply's speak (and
            # the listens after the interrupt).
            steps = page.evaluate("window.talk.steps")
            assert [s["second"] for s in steps] == list(range(1, len(steps) + 1)), steps
            assert {s["decision"] for s in steps} == {"listen", "speak"}, steps
            assert [s["decision"] for s in steps[:3]] == ["listen"] * 3, steps
            assert page.locator("#timeline li").count() >= len(steps)
            assert any(s["levelDb"] > -60 for s in steps), "the caller's speech was not measured"
            # the turn's latency, on the step where its first audio came
            expect(page.locator("#timeline li.speak .latency").first).to_have_text(re.compile(r"^\d+ ms$"))
            started = [s for s in steps if s["latencyMs"] is not None]
            assert started and started[0]["decision"] == "speak", steps
            page.wait_for_function("window.talk.steps.length >= 9", timeout=30_000)  # a few listens after it
            shot = Path(os.environ.get("PAGE_SCREENSHOT") or tmp_path / "page.png")
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
            page.get_by_role("button", name="Stop").click()
            expect(page.get_by_role("status")).to_have_text("idle")
        finally:
            browser.close()

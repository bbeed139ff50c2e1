"""Voice references at session.init condition the LLM (ref_audio) and the TTS + token2wav (tts_ref_audio)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import numpy as np
import pytest
import websockets

from gateway.audio import encode_f32_base64
from minicpmo_client.backend import converse

from .conftest import MODEL_REPOSITORY
from .helpers import (
    GREEDY,
    SPEAKING_TEXT,
    audio_of,
    default_ref_tokens,
    deltas,
    open_session,
    recv_until,
    transcript,
    utterance_audio_tokens,
)

MAX_CHUNKS = 8


def seconds(audio: np.ndarray, n: int) -> np.ndarray:
    return audio[: min(n, len(audio) // 16_000) * 16_000]


async def converse_with(url: str, audio: np.ndarray, **voice: str):
    """`converse` with voice references in session.init (the client's own helper has none)."""
    ws, created = await open_session(url, voice=voice)
    for i in range(len(audio) // 16_000):
        await ws.send(json.dumps({"type": "input.append", "input": {
            "input_id": f"in_{i}", "audio": encode_f32_base64(audio[i * 16_000:(i + 1) * 16_000])}}))
    last = f"in_{len(audio) // 16_000 - 1}"
    events = await recv_until(ws, lambda e: e.get("input_id") == last and e.get("kind") in ("audio", "listen"), 60)
    await asyncio.sleep(0.5)  # a step's audio can follow its text
    await ws.close()
    return events


@pytest.mark.asyncio
async def test_tts_reference_changes_the_voice_not_the_words(gateway, triton, speech) -> None:
    audio = seconds(speech(SPEAKING_TEXT), MAX_CHUNKS)
    plain = await converse(gateway.ws, audio, realtime=False, config=GREEDY)
    voice = seconds(speech("This is how I sound when I speak.", voice="en+f3"), 2)
    voiced = await converse_with(gateway.ws, audio, tts_ref_audio=encode_f32_base64(voice))
    assert transcript(voiced) == transcript(plain.events)  # same words: the LLM did not hear the TTS reference
    a, b = audio_of(voiced), audio_of(plain.events)
    assert len(a) == len(b) > 0 and not np.allclose(a, b, atol=1e-3)  # another voice
    assert triton.wait_live(lambda lv: not any(lv.values())) == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}


@pytest.mark.asyncio
async def test_llm_reference_joins_the_system_prompt(gateway, speech) -> None:
    audio = seconds(speech(SPEAKING_TEXT), 1)
    plain = await converse_with(gateway.ws, audio)
    ref = speech("Hello, this is my voice, the way I would like you to hear it.")
    ref_tokens = utterance_audio_tokens(len(ref))
    voiced = await converse_with(gateway.ws, audio, ref_audio=encode_f32_base64(ref))
    first_plain, first_voiced = deltas(plain)[0], deltas(voiced)[0]
    audio_tokens = lambda ev: ev["chunk_usage"]["input_audio_tokens"]  # noqa: E731 (a one-line helper)
    # the session's reference stands where the default one stood (MiniCPM-o's demo always embeds one)
    shift = ref_tokens - default_ref_tokens(MODEL_REPOSITORY)
    assert audio_tokens(first_voiced) == audio_tokens(first_plain) + shift
    assert first_voiced["metrics"]["kv_cache_length"] == first_plain["metrics"]["kv_cache_length"] + shift


@pytest.mark.asyncio
async def test_a_bad_voice_reference_is_refused_at_init(gateway) -> None:
    async with websockets.connect(gateway.ws) as ws:
        await ws.send(json.dumps({"type": "session.init", "payload": {
            "voice": {"tts_ref_audio": encode_f32_base64(np.zeros(16_000 * 40, np.float32))}}}))
        err = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert err["error"]["code"] == "invalid_voice"
        with pytest.raises(websockets.ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
        assert info.value.rcvd.code == 1008


def voice_prompts(triton) -> dict[str, float]:
    """token2wav's voice prompt counter: computed, and reused by a session."""
    counts = {"computed": 0.0, "reused": 0.0}
    for line in triton.metrics_text().splitlines():
        for event in counts:
            if line.startswith(f'minicpmo_token2wav_voice_prompts_total{{event="{event}"'):
                counts[event] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.asyncio
async def test_voice_references_are_token2wav_prompts_computed_once_per_voice(gateway, triton, speech) -> None:
    """Greedy sessions: another reference -> another voice; the same reference -> the same audio, its prompt
    (S3 tokens, mel, CAM++, the flow's setup) computed once and reused by the second session."""
    audio = seconds(speech(SPEAKING_TEXT), MAX_CHUNKS)
    text = "A voice of my own, for the prompt cache."  # heard by no other test: a fresh prompt
    male, female = (encode_f32_base64(seconds(speech(text, voice=v), 2)) for v in ("en", "en+f3"))
    before = voice_prompts(triton)
    first = await converse_with(gateway.ws, audio, tts_ref_audio=male)
    other = await converse_with(gateway.ws, audio, tts_ref_audio=female)
    again = await converse_with(gateway.ws, audio, tts_ref_audio=male)
    a, b, c = audio_of(first), audio_of(other), audio_of(again)
    assert len(a) > 0 and len(b) > 0
    np.testing.assert_array_equal(a, c)  # the same voice, the same audio
    assert len(a) != len(b) or not np.allclose(a, b, atol=1e-3)  # another voice
    after = voice_prompts(triton)
    assert after["computed"] - before["computed"] == 2  # one per distinct reference
    assert after["reused"] - before["reused"] == 1  # the third session's


@pytest.mark.asyncio
async def test_a_named_voice_comes_from_the_voice_folder(gateway, triton, speech, tmp_path) -> None:
    """`voice.name` picks <MINICPMO_VOICES_DIR>/<name>.wav (any rate: espeak-ng writes 22.05 kHz); a name with
    no file (an OpenAI client's "alloy") keeps the default voice."""
    audio = seconds(speech(SPEAKING_TEXT), 4)
    wav = tmp_path / "narrator.wav"
    subprocess.run(["espeak-ng", "-v", "en+f4", "-w", str(wav), "The narrator's voice, read from the folder."],
                   check=True, capture_output=True)
    shutil.copy(wav, triton.voices_dir / "narrator.wav")
    before = voice_prompts(triton)
    named = await converse_with(gateway.ws, audio, name="narrator")
    after_first = voice_prompts(triton)
    again = await converse_with(gateway.ws, audio, name="narrator")
    after_again = voice_prompts(triton)
    unknown = await converse_with(gateway.ws, audio, name="alloy")
    default = await converse_with(gateway.ws, audio)
    assert after_first["computed"] - before["computed"] == 1  # the named voice's prompt
    assert after_again["computed"] == after_first["computed"] and after_again["reused"] == after_first["reused"] + 1
    a, b, c, d = audio_of(named), audio_of(again), audio_of(unknown), audio_of(default)
    assert len(a) > 0 and len(d) > 0
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c, d)  # an unknown name: the default voice
    assert len(a) != len(d) or not np.allclose(a, d, atol=1e-3)

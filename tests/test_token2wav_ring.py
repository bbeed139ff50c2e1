"""token2wav's device path (torch, every turn's caches in slots of one pool, batched: stages/token2wav_device.py),
here on the CPU, against today's path (numpy + ONNX Runtime) on the exported tiny model: sessions that start and
end at different steps, with different voices, a barge-in restart, an END and an eviction mid-turn, a slot
reused; the voice's frames held once and read in place; the bytes a chunk moves, flat in the turn's length; and
the in-flight loop (stages/token2wav_inflight.py). The official streaming is matched by both paths in
tests/test_token2wav_parity.py."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from minicpmo_triton.engine.traffic import CountingEngine, Traffic
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import Token2WavRequest, Token2WavResult
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.state_store import SequenceStore
from minicpmo_triton.stages.token2wav import Token2WavStage
from minicpmo_triton.stages.token2wav_device import DeviceStreamer
from minicpmo_triton.stages.token2wav_inflight import InflightToken2Wav

from .conftest import MODEL_REPOSITORY, ensure_exported

pytestmark = pytest.mark.engines  # the device path forced on the CPU: .ci/run's step of its own (a minute)

FOLDER = MODEL_REPOSITORY / "token2wav" / "1"


@pytest.fixture(autouse=True)
def one_thread():
    """torch on one thread, as the device path's CPU instance runs it (`ort_threads`); two on a shared 2-core
    machine only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stages(**device: Any) -> tuple[Token2WavStage, Token2WavStage, Clock]:
    """Today's stage and the device path's, on the same export, their stores on one clock (for an eviction)."""
    ensure_exported()
    preset = load_stage_config(FOLDER)
    clock = Clock()
    host = Token2WavStage.load(FOLDER, preset, 600)
    ring = Token2WavStage.load(FOLDER, preset, 600, streamer=DeviceStreamer.load(FOLDER, preset.token2wav, "cpu",
                                                                                  **device))
    for stage in (host, ring):
        stage.store = SequenceStore(600, clock=clock, on_drop=stage.drop_state)
    return host, ring, clock


def reference(seconds: float, seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(16_000 * seconds))).astype(np.float32)


def call(corr: int, tokens: int, rng: np.random.Generator, **kw: Any) -> StageCall[Token2WavRequest]:
    start, end = kw.pop("start", False), kw.pop("end", False)
    return StageCall(Token2WavRequest(rng.integers(0, 6000, tokens), **kw), corr, start=start, end=end)


def test_the_ring_path_streams_as_today_s_over_ragged_sessions() -> None:
    """Five sessions, three voices (1.5 s: its prompt shorter than the 100 frames the caches keep; 4 s: longer;
    the default), through both stages step by step, each step one batch: chunks of different lengths side by
    side, sessions starting and ending at different steps, a barge-in restart mid-turn, an END and an eviction
    mid-turn and a later session taking the freed slot. Every call's audio equal within 1e-5; no slot held at
    the end but the voices'."""
    host, ring, clock = stages()
    a, b = reference(1.5, 1), reference(4.0, 2)
    script: list[list[tuple[int, int, dict[str, Any]]]] = [
        [(1, 9, dict(start=True, turn_start=True, voice=a)), (2, 25, dict(start=True, turn_start=True, voice=b)),
         (3, 31, dict(start=True, turn_start=True))],
        [(1, 25, {}), (2, 13, {}), (3, 0, {})],
        [(1, 40, {}), (2, 25, {}), (3, 25, {})],
        [(1, 7, {}), (2, 20, dict(turn_start=True)), (3, 25, {})],  # 2: a barge-in restarts its turn
        [(1, 25, dict(finalize=True)), (2, 25, {}), (3, 12, {}), (4, 25, dict(start=True, turn_start=True, voice=a))],
        [(1, 25, dict(turn_start=True)), (2, 31, {}), (4, 25, {})],  # 3 goes quiet mid-turn: evicted below
        [(1, 30, {}), (2, 3, dict(finalize=True)), (4, 25, {}), (5, 25, dict(start=True, turn_start=True))],
        [(1, 25, {}), (2, 25, dict(turn_start=True)), (4, 9, {}), (5, 25, {})],
        [(1, 25, dict(finalize=True, end=True)), (2, 0, dict(finalize=True, end=True)),
         (4, 25, dict(finalize=True, end=True)), (5, 40, dict(finalize=True, end=True))],
    ]
    rng = np.random.default_rng(5)
    worst, heard, evicted_slot = 0.0, 0, None
    for step, calls in enumerate(script):
        if step == 6:  # session 3 (mid-turn) idles out: its slot is given back, and session 5 takes it
            evicted_slot = ring.store.get(3).stream.slot
            assert evicted_slot is not None
            clock.now += 601
            for cid in (1, 2, 4):
                host.store.get(cid), ring.store.get(cid)
            assert host.store.evict_expired() == ring.store.evict_expired() == [3]
        batch = [call(cid, n, np.random.default_rng(rng.integers(1 << 30)), **kw) for cid, n, kw in calls]
        want, got = host.run(batch), ring.run(batch)
        for c, w, g in zip(batch, want, got, strict=True):
            assert isinstance(w, Token2WavResult) and isinstance(g, Token2WavResult), (step, c.corr_id, w, g)
            assert w.waveform.shape == g.waveform.shape, (step, c.corr_id)
            if len(w.waveform):
                heard += 1
                worst = max(worst, float(np.abs(w.waveform - g.waveform).max()))
        if step == 6:
            assert ring.store.get(5).stream.slot == evicted_slot
    print(f"ring vs today's path over {heard} calls with audio: max |diff| = {worst:.3g}")
    assert heard >= 25
    assert worst < 1e-5
    streamer = ring.streamer
    assert isinstance(streamer, DeviceStreamer)
    assert streamer.turns == 0 and len(ring.store) == 0
    assert streamer.slots.taken == len(ring.prompts._prompts)  # only the prompt cache's voices hold slots


def test_a_voice_s_frames_are_held_once_and_read_in_place() -> None:
    """Two sessions with one voice: one prompt object, one slot for its frames however many sessions speak with it,
    and what their attention reads of it is that slot: changing the frames there changes both sessions' next
    audio (nothing was copied into the sessions at their turn's start), changing a slot no one holds does not."""
    _, ring, _ = stages()
    streamer = ring.streamer
    assert isinstance(streamer, DeviceStreamer)
    voice = reference(3.0, 3)
    rng = np.random.default_rng(1)
    for cid in (1, 2):
        ring.run([call(cid, 28, rng, start=True, turn_start=True, voice=voice)])
    streams = [ring.store.get(cid).stream for cid in (1, 2)]
    assert streams[0].prompt is streams[1].prompt
    prompt = streams[0].prompt
    assert streamer.slots.taken == 1 + 2  # the voice's slot and two turns'
    assert prompt.slot not in {s.slot for s in streams}

    tokens = rng.integers(0, 6000, 25)

    @torch.inference_mode()  # the pool's tensors are made in inference mode
    def next_audio() -> list[np.ndarray]:
        # the same next chunk for each session, from the same state each time
        saved = {k: v.clone() for k, v in streamer.pool.tensors.items()}
        hift = {k: getattr(streamer.hift, k).clone() for k in ("mel", "source", "speech")}
        frames = [(s.frames, s.mel_len, s.source_len, s.speech_len, s.first_chunk, s.rng.bit_generator.state)
                  for s in streams]
        out = streamer.chunk([(s, tokens.tolist(), False) for s in streams])
        for k, v in saved.items():
            streamer.pool[k].copy_(v)
        for k, v in hift.items():
            getattr(streamer.hift, k).copy_(v)
        for s, (f, m, so, sp, first, state) in zip(streams, frames, strict=True):
            s.frames, s.mel_len, s.source_len, s.speech_len, s.first_chunk = f, m, so, sp, first
            s.rng.bit_generator.state = state
        return out

    before = next_audio()
    assert all(np.array_equal(x, y) for x, y in zip(before, next_audio(), strict=True))  # the replay is exact
    est = streamer.pool["est"]  # [steps, depth, 2 * slots, frames, H, 2 * head_dim]
    free = max(set(range(streamer.pool.slots)) - {prompt.slot, *(s.slot for s in streams)})
    with torch.inference_mode():
        est[:, :, 2 * free] = 3 * torch.randn_like(est[:, :, 2 * free])  # a slot no one holds: nothing reads it
    assert all(np.array_equal(x, y) for x, y in zip(before, next_audio(), strict=True))
    with torch.inference_mode():
        est[:, :, 2 * prompt.slot] = 3 * torch.randn_like(est[:, :, 2 * prompt.slot])  # the voice's frames
    assert all(np.abs(x - y).max() > 1e-4 for x, y in zip(before, next_audio(), strict=True))


def test_the_bytes_a_chunk_moves_are_flat_in_the_turn_s_length() -> None:
    """One turn of 16 chunks on each path, every byte that crosses between host and device counted (as the paged
    engines count theirs): today's path (were it on a GPU) sends every cache in and out each chunk, so its bytes
    grow with the turn until the caches reach the prompt + 100 frames; the ring path sends the tokens and the
    rows' key lists and gets the audio back, the same bytes from the cache's bound on, and a fraction of
    today's."""
    host, ring, _ = stages()
    traffic = Traffic()
    streamer = host.streamer
    streamer.enc, streamer.est, streamer.voc = (CountingEngine(e, traffic)  # type: ignore[attr-defined]
                                                for e in (streamer.enc, streamer.est, streamer.voc))  # type: ignore[attr-defined]
    ring_streamer = ring.streamer
    assert isinstance(ring_streamer, DeviceStreamer)
    voice = reference(4.0, 4)
    per_chunk: dict[str, list[int]] = {"today": [], "ring": []}
    for name, stage, ledger in (("today", host, traffic), ("ring", ring, ring_streamer.traffic)):
        rng = np.random.default_rng(2)
        stage.run([call(1, 0, rng, start=True, turn_start=True, voice=voice)])
        for _ in range(16):
            before = ledger.total()
            stage.run([call(1, 25, rng)])
            per_chunk[name].append(ledger.total() - before)
    today, ring_bytes = per_chunk["today"], per_chunk["ring"]
    print(f"bytes per chunk: today's {today[0]} -> {today[-1]}, the ring path's {ring_bytes[0]} -> {ring_bytes[-1]}")
    assert today[-1] > today[0]  # today's grows with the turn
    bound = 3  # chunks until the caches hold the prompt + 100 frames (50 mel frames a chunk)
    assert len(set(ring_bytes[bound:])) == 1 and max(ring_bytes) == ring_bytes[-1]
    assert ring_bytes[-1] * 4 < today[-1]


def submit_all(loop: InflightToken2Wav, calls: list[StageCall[Token2WavRequest]],
               order: list[int] | None = None) -> list[Any]:
    """Submit the calls at once and wait for every answer (`order`: the corr ids as answered)."""
    answers: list[Any] = [None] * len(calls)
    done = threading.Semaphore(0)

    def answer(i: int) -> Callable[[Any], None]:
        def reply(result: Any) -> None:
            answers[i] = result
            if order is not None:
                order.append(calls[i].corr_id)
            done.release()
        return reply

    for i, c in enumerate(calls):
        loop.submit(c, answer(i))
    for _ in calls:
        assert done.acquire(timeout=120), "an in-flight call was never answered"
    return answers


@contextlib.contextmanager
def in_flight(stage: Token2WavStage) -> Iterator[InflightToken2Wav]:
    loop = InflightToken2Wav(stage, sweep_period_s=1)
    try:
        yield loop
    finally:
        loop.close()


def test_in_flight_a_short_call_is_answered_before_a_long_one_and_as_the_batch_would() -> None:
    """Submitted together: a call of 4 chunks (80 tokens after the turn's 3 of silence, flushed) and calls of 1:
    the short ones are answered while the long one still runs, each with the audio the synchronous batch gives."""
    host, ring, _ = stages()
    rng = np.random.default_rng(3)
    calls = [call(cid, n, rng, start=True, turn_start=True) for cid, n in ((1, 80), (2, 25), (3, 9))]
    order: list[int] = []
    with in_flight(ring) as loop:
        got = submit_all(loop, calls, order)
    want = host.run(calls)
    assert order[-1] == 1 and sorted(order[:2]) == [2, 3]
    for w, g in zip(want, got, strict=True):
        assert np.abs(w.waveform - g.waveform).max() < 1e-5
    assert len(got[0].waveform) > 3 * 24_000


def test_in_flight_a_turn_waits_for_a_slot_and_is_never_refused() -> None:
    """With one slot (token2wav_slots=1): session 1's turn holds it, session 2's turn waits (not refused) until
    session 1's turn ends, then speaks; END gives every slot back."""
    _, ring, _ = stages(max_slots=1)
    rng = np.random.default_rng(4)
    calls = [call(1, 25, rng, start=True, turn_start=True), call(2, 25, rng, start=True, turn_start=True),
             call(1, 25, rng, finalize=True, end=True)]
    order: list[int] = []
    with in_flight(ring) as loop:
        got = submit_all(loop, calls, order)
        assert order == [1, 1, 2]  # session 2's turn started once session 1's had ended
        assert all(len(r.waveform) for r in got)
        [last] = submit_all(loop, [call(2, 0, rng, finalize=True, end=True)])
        assert isinstance(last, Token2WavResult)
    streamer = ring.streamer
    assert isinstance(streamer, DeviceStreamer) and streamer.turns == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_the_ring_path_on_cuda_streams_as_on_the_cpu() -> None:
    host, _, _ = stages()
    preset = load_stage_config(FOLDER)
    cuda = Token2WavStage.load(FOLDER, preset, 600, streamer=DeviceStreamer.load(FOLDER, preset.token2wav, "cuda",
                                                                                  cache_dtype=torch.float32))
    rng = np.random.default_rng(6)
    for i in range(4):
        batch = [call(c, 25, np.random.default_rng(rng.integers(1 << 30)), start=i == 0, turn_start=i == 0)
                 for c in (1, 2)]
        for w, g in zip(host.run(batch), cuda.run(batch), strict=True):
            assert np.abs(w.waveform - g.waveform).max() < 1e-3


def test_the_1_0_7_layout_streams_as_today_s_with_its_causal_vocoder_batched(tmp_path) -> None:
    """minicpmo-utils 1.0.7's layout (its causal HiFT streamed by the package's BoundedVocoder): three sessions with
    two voices, chunks of different lengths side by side, turns ending and starting at different steps, a barge-in
    and an eviction mid-turn whose slot (and its vocoder history) the next session takes; the device path runs the
    vocoder for every row of a step at once (their histories in slots) and gives today's path's audio (one
    BoundedVocoder call per session, matched to the package's own Token2wav in tests/test_token2wav_1_0_7.py) within
    1e-5."""
    from export.checkpoint import copy_causal_vocoder, load_token2wav
    from export.modules.token2wav import graphs
    from export.torch_engine import TorchEngine
    from minicpmo_triton.model_config import Token2WavDims
    from minicpmo_triton.stages.token2wav import VoicePrompts
    from minicpmo_triton.stages.token2wav_stream import Token2WavStreamer
    from minicpmo_triton.stages.voice_prompt import VoiceFeatures
    from minicpmo_triton.vocoder.causal_vocoder import FOLDER as CAUSAL
    from minicpmo_triton.vocoder.causal_vocoder import CausalVocoder

    from .helpers import ring_streamer
    from .test_token2wav_1_0_7 import write_1_0_7_layout
    from .test_token2wav_parity import _voice

    d = Token2WavDims()
    write_1_0_7_layout(tmp_path)
    model = load_token2wav(tmp_path, d)
    assert model is not None and copy_causal_vocoder(tmp_path, tmp_path)
    vocoder = CausalVocoder.load(tmp_path / CAUSAL, "cpu")
    outputs = {"encoder": ["mu", "new_cnn_cache", "new_token_cache", "new_mel_cache"],
               "estimator": ["velocity", "new_cnn_cache", "new_att_cache"], "vocoder": ["speech", "source"]}
    host_streamer = Token2WavStreamer({g: TorchEngine(m, outputs[g]) for g, m in graphs(model).items()},
                                      model.tables(), d, causal=vocoder)
    ring_streamer_ = ring_streamer(model, d, causal=vocoder)
    voices = {float(i): VoiceFeatures(*_voice(seed, n)) for i, (seed, n) in enumerate(((1, 20), (2, 60)))}
    preset = load_stage_config(FOLDER)
    host, ring = (Token2WavStage(s, VoicePrompts(s, lambda a: voices[float(a[0])], voices[0.0]), preset, ttl_s=60)
                  for s in (host_streamer, ring_streamer_))
    clock = Clock()
    for stage in (host, ring):
        stage.store = SequenceStore(60, clock=clock, on_drop=stage.drop_state)
    refs = [np.full(8000, v, np.float32) for v in voices]
    script: list[list[tuple[int, int, dict[str, Any]]]] = [
        [(1, 25, dict(start=True, turn_start=True, voice=refs[0])), (2, 9, dict(start=True, turn_start=True))],
        [(1, 13, dict(finalize=True)), (2, 40, {}), (3, 31, dict(start=True, turn_start=True, voice=refs[1]))],
        [(1, 25, dict(turn_start=True)), (2, 7, dict(turn_start=True)),  # 3 goes quiet mid-turn: evicted below
         (4, 25, dict(start=True, turn_start=True, voice=refs[1]))],
        [(1, 0, dict(finalize=True, end=True)), (2, 25, dict(finalize=True, end=True)),
         (4, 30, dict(finalize=True, end=True))],
    ]
    rng = np.random.default_rng(9)
    worst, heard, evicted_slot = 0.0, 0, None
    for step, calls in enumerate(script):
        if step == 2:  # session 3 idles out mid-turn: its slot goes back, and session 4 takes it
            evicted_slot = ring.store.get(3).stream.slot
            assert evicted_slot is not None
            clock.now += 61
            for cid in (1, 2):
                host.store.get(cid), ring.store.get(cid)
            assert host.store.evict_expired() == ring.store.evict_expired() == [3]
        batch = [call(cid, n, np.random.default_rng(rng.integers(1 << 30)), **kw) for cid, n, kw in calls]
        for c, w, g in zip(batch, host.run(batch), ring.run(batch), strict=True):
            assert isinstance(w, Token2WavResult) and isinstance(g, Token2WavResult), (step, c.corr_id, w, g)
            assert w.waveform.shape == g.waveform.shape, (step, c.corr_id)
            if len(w.waveform):
                heard += 1
                worst = max(worst, float(np.abs(w.waveform - g.waveform).max()))
        if step == 2:
            assert ring.store.get(4).stream.slot == evicted_slot
    print(f"1.0.7 ring vs today's path over {heard} calls with audio: max |diff| = {worst:.3g}")
    assert heard >= 9 and worst < 1e-5
    assert isinstance(ring.streamer, DeviceStreamer) and ring.streamer.turns == 0 and len(ring.store) == 0


def test_the_cfm_graphs_padding_streams_as_the_plain_call() -> None:
    """The CUDA graphs' call (stages/token2wav_graphs.py) without the capture, as the CPU runs it: rows padded to
    their bucket (3 -> 4, 5 -> 8) with the scratch slot's rows, key lists padded to a block; every row's audio
    that of the plain call within 1e-6, over chunks that are whole (graphed) and flushed (not)."""
    from export.modules.token2wav import Token2WavModel
    from minicpmo_triton.model_config import Token2WavDims

    from .helpers import ring_streamer
    from .test_token2wav_parity import _voice

    d = Token2WavDims()
    model = Token2WavModel.random(d, seed=3)
    plain, padded = ring_streamer(model, d, graphs=False), ring_streamer(model, d, graphs=True)
    assert padded.graphs is not None and not padded.graphs.capture
    voices = [_voice(1, 20), _voice(2, 70)]
    streams = {}
    for name, streamer in (("plain", plain), ("padded", padded)):
        prompts = [streamer.setup(*v) for v in voices]
        streams[name] = [streamer.new_stream(prompts[i % 2], seed=i) for i in range(5)]
        for s in streams[name]:
            streamer.restart(s)
    rng = np.random.default_rng(8)
    worst = 0.0
    for rows, width in ((3, 28), (5, 28), (2, 17), (5, 28)):
        tokens = [rng.integers(0, d.vocab, width).tolist() for _ in range(rows)]
        want = plain.chunk([(s, t, False) for s, t in zip(streams["plain"][:rows], tokens, strict=True)])
        got = padded.chunk([(s, t, False) for s, t in zip(streams["padded"][:rows], tokens, strict=True)])
        worst = max(worst, *(float(np.abs(w - g).max()) for w, g in zip(want, got, strict=True)))
    assert padded.graphs.calls == 3 and padded.graphs.replays == 0  # the whole chunks; none captured on the CPU
    assert worst < 1e-6, worst

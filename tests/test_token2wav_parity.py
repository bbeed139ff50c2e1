"""Our token2wav streams against the official modules' own streaming, same weights: the host path (numpy + ONNX
Runtime) and the device path (torch, ring caches in slots, batched: token2wav_device), on the CPU here and on CUDA
where there is one.

Random weights at small widths in the checkpoint's file layout (flow.yaml, flow.pt, hift.pt). The reference
loop is MiniCPM-o's Token2wav.stream (stepaudio2-minicpmo 0.1.1: 3 x token 4218 after the prompt, the original
HiFT with its 8-frame mel / 3840-sample source caches and Hamming cross-fade, the estimator cache trimmed
to the prompt + 100 frames) with minicpmo-utils 1.0.7's conformer trim and first-chunk lead, re-run on CPU.
"""

from __future__ import annotations

import unittest.mock as mock
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from export.modules.stepaudio2 import load_flow_yaml
from export.modules.token2wav import Token2WavModel, build_hift
from export.onnx_export import export_onnx
from export.presets import get_preset
from export.stages import token2wav_stage_graphs
from minicpmo_triton.engine.exported import OnnxEngine
from minicpmo_triton.model_config import Token2WavDims
from minicpmo_triton.stage_io import Token2WavRequest
from minicpmo_triton.stages.token2wav import Token2WavSession, Token2WavStage, VoicePrompts
from minicpmo_triton.stages.token2wav_stream import Token2WavStreamer
from minicpmo_triton.stages.voice_prompt import VoiceFeatures

from .helpers import ring_streamer
from .reference_demo import demo_module

D = Token2WavDims()
SILENCE = [D.silence_token] * 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Token2WavStreamer, Token2WavModel]:
    """Random weights saved in the real layout, loaded back, and our three graphs exported from them."""
    folder = tmp_path_factory.mktemp("token2wav")
    Token2WavModel.random(D, seed=3).save(folder / "assets", D)
    model = Token2WavModel.load(folder / "assets", D)
    engines = {}
    for graph in token2wav_stage_graphs(get_preset("tiny"), model):
        path = folder / graph.file
        export_onnx(graph, path)
        engines[graph.name.removeprefix("token2wav_")] = OnnxEngine(path)
    return folder / "assets", Token2WavStreamer(engines, model.tables(), D), model


def fit_scratch_buffers(flow: torch.nn.Module, rand_noise: np.ndarray) -> None:
    """The official CFM / DiT write caches into scratch buffers sized for the real widths (16 blocks, 1024, ...):
    sized for tiny's; and its noise table, drawn unseeded at construction, is the one our export wrote."""
    cfm, est = flow.decoder, flow.decoder.estimator
    cfm.cnn_cache_buffer = torch.zeros(D.n_timesteps, D.dit_depth, 2, 2 * D.dit_hidden, 2)
    cfm.att_cache_buffer = torch.zeros(D.n_timesteps, D.dit_depth, 2, D.dit_heads, 1000, 2 * D.dit_head_dim)
    est.cnn_cache_buffer = torch.zeros(D.dit_depth, 2, 2 * D.dit_hidden, 2)
    est.att_cache_buffer = torch.zeros(D.dit_depth, 2, D.dit_heads, 1000, 2 * D.dit_head_dim)
    cfm.rand_noise = torch.from_numpy(rand_noise)[None]


def _official(folder: Path, streamer: Token2WavStreamer) -> tuple[torch.nn.Module, torch.nn.Module]:
    flow = load_flow_yaml(folder / "flow.yaml")
    flow.load_state_dict(torch.load(folder / "flow.pt", weights_only=True))
    hift = build_hift(D)
    hift.load_state_dict({k.removeprefix("generator."): v for k, v in torch.load(folder / "hift.pt").items()})
    fit_scratch_buffers(flow, streamer.rand_noise)
    return flow.eval(), hift.eval()


def _chunks(tokens: list[int]) -> list[tuple[list[int], bool]]:
    buf, out = SILENCE + tokens, []
    while len(buf) >= D.chunk_tokens + D.lookahead:
        out.append((buf[: D.chunk_tokens + D.lookahead], False))
        buf = buf[D.chunk_tokens:]
    return [*out, (buf, True)]


def _trim_conformer(att: torch.Tensor, prompt: int, depth: int) -> torch.Tensor:
    """minicpmo-utils 1.0.7 Token2wav._trim_conformer_cache (both packed scales)."""
    tail = D.cache_tail_frames
    if att.shape[3] <= prompt + tail:
        return att
    tok = att[:depth, :, :, : att.shape[3] // 2]
    tok = torch.cat([tok[:, :, :, : prompt // 2], tok[:, :, :, tok.shape[3] - tail // 2:]], dim=3)
    mel = torch.cat([att[depth:, :, :, :prompt], att[depth:, :, :, att.shape[3] - tail:]], dim=3)
    return torch.cat([tok.repeat(1, 1, 1, 2, 1), mel], dim=0)


class OfficialStream:
    """Token2wav.stream chunk by chunk on the official modules: `chunk(tokens, last)` -> that chunk's audio; the
    HiFT's random draws are recorded in order (`draws`: per call rand, randn_like, randn_like)."""

    def __init__(self, flow, hift, ptok: np.ndarray, pmel: np.ndarray, spk: np.ndarray) -> None:
        self.flow, self.hift, self.spk = flow, hift, torch.from_numpy(spk)[None]
        with torch.inference_mode():
            prompt = flow.setup_cache(torch.cat([torch.from_numpy(ptok)[None], torch.tensor([SILENCE])], 1),
                                      torch.from_numpy(pmel)[None], self.spk, n_timesteps=D.n_timesteps)
        self.prompt = {k: v.clone() for k, v in prompt.items()}  # the official returns views of scratch buffers
        self.window = torch.from_numpy(np.hamming(2 * D.source_cache_samples))
        self.frames = pmel.shape[0]
        self.draws: list[torch.Tensor] = []

    def restart(self) -> None:
        self.cache = {k: v.clone() for k, v in self.prompt.items()}
        self.hc = {"mel": torch.zeros(1, 80, 0), "source": torch.zeros(1, 1, 0), "speech": torch.zeros(1, 0)}
        self.first = True

    def _record(self, fn):
        def wrapped(*args, **kwargs):
            self.draws.append(fn(*args, **kwargs))
            return self.draws[-1]
        return wrapped

    @torch.inference_mode()
    def chunk(self, toks: list[int], last: bool) -> np.ndarray:
        ls, frames, hc = D.source_cache_samples, self.frames, self.hc
        chunk_mel, cache = self.flow.inference_chunk(torch.tensor([toks]), self.spk, self.cache, last, D.n_timesteps)
        cache = {k: v.clone() for k, v in cache.items()}
        att = cache["estimator_att_cache"]
        if att.shape[4] > frames + D.cache_tail_frames:
            cache["estimator_att_cache"] = torch.cat([att[..., :frames, :], att[..., -D.cache_tail_frames:, :]], 4)
        cache["conformer_att_cache"] = _trim_conformer(cache["conformer_att_cache"], frames, D.num_blocks)
        self.cache = cache
        mel = torch.cat([hc["mel"], chunk_mel], dim=2)
        with mock.patch("torch.rand", self._record(torch.rand)), \
                mock.patch("torch.randn_like", self._record(torch.randn_like)):
            speech, source = self.hift(mel, hc["source"])
        if hc["speech"].shape[-1]:
            speech = speech.clone()
            speech[..., :ls] = speech[..., :ls] * self.window[:ls] + hc["speech"][..., -ls:] * self.window[ls:]
        self.hc = {"mel": mel[..., -D.mel_cache_frames:], "source": source[:, :, -ls:], "speech": speech[:, -ls:]}
        if not last:
            speech = speech[:, :-ls]
            if self.first:
                speech = torch.cat([torch.zeros(1, ls), speech], dim=1)
        self.first = False
        return speech[0].numpy()

    def noise(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per HiFT call: rand (initial phases, the first zeroed as HiFT does) and randn_like (sine noise); the
        third draw (the unused noise branch) is dropped."""
        out = [(self.draws[i][0].numpy().copy(), self.draws[i + 1][0].numpy()) for i in range(0, len(self.draws), 3)]
        for r, _ in out:
            r[0] = 0.0
        return out


def reference_stream(flow, hift, ptok: np.ndarray, pmel: np.ndarray, spk: np.ndarray,
                     turns: list[list[int]]) -> tuple[list[list[np.ndarray]], list[tuple[np.ndarray, np.ndarray]]]:
    """Whole 25 + 3 chunks per turn; returns each turn's audio pieces and HiFT's random draws in order."""
    official = OfficialStream(flow, hift, ptok, pmel, spk)
    audio = []
    for tokens in turns:
        official.restart()
        audio.append([official.chunk(toks, last) for toks, last in _chunks(tokens)])
    return audio, official.noise()


def _voice(seed: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, D.vocab, n_tokens), rng.normal(-6, 1.5, (2 * n_tokens, 80)).astype(np.float32),
            rng.standard_normal(192).astype(np.float32))


# the device path on the CPU: .ci/run's engines step (half a minute); on CUDA where there is one
PATHS = ["host", pytest.param("ring", marks=pytest.mark.engines),
         pytest.param("ring-cuda", marks=[pytest.mark.engines, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="no CUDA")])]


def path_streamer(assets, path: str):
    """The host path's streamer, or the device path's over the same weights (cpu, or cuda)."""
    _, streamer, model = assets
    return streamer if path == "host" else ring_streamer(model, D, "cuda" if path == "ring-cuda" else "cpu")


@pytest.fixture(scope="module")
def official_streaming(assets):
    """The official streaming of two sessions with different voices (prompts of different lengths), two turns each
    (90 tokens a turn pass the attention caches' prompt + 100 frames, so the trimming is exercised): (voices, turns,
    each turn's audio pieces per session, HiFT's random draws per session). Run once for every path."""
    folder, host, _ = assets
    with pytest.MonkeyPatch.context() as mp:
        # the conformer's forward_chunk is torch.compile'd; raising=False: torch's config module loses the name
        # once a monkeypatch of it is undone, so a second patch in this process could not set it otherwise
        mp.setattr(torch._dynamo.config, "disable", True, raising=False)
        flow, hift = _official(folder, host)
        rng = np.random.default_rng(7)
        voices = [_voice(1, 20), _voice(2, 13)]
        turns = [[rng.integers(0, D.vocab, 90).tolist(), rng.integers(0, D.vocab, 30).tolist()] for _ in voices]
        expected, noises = zip(*(reference_stream(flow, hift, *v, t) for v, t in zip(voices, turns, strict=True)),
                               strict=True)
    return voices, turns, expected, noises


@pytest.mark.parametrize("path", PATHS)
def test_streamed_utterances_match_the_official_streaming(assets, official_streaming, monkeypatch, path: str) -> None:
    streamer = path_streamer(assets, path)
    voices, turns, expected, noises = official_streaming
    queues = [list(n) for n in noises]
    streams = [streamer.new_stream(streamer.setup(*v)) for v in voices]
    monkeypatch.setattr(streamer, "noise", lambda s, n: queues[streams.index(s)].pop(0))
    worst = 0.0
    for turn in range(2):
        for s in streams:
            streamer.restart(s)
        work = [_chunks(t[turn]) for t in turns]
        for r in range(max(len(w) for w in work)):
            rows = [(streams[i], *w[r]) for i, w in enumerate(work) if r < len(w)]
            got = streamer.chunk(rows)  # as the stage feeds them: every session's r-th chunk in one batch
            for (s, _, _), wav in zip(rows, got, strict=True):
                want = expected[streams.index(s)][turn][r]
                assert wav.shape == want.shape, (turn, r)
                worst = max(worst, float(np.abs(wav - want).max()))
    rms = float(np.sqrt(np.mean(np.concatenate([p for e in expected for t in e for p in t]) ** 2)))
    print(f"token2wav streamed ({path}) vs official streaming: max |diff| = {worst:.3g} (reference RMS {rms:.3g})")
    assert rms > 1e-2  # the reference is audio, not near-silence, so the tolerance below means something
    assert worst < 1e-5
    assert all(not q for q in queues)  # every HiFT call of the reference had its twin


def test_middle_chunks_are_one_second(assets) -> None:
    _, streamer, _ = assets
    stream = streamer.new_stream(streamer.setup(*_voice(4, 16)))
    streamer.restart(stream)
    lengths = [len(streamer.chunk([(stream, toks, last)])[0]) for toks, last in _chunks(list(range(80)))]
    assert lengths[:-1] == [24_000] * 3  # first and middle: 25 tokens x 960 samples
    assert lengths[-1] == (3 + 80 - 75) * 960 + D.source_cache_samples  # the rest and the held tail


def demo_waveforms(official: OfficialStream, steps: list[list[int]]) -> list[np.ndarray | None]:
    """The duplex demo's own `DuplexCapability._generate_waveform_from_tokens` (MiniCPMO45/
    modeling_minicpmo_unified.py:5449, with `force_flush=True` as its caller sets at :5196) run per step of one
    turn, its `audio_tokenizer.stream` the official modules' chunk above (as 16-bit PCM bytes, as
    minicpmo-utils' `Token2wav.stream` returns them); the last step ends the turn."""
    modeling = demo_module("modeling_minicpmo_unified")

    def stream(tokens: list[int], prompt_wav=None, last_chunk: bool = False) -> bytes:
        return (np.clip(official.chunk(list(tokens), last_chunk), -1, 1) * 32767.0).astype("<i2").tobytes()

    demo = SimpleNamespace(token2wav_initialized=True, token2wav_buffer=list(SILENCE), pre_lookahead=D.lookahead,
                           chunk_terminator_token_ids=[], _log=lambda *a, **k: None,
                           model=SimpleNamespace(tts=SimpleNamespace(audio_tokenizer=SimpleNamespace(stream=stream))))
    official.restart()  # _reset_token2wav_for_new_turn (:4406): the prompt's caches and 3 silence tokens
    return [modeling.DuplexCapability._generate_waveform_from_tokens(
        demo, torch.tensor(toks), None, is_last_chunk=i == len(steps) - 1, force_flush=True)
        for i, toks in enumerate(steps)]


@pytest.fixture(scope="module")
def demo_steps(assets):
    """One turn through the duplex demo's own flush, its first step 10 tokens: (the voice, the steps, the demo's
    audio per step, HiFT's random draws). Run once for every path."""
    folder, host, _ = assets
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch._dynamo.config, "disable", True, raising=False)
        flow, hift = _official(folder, host)
        rng = np.random.default_rng(11)
        steps = [rng.integers(0, D.vocab, n).tolist() for n in (10, 25, 26, 40, 7)]
        voice = _voice(5, 17)
        official = OfficialStream(flow, hift, *voice)
        want = demo_waveforms(official, steps)
    return voice, steps, want, official.noise()


@pytest.mark.parametrize("path", PATHS)
def test_steps_flush_as_the_duplex_demo_does(assets, demo_steps, monkeypatch, path: str) -> None:
    """A turn whose first step brings 10 tokens (a short first chunk): the forced flush voices them at once
    (left-padded to 1 s), and every step's audio equals the demo's, 16-bit PCM as it makes it."""
    streamer = path_streamer(assets, path)
    voice, steps, want, draws = demo_steps
    queue = list(draws)
    stage = Token2WavStage(streamer, VoicePrompts(streamer, lambda a: None, VoiceFeatures(*voice)),
                           get_preset("tiny"), ttl_s=60)
    monkeypatch.setattr(streamer, "noise", lambda s, n: queue.pop(0))
    sess = Token2WavSession()
    for i, toks in enumerate(steps):
        req = Token2WavRequest(np.asarray(toks, np.int64), turn_start=i == 0, finalize=i == len(steps) - 1)
        got = stage.compute([(req, sess)])[0].waveform
        if want[i] is None:
            assert len(got) == 0, i
            continue
        assert len(got) == len(want[i]), i
        pcm = (np.clip(got, -1, 1) * 32767.0).astype("<i2").astype(np.float32) / 32768.0
        assert np.abs(pcm - want[i]).max() <= 1 / 32768, i  # one step of 16 bits at most
    assert not queue
    assert len(want[0]) == 24_000 and np.abs(want[0]).max() > 0  # the first step is heard, padded to 1 s

"""Our token2wav stream (numpy + ONNX Runtime) against the official modules' own streaming, same weights.

Random weights at small widths in the checkpoint's file layout (flow.yaml, flow.pt, hift.pt). The reference
loop is MiniCPM-o's Token2wav.stream (stepaudio2-minicpmo 0.1.1: 3 x token 4218 after the prompt, the original
HiFT with its 8-frame mel / 3840-sample source caches and Hamming cross-fade, the estimator cache trimmed
to the prompt + 100 frames) with minicpmo-utils 1.0.7's conformer trim and first-chunk lead, re-run on CPU.
"""

from __future__ import annotations

import unittest.mock as mock
from pathlib import Path

import numpy as np
import pytest
import torch

from export.modules.stepaudio2 import load_flow_yaml
from export.modules.token2wav import Token2WavModel, build_hift
from export.onnx_export import export_onnx
from export.presets import get_preset
from export.stages import token2wav_stage_graphs
from minicpmo_triton.engines import OnnxEngine
from minicpmo_triton.model_config import Token2WavDims
from minicpmo_triton.stages.token2wav_stream import Token2WavStreamer

D = Token2WavDims()
SILENCE = [D.silence_token] * 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Token2WavStreamer]:
    """Random weights saved in the real layout, loaded back, and our three graphs exported from them."""
    folder = tmp_path_factory.mktemp("token2wav")
    Token2WavModel.random(D, seed=3).save(folder / "assets", D)
    model = Token2WavModel.load(folder / "assets", D)
    engines = {}
    for graph in token2wav_stage_graphs(get_preset("tiny"), model):
        path = folder / graph.file
        export_onnx(graph, path)
        engines[graph.name.removeprefix("token2wav_")] = OnnxEngine(path)
    return folder / "assets", Token2WavStreamer(engines, model.tables(), D)


def _official(folder: Path, streamer: Token2WavStreamer) -> tuple[torch.nn.Module, torch.nn.Module]:
    flow = load_flow_yaml(folder / "flow.yaml")
    flow.load_state_dict(torch.load(folder / "flow.pt", weights_only=True))
    hift = build_hift(D)
    hift.load_state_dict({k.removeprefix("generator."): v for k, v in torch.load(folder / "hift.pt").items()})
    cfm, est = flow.decoder, flow.decoder.estimator
    # The official CFM / DiT write caches into scratch buffers sized for the real widths (16 blocks, 1024, ...).
    cfm.cnn_cache_buffer = torch.zeros(D.n_timesteps, D.dit_depth, 2, 2 * D.dit_hidden, 2)
    cfm.att_cache_buffer = torch.zeros(D.n_timesteps, D.dit_depth, 2, D.dit_heads, 1000, 2 * D.dit_head_dim)
    est.cnn_cache_buffer = torch.zeros(D.dit_depth, 2, 2 * D.dit_hidden, 2)
    est.att_cache_buffer = torch.zeros(D.dit_depth, 2, D.dit_heads, 1000, 2 * D.dit_head_dim)
    cfm.rand_noise = torch.from_numpy(streamer.rand_noise)[None]  # its noise is drawn unseeded at construction
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


@torch.inference_mode()
def reference_stream(flow, hift, ptok: np.ndarray, pmel: np.ndarray, spk: np.ndarray,
                     turns: list[list[int]]) -> tuple[list[list[np.ndarray]], list[tuple[np.ndarray, np.ndarray]]]:
    """Token2wav.stream chunk by chunk; returns each turn's audio pieces and HiFT's random draws in order."""
    spk_t = torch.from_numpy(spk)[None]
    prompt = flow.setup_cache(torch.cat([torch.from_numpy(ptok)[None], torch.tensor([SILENCE])], 1),
                              torch.from_numpy(pmel)[None], spk_t, n_timesteps=D.n_timesteps)
    prompt = {k: v.clone() for k, v in prompt.items()}  # the official returns views of scratch buffers
    window = torch.from_numpy(np.hamming(2 * D.source_cache_samples))
    ls, frames = D.source_cache_samples, pmel.shape[0]
    draws: list[torch.Tensor] = []
    rand, randn_like = torch.rand, torch.randn_like

    def record(fn):
        def wrapped(*args, **kwargs):
            draws.append(fn(*args, **kwargs))
            return draws[-1]
        return wrapped

    audio = []
    for tokens in turns:
        cache = {k: v.clone() for k, v in prompt.items()}
        hc = {"mel": torch.zeros(1, 80, 0), "source": torch.zeros(1, 1, 0), "speech": torch.zeros(1, 0)}
        pieces, first = [], True
        for toks, last in _chunks(tokens):
            chunk_mel, cache = flow.inference_chunk(torch.tensor([toks]), spk_t, cache, last, D.n_timesteps)
            cache = {k: v.clone() for k, v in cache.items()}
            att = cache["estimator_att_cache"]
            if att.shape[4] > frames + D.cache_tail_frames:
                cache["estimator_att_cache"] = torch.cat([att[..., :frames, :], att[..., -D.cache_tail_frames:, :]], 4)
            cache["conformer_att_cache"] = _trim_conformer(cache["conformer_att_cache"], frames, D.num_blocks)
            mel = torch.cat([hc["mel"], chunk_mel], dim=2)
            with mock.patch("torch.rand", record(rand)), mock.patch("torch.randn_like", record(randn_like)):
                speech, source = hift(mel, hc["source"])
            if hc["speech"].shape[-1]:
                speech = speech.clone()
                speech[..., :ls] = speech[..., :ls] * window[:ls] + hc["speech"][..., -ls:] * window[ls:]
            hc = {"mel": mel[..., -D.mel_cache_frames:], "source": source[:, :, -ls:], "speech": speech[:, -ls:]}
            if not last:
                speech = speech[:, :-ls]
                if first:
                    speech = torch.cat([torch.zeros(1, ls), speech], dim=1)
            first = False
            pieces.append(speech[0].numpy())
        audio.append(pieces)
    # per HiFT call: rand (initial phases), randn_like (sine noise), randn_like (unused noise branch)
    noise = [(draws[i][0].numpy().copy(), draws[i + 1][0].numpy()) for i in range(0, len(draws), 3)]
    for r, _ in noise:
        r[0] = 0.0
    return audio, noise


def _voice(seed: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, D.vocab, n_tokens), rng.normal(-6, 1.5, (2 * n_tokens, 80)).astype(np.float32),
            rng.standard_normal(192).astype(np.float32))


def test_streamed_utterances_match_the_official_streaming(assets, monkeypatch) -> None:
    folder, streamer = assets
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # the conformer's forward_chunk is torch.compile'd
    flow, hift = _official(folder, streamer)
    rng = np.random.default_rng(7)
    # two sessions with different voices (prompts of different lengths), two turns each; 90 tokens a turn
    # pass the attention caches' prompt + 100 frames, so the trimming is exercised
    voices = [_voice(1, 20), _voice(2, 13)]
    turns = [[rng.integers(0, D.vocab, 90).tolist(), rng.integers(0, D.vocab, 30).tolist()] for _ in voices]
    expected, noises = zip(*(reference_stream(flow, hift, *v, t) for v, t in zip(voices, turns, strict=True)),
                           strict=True)
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
    print(f"token2wav streamed vs official streaming: max |diff| = {worst:.3g}")
    assert worst < 1e-3
    assert all(not q for q in queues)  # every HiFT call of the reference had its twin


def test_middle_chunks_are_one_second(assets) -> None:
    _, streamer = assets
    stream = streamer.new_stream(streamer.setup(*_voice(4, 16)))
    streamer.restart(stream)
    lengths = [len(streamer.chunk([(stream, toks, last)])[0]) for toks, last in _chunks(list(range(80)))]
    assert lengths[:-1] == [24_000] * 3  # first and middle: 25 tokens x 960 samples
    assert lengths[-1] == (3 + 80 - 75) * 960 + D.source_cache_samples  # the rest and the held tail

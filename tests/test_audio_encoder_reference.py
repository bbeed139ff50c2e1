"""The audio encoder against its references: transformers' `WhisperEncoder` under the checkpoint's names, and
MiniCPM-o 4.5's duplex streaming loop (Whisper KV cache across chunks) re-implemented on transformers' modules.

The streaming reference follows OpenBMB/MiniCPM-o-Demo @28b60cf:
- MiniCPMO45/modeling_minicpmo_unified.py `DuplexCapability.streaming_prefill` (audio buffer, 1035 ms first chunk
  zero-padded at the front, prefix 0 / 2 and suffix 2 extra frames), `MiniCPMO.get_audio_embedding_streaming`
  (cache reset when `cache_length + max_seq_len >= apm_max_len`), `MiniCPMWhisperEncoder.forward` (extra frames
  removed after conv2, positions continue from the cache length) and `MiniCPMWhisperEncoderLayer.forward`;
- MiniCPMO45/processing_minicpmo.py `StreamingMelProcessorExact.process` / `_extract_full` / `_maybe_slide_buffer`
  (chunk 1000 ms, first 1035 ms, redundancy 20 ms, window 30 s / 10 s) and `MiniCPMAAudioProcessor`'s numpy log-mel
  (-10 floor below 5 s of audio, max - 8 from then on).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MethodType, SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import WhisperConfig, WhisperFeatureExtractor
from transformers.audio_utils import spectrogram, window_function
from transformers.cache_utils import DynamicCache
from transformers.models.whisper.modeling_whisper import WhisperEncoder as HfWhisperEncoder

from export.checkpoint import load_checkpoint
from export.config import preset_from_config
from export.onnx_export import export_onnx
from export.presets import tiny
from export.stages import build_modules, stage_graphs
from export.torch_engine import TorchEngine
from minicpmo_triton.engine.exported import OnnxEngine
from minicpmo_triton.media.audio_mel import log_mel, mel_filterbank
from minicpmo_triton.stage_io import AudioEncoderRequest
from minicpmo_triton.stages.audio_encoder import AudioEncoderStage, AudioStream, AudioStreamEncoder

from .reference_checkpoint import SEED, SMALL_CONFIG, build_audio_encoder
from .reference_demo import demo_module
from .reference_model import transformers4_whisper

HIDDEN = tiny().llm.hidden  # the LLM width the projector maps to
SR = 16_000


def audio_config(max_positions: int) -> dict:
    return {"num_mel_bins": 80, "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64, "max_source_positions": max_positions}


def reference_modules(max_positions: int, seed: int = 0) -> tuple[HfWhisperEncoder, nn.Sequential]:
    torch.manual_seed(seed)
    config = WhisperConfig(**audio_config(max_positions), activation_function="gelu")
    config._attn_implementation = "eager"
    encoder = HfWhisperEncoder(config).eval()
    projection = nn.Sequential(nn.Linear(32, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN)).eval()
    with torch.no_grad():  # a trained model's spread, biases and norms included, so every term counts
        for name, p in [*encoder.named_parameters(), *projection.named_parameters()]:
            p.copy_((1.0 if "norm.weight" in name else 0.0) + 0.1 * torch.randn_like(p))
    return encoder, projection


def write_checkpoint(folder: Path, encoder: HfWhisperEncoder, projection: nn.Sequential) -> None:
    tensors = {f"apm.{k}": v.contiguous() for k, v in encoder.state_dict().items()}
    for ours, ref in (("linear1", "0"), ("linear2", "2")):
        for kind in ("weight", "bias"):
            tensors[f"audio_projection_layer.{ours}.{kind}"] = projection.state_dict()[f"{ref}.{kind}"].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"audio_config": dict(encoder.config.to_dict(), **audio_config(encoder.config.max_source_positions)),
              "audio_pool_step": 5}
    (folder / "config.json").write_text(json.dumps(config))


def loaded_audio_encoder(folder: Path) -> tuple[nn.Module, object]:
    config = json.loads((folder / "config.json").read_text())
    preset = preset_from_config(tiny(), config)
    modules = build_modules(preset, seed=5)
    assert "audio_encoder" in load_checkpoint(folder, modules, preset, require=("audio_encoder",))
    return modules, preset


def reference_embeddings(encoder: HfWhisperEncoder, projection: nn.Sequential, states: torch.Tensor) -> np.ndarray:
    x = projection(states).transpose(1, 2)
    return nn.functional.avg_pool1d(x, 5, 5).transpose(1, 2)[0].detach().numpy()


def demo_get_audio_embedding(apm_tensors: dict[str, torch.Tensor], audio_config: dict, pool: int,
                             audio: np.ndarray, chunk_length: float) -> np.ndarray:
    """The reference's own whole-utterance path, run: `process_audio_batch` with `MiniCPMAAudioProcessor`
    (MiniCPMO45/processing_minicpmo.py:435, as `MiniCPMOProcessor.process_audio` calls it at :1189), then
    `MiniCPMO.get_audio_embedding(data, chunk_length)` (MiniCPMO45/modeling_minicpmo_unified.py:1619, as the
    duplex system prompt's voice reference calls it at :4484 and chat at :1768 / :3181) on the reference's
    `MiniCPMWhisperEncoder` (:5815) and `MultiModalProjector` (:6042) holding the checkpoint's tensors."""
    modeling, processing = demo_module("modeling_minicpmo_unified"), demo_module("processing_minicpmo")
    config = WhisperConfig(**audio_config, activation_function="gelu")
    config._attn_implementation = "eager"  # MiniCPMO.init_audio_module's choice when the model runs eager
    apm = modeling.MiniCPMWhisperEncoder(config).eval()
    apm.load_state_dict({k.removeprefix("apm."): v for k, v in apm_tensors.items() if k.startswith("apm.")})
    transformers4_whisper(apm)
    projection = modeling.MultiModalProjector(audio_config["d_model"], apm_tensors[
        "audio_projection_layer.linear1.weight"].shape[0]).eval()
    projection.load_state_dict({k.removeprefix("audio_projection_layer."): v for k, v in apm_tensors.items()
                                if k.startswith("audio_projection_layer.")})
    model = SimpleNamespace(apm=apm, audio_projection_layer=projection, audio_encoder_layer=-1, training=False,
                            audio_avg_pooler=nn.AvgPool1d(pool, stride=pool),
                            config=SimpleNamespace(audio_pool_step=pool),
                            subsequent_chunk_mask=modeling.MiniCPMO.subsequent_chunk_mask)
    model._get_feat_extract_output_lengths = MethodType(modeling.MiniCPMO._get_feat_extract_output_lengths, model)
    features, lens = processing.process_audio_batch([audio], processing.MiniCPMAAudioProcessor(feature_size=80),
                                                    sampling_rate=SR, max_duration_seconds=30)
    with torch.no_grad():
        nested = modeling.MiniCPMO.get_audio_embedding(model, {"audio_features": features, "audio_feature_lens": lens},
                                                       chunk_length=chunk_length)
    return torch.cat([t for group in nested for t in group]).numpy()


@pytest.fixture(scope="module")
def whole_utterance(tmp_path_factory: pytest.TempPathFactory):
    """The small reference checkpoint's `apm.*` / `audio_projection_layer.*` (tests/reference_checkpoint.py),
    loaded by our loader and exported as the `audio_encoder` model's graph, served by our stage."""
    folder = tmp_path_factory.mktemp("apm_whole")
    _, tensors = build_audio_encoder(SMALL_CONFIG, torch.Generator().manual_seed(SEED))
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(SMALL_CONFIG))
    preset = preset_from_config(tiny(), SMALL_CONFIG)
    modules = build_modules(preset, seed=5)
    assert "audio_encoder" in load_checkpoint(folder, modules, preset, require=("audio_encoder",))
    graph = next(g for g in stage_graphs(preset, modules) if g.name == "audio_encoder")
    export_onnx(graph, folder / "model.onnx")
    return tensors, AudioEncoderStage(OnnxEngine(folder / "model.onnx"), preset.samples_per_audio_token)


@pytest.mark.parametrize("seconds", [3.37, 0.5, 29.9])
def test_whole_utterance_is_the_references_get_audio_embedding(whole_utterance, seconds: float) -> None:
    """Voice references, turn-based audio and replays: the exported graph through our stage equals the
    reference's block-causal encoding (1 s blocks), at a length that is no whole token (the tail is the
    reference's zero padding, its tokens counted as the reference counts them), up to 30 s."""
    tensors, stage = whole_utterance
    a = SMALL_CONFIG["audio_config"]
    audio = 0.2 * np.concatenate(speechlike(32, seed=5))[: int(seconds * SR)]
    want = demo_get_audio_embedding(tensors, a, SMALL_CONFIG["audio_pool_step"], audio, chunk_length=1.0)
    got = stage.run([AudioEncoderRequest(audio)])[0].embeds
    diff = float(np.abs(got - want).max())
    print(f"whole utterance {seconds} s: max |ours - reference get_audio_embedding| = {diff:.3g} "
          f"(scale {np.abs(want).max():.3g})")
    assert got.shape == want.shape
    assert diff < 1e-4
    if seconds > 1:  # the mask matters: full attention (chunk_length=-1) reads the future, and differs
        full = demo_get_audio_embedding(tensors, a, SMALL_CONFIG["audio_pool_step"], audio, chunk_length=-1)
        assert np.abs(full[:10] - want[:10]).max() > 100 * max(diff, 1e-6)


def test_past_30_seconds_each_piece_is_the_references_piece_alone(whole_utterance) -> None:
    """Past 30 s the reference cuts 30 s pieces (`chunk_audio`, processing_minicpmo.py:411) and encodes them as one
    padded batch. Two departures, named in docs/checkpoint.md: its padding mask compares encoder positions with
    mel-frame lengths (modeling_minicpmo_unified.py:1629-1646), so a short last piece's keys include its zero
    padding; we encode each piece alone, as the reference encodes a piece that is alone. And a piece of exactly
    30 s has no zero padding there, so its last frame is reflect-centred; ours sees zeros (its last token)."""
    tensors, stage = whole_utterance
    a, pool = SMALL_CONFIG["audio_config"], SMALL_CONFIG["audio_pool_step"]
    audio = 0.2 * np.concatenate(speechlike(32, seed=5))[: int(31.3 * SR)]
    got = stage.run([AudioEncoderRequest(audio)])[0].embeds
    first = demo_get_audio_embedding(tensors, a, pool, audio[: 30 * SR], chunk_length=1.0)
    last = demo_get_audio_embedding(tensors, a, pool, audio[30 * SR:], chunk_length=1.0)
    assert got.shape == (len(first) + len(last), first.shape[1]) == (313, first.shape[1])
    assert np.abs(got[:299] - first[:299]).max() < 1e-4
    assert np.abs(got[300:] - last).max() < 1e-4


def test_audio_chunk_length_is_read_from_the_config() -> None:
    assert preset_from_config(tiny(), SMALL_CONFIG).audio.chunk_frames == 50  # the reference's default, 1.0 s
    assert preset_from_config(tiny(), {**SMALL_CONFIG, "audio_chunk_length": 2.0}).audio.chunk_frames == 100
    assert preset_from_config(tiny(), {**SMALL_CONFIG, "audio_chunk_length": -1}).audio.chunk_frames == 0


def test_numpy_log_mel_is_whispers() -> None:
    audio = np.random.default_rng(1).standard_normal(SR).astype(np.float32) * 0.1
    fe = WhisperFeatureExtractor(feature_size=80)
    want = spectrogram(audio, window_function(400, "hann"), frame_length=400, hop_length=160, power=2.0,
                       mel_filters=fe.mel_filters, log_mel="log10")[:, :-1]
    np.testing.assert_allclose(log_mel(audio, mel_filterbank(80)), want, atol=1e-4)


class ReferenceDuplexAudio:
    """MiniCPM-o 4.5's duplex audio path, one session, on transformers' Whisper modules (see the module doc)."""

    def __init__(self, encoder: HfWhisperEncoder, projection: nn.Sequential) -> None:
        self.encoder, self.projection = encoder, projection
        self.mel_filters = WhisperFeatureExtractor(feature_size=80).mel_filters
        for i, layer in enumerate(encoder.layers):
            layer.self_attn.layer_idx = i  # MiniCPMWhisperEncoderLayer(config, layer_idx=i)
        self.audio_buffer = np.zeros(0, np.float32)  # DuplexCapability.audio_buffer
        self.buffer = np.zeros(0, np.float32)  # StreamingMelProcessorExact.buffer
        self.base_T = self.last_emitted_T = self.chunk_idx = 0
        self.cache: DynamicCache | None = None
        self.resets = 0

    def mel_chunk(self, audio_chunk: np.ndarray) -> np.ndarray:  # StreamingMelProcessorExact.process
        self.buffer = np.concatenate([self.buffer, audio_chunk])
        if len(self.buffer) >= 30 * SR:  # _maybe_slide_buffer
            guard = min(SR, len(self.buffer) - 10 * SR)
            drop = min(10 * SR, max(0, len(self.buffer) - guard)) // 160 * 160
            self.buffer = self.buffer[drop:]
            self.base_T += drop // 160
        log_spec = spectrogram(self.buffer, window_function(400, "hann"), frame_length=400, hop_length=160,
                               power=2.0, mel_filters=self.mel_filters, log_mel="log10")[:, :-1]
        floor = -10.0 if len(self.buffer) < 5 * SR else log_spec.max() - 8.0  # _extract_full's two settings
        mel_full = (np.maximum(log_spec, floor) + 4.0) / 4.0
        stable = (len(self.buffer) - 200) // 160 + 1
        core_start, core_end = self.last_emitted_T, self.last_emitted_T + 100
        assert self.base_T + min(mel_full.shape[1], stable) >= core_end + 2
        start, end = max(0, core_start - 2) - self.base_T, core_end + 2 - self.base_T
        self.last_emitted_T = core_end
        return mel_full[:, start:end].astype(np.float32)

    @torch.no_grad()
    def step(self, chunk: np.ndarray) -> np.ndarray:  # streaming_prefill's audio part, for one 1 s chunk
        self.audio_buffer = np.concatenate([self.audio_buffer, chunk])
        if self.chunk_idx == 0 and len(self.audio_buffer) < 16_560:
            self.audio_buffer = np.concatenate([np.zeros(16_560 - len(self.audio_buffer), np.float32),
                                                self.audio_buffer])
        need = 16_480 if self.chunk_idx == 0 else 16_000  # get_streaming_chunk_size (hop-aligned 1030 ms)
        mel = torch.from_numpy(self.mel_chunk(self.audio_buffer[:need]))[None]
        prefix = 0 if self.chunk_idx == 0 else 2
        enc = self.encoder
        max_seq_len = (mel.shape[-1] - 1) // 2 + 1  # get_audio_embedding_streaming
        if self.cache is not None and self.cache.get_seq_length() + max_seq_len >= enc.embed_positions.weight.shape[0]:
            self.cache, self.resets = None, self.resets + 1
        x = nn.functional.gelu(enc.conv2(nn.functional.gelu(enc.conv1(mel))))  # MiniCPMWhisperEncoder.forward
        if prefix:
            x = x[:, :, (prefix + 1) // 2:]
        x = x[:, :, :-1].permute(0, 2, 1)  # suffix 2 -> one frame after the stride-2 conv
        if self.cache is None:
            self.cache = DynamicCache()
        past = self.cache.get_seq_length()
        x = x + enc.embed_positions.weight[past: past + x.shape[1]]
        mask = torch.zeros(1, 1, x.shape[1], past + x.shape[1])  # bidirectional over past and chunk
        for layer in enc.layers:  # MiniCPMWhisperEncoderLayer.forward
            h, _ = layer.self_attn(layer.self_attn_layer_norm(x), cache=self.cache, attention_mask=mask)
            x = x + h
            x = x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
        out = reference_embeddings(enc, self.projection, enc.layer_norm(x))
        self.audio_buffer = self.audio_buffer[need:]
        self.chunk_idx += 1
        return out


def speechlike(seconds: int, seed: int) -> list[np.ndarray]:
    """1 s chunks whose loudness changes, so the mel's dynamic floor (from 5 s) and its window (30 s) matter."""
    rng = np.random.default_rng(seed)
    t = np.arange(seconds * SR) / SR
    envelope = np.repeat(rng.uniform(0.01, 0.5, seconds * 4), SR // 4)
    audio = envelope * (np.sin(2 * np.pi * rng.uniform(150, 400) * t) + 0.3 * rng.standard_normal(len(t)))
    audio[int(7.3 * SR): int(7.6 * SR)] *= 8  # a loud burst after 5 s raises the floor for the rest of the window
    return [c.astype(np.float32) for c in np.split(audio, seconds)]


@pytest.fixture(scope="module")
def streaming(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("apm_stream")
    encoder, projection = reference_modules(max_positions=200)  # the cache resets every 3 chunks
    write_checkpoint(folder, encoder, projection)
    modules, preset = loaded_audio_encoder(folder)
    graph = next(g for g in stage_graphs(preset, modules) if g.name == "audio_encoder_stream")
    export_onnx(graph, folder / "stream.onnx")
    torch_encoder = AudioStreamEncoder(TorchEngine(graph.module, graph.output_names), preset.audio, 1600)
    onnx_encoder = AudioStreamEncoder(OnnxEngine(folder / "stream.onnx"), preset.audio, 1600)
    return encoder, projection, torch_encoder, onnx_encoder


def test_streamed_encoding_follows_the_reference_loop(streaming) -> None:
    """36 one-second chunks: positions continue, the cache resets, the mel floor turns dynamic at 5 s and its
    window slides at 30 s; every chunk's 10 embeddings match the reference's."""
    encoder, projection, torch_encoder, _ = streaming
    reference = ReferenceDuplexAudio(encoder, projection)
    stream = AudioStream()
    worst = 0.0
    for i, chunk in enumerate(speechlike(36, seed=2)):
        want = reference.step(chunk)
        got = torch_encoder.run([(chunk, stream)])[0]
        assert got.shape == want.shape == (10, HIDDEN)
        worst = max(worst, float(np.abs(got - want).max()))
        assert np.abs(got - want).max() < 2e-4, f"chunk {i}"
    print(f"streaming: max |ours - reference loop| over 36 chunks = {worst:.3g}; reference resets {reference.resets}")
    assert reference.resets == 11 and stream.mel.base_frame > 0  # both the cache reset and the slide happened
    assert stream.cache is not None and stream.cache.length == 50 * (36 - 3 * 11)


def test_streaming_onnx_matches_pytorch_batched_across_sessions(streaming) -> None:
    """Two sessions in one batch, one joining later (ragged caches, a first chunk beside a later one), through
    the exported graph and through PyTorch: the same embeddings and caches chunk by chunk; and streaming
    differs from encoding each second alone (what the model hears now carries its past)."""
    _, _, torch_encoder, onnx_encoder = streaming
    a, b = speechlike(6, seed=3), speechlike(4, seed=4)
    ours = {k: (AudioStream(), AudioStream()) for k in ("torch", "onnx")}
    for step in range(6):
        for name, enc in (("torch", torch_encoder), ("onnx", onnx_encoder)):
            items = [(a[step], ours[name][0])] + ([(b[step - 2], ours[name][1])] if step >= 2 else [])
            out = enc.run(items)
            if name == "torch":
                want = out
            else:
                for w, g in zip(want, out, strict=True):
                    np.testing.assert_allclose(g, w, atol=1e-4)
        for t, o in zip(ours["torch"], ours["onnx"], strict=True):
            if t.cache is not None:
                np.testing.assert_allclose(o.cache.key, t.cache.key, atol=1e-4)
    assert ours["onnx"][0].cache.length == 50 * 3  # reset after 3 chunks at 200 positions: chunks 3..5
    alone = onnx_encoder.run([(a[5], AudioStream())])[0]
    assert np.abs(alone - want[0]).max() > 1e-3

"""minicpmo-utils 1.0.7's token2wav layout through our stage, against the package's own Token2wav.stream.

The layout (assets/token2wav: flow.yaml, flow.pt, config.yaml + hift.pt for the causal HiFT, hift_original.pt
for the original) is built with random weights from the official classes. The reference is the package's
`Token2wav` (stepaudio2/token2wav.py): its own `set_stream_cache`, `stream`, `_stream_vocode`, `_trim_*` and
`load_causal_vocoder`, on CPU. Two things stand in for what this machine lacks, neither on the streaming path:
its `__init__` (token2wav.py:92-134) puts every model on CUDA and loads the S3 tokenizer and CAM++, so the object
gets the attributes it sets there, on CPU, and its voice prompt directly in `cache` (what `_prepare_prompt`,
token2wav.py:136-156, would compute from a wav); and the modules it imports at its top for that prompt preparation
only (torchaudio, which has no build for torch 2.13, s3tokenizer, librosa for the mel function) are empty while
it is imported.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from export.checkpoint import TOKEN2WAV_ASSETS, copy_causal_vocoder, load_token2wav, token2wav_layout
from export.modules.token2wav import Token2WavModel, tables_bytes
from export.onnx_export import export_onnx
from export.presets import get_preset
from export.stages import token2wav_stage_graphs
from minicpmo_triton.model_config import Token2WavDims, load_stage_config
from minicpmo_triton.stage_io import Token2WavRequest
from minicpmo_triton.stages.token2wav import Token2WavSession, Token2WavStage, VoicePrompts
from minicpmo_triton.stages.token2wav_stream import TABLES_FILE, Token2WavStreamer
from minicpmo_triton.stages.voice_prompt import VoiceFeatures
from minicpmo_triton.vocoder.causal_vocoder import load_causal_hift
from minicpmo_triton.vocoder.official_stepaudio2 import stepaudio2_module

from .conftest import REPO
from .reference_checkpoint import to_1_0_7_layout, write_checkpoint
from .test_token2wav_parity import _chunks, _voice, fit_scratch_buffers

pytestmark = pytest.mark.checkpoints  # .ci/run's step of its own

D = Token2WavDims()
def write_1_0_7_layout(root: Path) -> Path:
    """A checkpoint folder whose assets/token2wav holds 1.0.7's files, random weights from the official classes."""
    assets = root / TOKEN2WAV_ASSETS
    Token2WavModel.random(D, seed=3).save(assets, D)
    to_1_0_7_layout(assets)
    return assets


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the checkpoint's assets folder, token2wav's exported folder: graphs, tables, the causal vocoder copied)."""
    root = tmp_path_factory.mktemp("ckpt_1_0_7")
    assets = write_1_0_7_layout(root)
    model = load_token2wav(root, D)
    assert model is not None
    folder = root / "token2wav"
    folder.mkdir()
    for graph in token2wav_stage_graphs(get_preset("tiny"), model):
        export_onnx(graph, folder / graph.file)
    (folder / TABLES_FILE).write_bytes(tables_bytes(model))
    assert copy_causal_vocoder(root, folder)
    return assets, folder


def official_token2wav_module() -> types.ModuleType:
    """stepaudio2/token2wav.py, imported with empty stand-ins for what only its prompt preparation and
    whole-utterance paths use (token2wav.py:9-13, 21: torchaudio, s3tokenizer; librosa under its mel function)."""
    if "stepaudio2.token2wav" in sys.modules:
        return sys.modules["stepaudio2.token2wav"]
    stepaudio2_module("causal_vocoder.bounded_vocoder")  # the real classes, registered before the import
    names = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "s3tokenizer", "librosa",
             "librosa.filters")
    stand_ins = {n: types.ModuleType(n) for n in names if n not in sys.modules}
    for name, module in stand_ins.items():
        parent, _, child = name.rpartition(".")
        if parent in stand_ins:
            setattr(stand_ins[parent], child, module)
    if "librosa.filters" in stand_ins:
        stand_ins["librosa.filters"].mel = None  # type: ignore[attr-defined]
    sys.modules.update(stand_ins)
    try:
        return stepaudio2_module("token2wav")
    finally:
        for name in stand_ins:
            del sys.modules[name]


def official_token2wav(assets: Path, voices: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                       rand_noise: np.ndarray) -> object:
    """The package's Token2wav on CPU: the attributes its __init__ sets (token2wav.py:93-134), models loaded by its
    own loaders, and each voice's prompt as `_prepare_prompt` returns it (tokens, lens, CAM++ vector, mel, lens)."""
    module = official_token2wav_module()
    t2w = module.Token2wav.__new__(module.Token2wav)
    t2w.float16, t2w.n_timesteps, t2w.device, t2w.model_path = False, D.n_timesteps, torch.device("cpu"), assets
    t2w.flow = module._load_config(assets / "flow.yaml")["flow"]
    t2w.flow.load_state_dict(torch.load(assets / "flow.pt", map_location="cpu", weights_only=True), strict=True)
    fit_scratch_buffers(t2w.flow.eval(), rand_noise)
    t2w.hift, t2w.vocoder_checkpoint, t2w.vocoder_config = module.load_causal_vocoder(assets, t2w.device)
    t2w.bounded_vocoder = module.BoundedVocoder(t2w.hift)
    t2w.sample_rate, t2w.hop_samples = 24000, 480
    t2w.vocoder_delay_frames = t2w.hift.f0_predictor.condnet[0].causal_padding + t2w.hift.conv_pre_look_right + 1
    assert t2w.vocoder_delay_frames == 8
    t2w.vocoder_delay_samples = t2w.source_cache_len = t2w.vocoder_delay_frames * t2w.hop_samples
    t2w.original_vocoder_checkpoint, t2w.original_hift = assets / "hift_original.pt", None
    t2w.cache = {}
    for key, (tokens, mel, spk) in voices.items():
        ptok = torch.from_numpy(tokens.astype(np.int32))[None]
        pmel = torch.from_numpy(mel)[None]
        t2w.cache[key] = (ptok, torch.tensor([ptok.shape[1]]), torch.from_numpy(spk)[None], pmel,
                          torch.tensor([pmel.shape[1]]))
    t2w.stream_cache, t2w.hift_cache_dict, t2w._stream_prompt = None, {}, None
    return t2w


def test_1_0_7_layout_streams_as_the_official_token2wav(layout, monkeypatch) -> None:
    """Two sessions with different voices, two turns each, batched through our stage; every step's audio equals
    what the package's Token2wav.stream gives for the same chunks (whole 25 + 3 chunks: `flush` off)."""
    assets, folder = layout
    # the conformer's forward_chunk is torch.compile'd; raising=False: torch's config module loses the name once a
    # monkeypatch of it is undone, so a second test in this process could not patch it otherwise
    monkeypatch.setattr(torch._dynamo.config, "disable", True, raising=False)
    streamer = Token2WavStreamer.load(folder, D)
    assert streamer.causal is not None
    voices = {"a": _voice(1, 20), "b": _voice(2, 13)}
    official = official_token2wav(assets, voices, streamer.rand_noise)
    # the causal source's noise table is drawn unseeded when the model is built: the reference's, in ours too
    streamer.causal.model.m_source.l_sin_gen.sine_waves = official.hift.m_source.l_sin_gen.sine_waves
    rng = np.random.default_rng(7)
    steps = {"a": [[25, 25, 25, 15], [25, 5]], "b": [[25, 25, 10], [25, 25, 3]]}
    tokens = {k: [rng.integers(0, D.vocab, sum(s)).tolist() for s in turns] for k, turns in steps.items()}

    expected: dict[str, list[list[np.ndarray]]] = {}
    for key in voices:  # the package's own loop: a turn starts with set_stream_cache (token2wav.py:189-204)
        expected[key] = []
        for turn in tokens[key]:
            official.set_stream_cache(key)
            expected[key].append([official.stream(toks, key, last_chunk=last, return_waveform=True)[0]
                                  for toks, last in _chunks(turn)])

    featurized = {float(i): VoiceFeatures(*v) for i, v in enumerate(voices.values())}
    stage = Token2WavStage(streamer, VoicePrompts(streamer, lambda a: featurized[float(a[0])], featurized[0.0]),
                           get_preset("tiny"), ttl_s=60)
    stage.flush = False  # whole chunks, as the reference is fed
    sessions = {k: Token2WavSession() for k in voices}
    references = {k: np.full(8000, float(i), np.float32) for i, k in enumerate(voices)}
    worst = 0.0
    for turn in range(2):
        for step in range(max(len(steps[k][turn]) for k in voices)):
            batch, keys = [], []
            for k in voices:
                counts = steps[k][turn]
                if step >= len(counts):
                    continue
                at = sum(counts[:step])
                batch.append((Token2WavRequest(np.asarray(tokens[k][turn][at:at + counts[step]], np.int64),
                                               voice=references[k], turn_start=step == 0,
                                               finalize=step == len(counts) - 1), sessions[k]))
                keys.append(k)
            for k, result in zip(keys, stage.compute(batch), strict=True):
                want = expected[k][turn][step]
                assert result.waveform.shape == want.shape, (k, turn, step)
                worst = max(worst, float(np.abs(result.waveform - want).max()))
    audio = np.concatenate([p for e in expected.values() for t in e for p in t])
    rms = float(np.sqrt(np.mean(audio ** 2)))
    print(f"1.0.7 token2wav through the stage vs the official Token2wav.stream: max |diff| = {worst:.3g} "
          f"(reference RMS {rms:.3g})")
    assert rms > 1e-2  # the reference is audio, not near-silence, so the tolerance below means something
    assert worst < 1e-4
    assert all(len(e[0][0]) == 24_000 for e in expected.values())  # 3840 samples of lead + 42 frames


def test_1_0_7_layout_is_detected_and_copied(layout, tmp_path: Path) -> None:
    """The export finds 1.0.7's layout, loads the original HiFT from hift_original.pt, and copies the causal one
    where the stage finds it; a later export of a checkpoint without it removes the copy."""
    assets, folder = layout
    assert token2wav_layout(assets.parent.parent) == "1.0.7"
    assert isinstance(load_causal_hift(folder / "causal_vocoder"), torch.nn.Module)
    assert not copy_causal_vocoder(tmp_path, folder)
    assert not (folder / "causal_vocoder").exists()
    assert copy_causal_vocoder(assets.parent.parent, folder)


def test_the_export_cli_serves_a_1_0_7_checkpoint(tmp_path: Path) -> None:
    """`python -m export --checkpoint` on a checkpoint whose assets/token2wav is 1.0.7's: it exports, copies the
    causal vocoder, and the exported token2wav stage loads it and streams a turn with it (the first step 1 s:
    3840 samples of lead + 42 frames, the last flushing the 8-frame delay)."""
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt)
    to_1_0_7_layout(ckpt / TOKEN2WAV_ASSETS)
    repo = tmp_path / "repo"
    done = subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5", "--checkpoint", str(ckpt),
                           "--model-repository", str(repo)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "minicpmo-utils 1.0.7's layout" in done.stdout
    folder = repo / "token2wav" / "1"
    stage = Token2WavStage.load(folder, load_stage_config(folder), ttl_s=60)
    assert stage.streamer.causal is not None
    sess = Token2WavSession()
    rng = np.random.default_rng(3)
    lengths = []
    for i, n in enumerate((25, 25, 10)):
        req = Token2WavRequest(rng.integers(0, D.vocab, n), turn_start=i == 0, finalize=i == 2)
        wav = stage.compute([(req, sess)])[0].waveform
        assert np.isfinite(wav).all()
        lengths.append(len(wav))
    assert lengths == [24_000, 24_000, (3 + 10) * 960 + 8 * 480]


def test_steps_flush_as_the_duplex_demo_does_on_1_0_7(layout, monkeypatch) -> None:
    """The duplex demo's own token2wav calls (MiniCPMO45/modeling_minicpmo_unified.py: `_init_token2wav_cache`
    :4398, `_reset_token2wav_for_new_turn` :4406, `_generate_waveform_from_tokens` :5449 with `force_flush=True`
    as its caller sets at :5196) on the package's Token2wav, two turns whose steps make short forced-flush chunks;
    every step's audio through our stage (flush on) equals the demo's, 16-bit PCM as it makes it."""
    from .reference_demo import demo_module

    assets, folder = layout
    # the conformer's forward_chunk is torch.compile'd (raising=False: see the test above)
    monkeypatch.setattr(torch._dynamo.config, "disable", True, raising=False)
    streamer = Token2WavStreamer.load(folder, D)
    voice = _voice(5, 17)
    official = official_token2wav(assets, {"v": voice}, streamer.rand_noise)
    assert streamer.causal is not None
    streamer.causal.model.m_source.l_sin_gen.sine_waves = official.hift.m_source.l_sin_gen.sine_waves
    prepared = official.cache["v"]
    official._prepare_prompt = lambda wav: prepared  # its CAM++ / S3 tokenizer / torchaudio part, done above
    modeling = demo_module("modeling_minicpmo_unified")
    demo = types.SimpleNamespace(token2wav_initialized=False, chunk_terminator_token_ids=[],
                                 _log=lambda *a, **k: None,
                                 model=types.SimpleNamespace(tts=types.SimpleNamespace(audio_tokenizer=official)))
    modeling.DuplexCapability._init_token2wav_cache(demo, "v")
    rng = np.random.default_rng(11)
    turns = [[rng.integers(0, D.vocab, n).tolist() for n in steps] for steps in ((10, 25, 26, 40, 7), (6, 30))]
    want = []
    for steps in turns:
        modeling.DuplexCapability._reset_token2wav_for_new_turn(demo)
        want.append([modeling.DuplexCapability._generate_waveform_from_tokens(
            demo, torch.tensor(toks), "v", is_last_chunk=i == len(steps) - 1, force_flush=True)
            for i, toks in enumerate(steps)])

    stage = Token2WavStage(streamer, VoicePrompts(streamer, lambda a: None, VoiceFeatures(*voice)),
                           get_preset("tiny"), ttl_s=60)
    sess = Token2WavSession()
    for turn, steps in enumerate(turns):
        for i, toks in enumerate(steps):
            req = Token2WavRequest(np.asarray(toks, np.int64), turn_start=i == 0, finalize=i == len(steps) - 1)
            got = stage.compute([(req, sess)])[0].waveform
            expected = want[turn][i]
            if expected is None:
                assert len(got) == 0, (turn, i)
                continue
            assert len(got) == len(expected), (turn, i)
            pcm = (np.clip(got, -1, 1) * 32767.0).astype("<i2").astype(np.float32) / 32768.0
            assert np.abs(pcm - expected).max() <= 1 / 32768, (turn, i)  # one step of 16 bits at most
    first = want[0][0]
    assert first is not None and len(first) == 24_000 and np.abs(first).max() > 0.05  # heard, padded to 1 s

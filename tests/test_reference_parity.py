"""The exported ONNX of a checkpoint built from the reference implementations reproduces them.

`llm.*` comes from transformers' Qwen3ForCausalLM and `tts.*` from MiniCPMTTS's own parts (LlamaModel,
weight-normed head, MLP projectors), saved in the published sharded layout (tests/reference_checkpoint.py);
the project reads that folder as `python -m export` does, exports each stage, and ONNX Runtime's outputs
must match the reference modules' within the printed tolerance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.checkpoint import load_checkpoint, read_config
from export.config import preset_from_config
from export.onnx_export import export_onnx
from export.presets import minicpmo45
from export.stages import build_modules, stage_graphs
from minicpmo_triton.engine.exported import OnnxEngine
from minicpmo_triton.model_config import PresetConfig
from minicpmo_triton.stage_io import TtsRequest
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.tts import TtsStage

from .reference_checkpoint import ReferenceCheckpoint, write_checkpoint

TOLERANCE = 1e-4
PARITY_STAGES = ("llm", "tts")  # the stages whose reference builders are real (audio/vision: none yet)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[ReferenceCheckpoint, PresetConfig, dict[str, Path]]:
    ref = write_checkpoint(tmp_path_factory.mktemp("reference_ckpt"))
    preset = preset_from_config(minicpmo45(), read_config(ref.folder))
    modules = build_modules(preset, seed=99)
    load_checkpoint(ref.folder, modules, preset)
    out = tmp_path_factory.mktemp("onnx")
    paths = {}
    for graph in stage_graphs(preset, modules):
        if graph.name in PARITY_STAGES:
            paths[graph.name] = out / graph.name / "model.onnx"
            export_onnx(graph, paths[graph.name])
    return ref, preset, paths


def _report(what: str, got: np.ndarray, want: torch.Tensor) -> float:
    diff = float(np.abs(got - want.detach().numpy()).max())
    print(f"{what}: max |onnx - reference| = {diff:.3g} (tolerance {TOLERANCE:g})")
    return diff


def _empty_past(layers: int, kv_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    past = np.zeros((layers, 1, kv_heads, 0, head_dim), np.float32)
    return {"past_mask": np.zeros((1, 0), bool), "past_key": past, "past_value": past}


def _with_past(key: np.ndarray, value: np.ndarray) -> dict[str, np.ndarray]:
    return {"past_mask": np.ones((1, key.shape[3]), bool), "past_key": key, "past_value": value}


def test_llm_matches_qwen3_for_causal_lm(exported) -> None:
    ref, preset, paths = exported
    qwen, d = ref.modules["llm"], preset.llm
    sess = ort.InferenceSession(str(paths["llm"]))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, d.vocab, (1, 9), generator=gen)
    audio = 0.3 * torch.randn(1, 9, d.hidden, generator=gen)
    use = torch.zeros(1, 9, dtype=torch.bool)
    use[0, 2:5] = True  # audio embeddings spliced in where the placeholders are
    with torch.no_grad():
        embeds = torch.where(use[..., None], audio, qwen.model.embed_tokens(ids))
        want = qwen(inputs_embeds=embeds, output_hidden_states=True)
    logits_all, hidden_all = want.logits, want.hidden_states[-1]  # last hidden state: after the final norm

    def run(lo: int, hi: int, past: dict[str, np.ndarray]) -> list[np.ndarray]:
        return sess.run(None, {"input_ids": ids[:, lo:hi].numpy(), "embeds": audio[:, lo:hi].numpy(),
                               "use_embeds": use[:, lo:hi].numpy(), "position_ids": np.arange(lo, hi)[None],
                               **past, "last_index": np.array([hi - lo - 1])})

    logits, hidden, key, value = run(0, 6, _empty_past(d.layers, d.kv_heads, d.head_dim))
    assert _report("llm prefill logits", logits, logits_all[:, 5]) < TOLERANCE
    assert _report("llm prefill hidden", hidden, hidden_all[:, :6]) < TOLERANCE
    logits, hidden, _, _ = run(6, 9, _with_past(key, value))
    assert _report("llm logits after the cache", logits, logits_all[:, 8]) < TOLERANCE
    assert _report("llm hidden after the cache", hidden, hidden_all[:, 6:9]) < TOLERANCE


def test_tts_matches_minicpm_tts(exported) -> None:
    ref, preset, paths = exported
    tts, t = ref.modules["tts"], preset.tts
    d = t.decoder
    sess = ort.InferenceSession(str(paths["tts"]))
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(0, t.num_text_tokens, (4,), generator=gen)
    llm_hidden = torch.randn(4, preset.llm.hidden, generator=gen)
    codes = torch.randint(0, t.num_audio_tokens - 1, (3,), generator=gen)
    with torch.no_grad():
        condition = tts.condition(text, llm_hidden)  # [1, 5, h]: 4 text conditions + audio_bos
        want = tts.logits(torch.cat([condition, tts.emb_code[0](codes)[None]], dim=1))

    n = len(text) + 1
    prefill = {"text_ids": np.append(text.numpy(), t.audio_bos_token_id)[None],
               "llm_hidden": np.concatenate([llm_hidden.numpy(), np.zeros((1, preset.llm.hidden), np.float32)])[None],
               "has_hidden": (np.arange(n) < n - 1)[None], "code_ids": np.zeros((1, n), np.int64),
               "is_code": np.zeros((1, n), bool), "position_ids": np.arange(n)[None],
               **_empty_past(d.layers, d.kv_heads, d.head_dim), "last_index": np.array([n - 1])}
    logits, key, value = sess.run(None, prefill)
    assert _report("tts logits at audio_bos", logits, want[:, n - 1]) < TOLERANCE
    step = {"text_ids": np.zeros((1, 3), np.int64), "llm_hidden": np.zeros((1, 3, preset.llm.hidden), np.float32),
            "has_hidden": np.zeros((1, 3), bool), "code_ids": codes.numpy()[None], "is_code": np.ones((1, 3), bool),
            "position_ids": np.arange(n, n + 3)[None], **_with_past(key, value), "last_index": np.array([2])}
    logits, _, _ = sess.run(None, step)
    assert _report("tts logits after 3 codes", logits, want[:, n + 2]) < TOLERANCE


def reference_generate_chunk(tts: torch.nn.Module, past: torch.Tensor | None, condition: torch.Tensor,
                             max_new: int, min_new: int, eos: int, penalty: float = 1.05, window: int = 16
                             ) -> tuple[list[int], torch.Tensor]:
    """`MiniCPMTTS.generate_chunk` at temperature -> 0 (argmax), re-run over the whole turn so far:
    the condition at t = 0, then each sampled code fed back; the last sampled code is not returned."""
    seq = condition if past is None else torch.cat([past, condition], dim=1)
    new: list[int] = []
    for step in range(max_new):
        with torch.no_grad():
            logits = tts.logits(seq)[0, -1].clone()
        if step > 0:  # CustomRepetitionPenaltyLogitsProcessorRepeat over this chunk's codes
            recent = torch.tensor(new[-window:])
            alpha = penalty ** torch.bincount(recent, minlength=logits.shape[0]).float()
            logits = torch.where(logits < 0, logits * alpha, logits / alpha)
        if step < min_new:
            logits[eos] = -torch.inf
        token = int(torch.argmax(logits))
        new.append(token)
        if token == eos:
            break
        with torch.no_grad():
            seq = torch.cat([seq, tts.emb_code[0](torch.tensor([[token]]))], dim=1)
    returned = new[:-1]  # new_tokens[:, 0:t]
    fed = seq[:, : seq.shape[1] - (0 if new[-1] == eos else 1)]  # the cache holds what was fed
    return returned, fed


def test_tts_stage_decodes_chunks_as_generate_chunk(exported) -> None:
    """Two chunks of one turn through the TTS stage (greedy) give the reference's codes: 25 + 1 sampled,
    25 returned, the cache and positions carried into the next chunk's condition."""
    ref, preset, paths = exported
    tts, t = ref.modules["tts"], preset.tts
    stage = TtsStage(OnnxEngine(paths["tts"], threads=1), preset, 600.0)
    gen = torch.Generator().manual_seed(2)
    past = None
    for chunk in range(2):
        text = torch.randint(0, t.num_text_tokens, (3 + chunk,), generator=gen)
        hidden = torch.randn(len(text), preset.llm.hidden, generator=gen)
        with torch.no_grad():
            condition = tts.condition(text, hidden)
        min_new = 0 if chunk == 0 else 26  # EOS may come at once at a turn's start
        want, past = reference_generate_chunk(tts, past, condition, 26, min_new, t.num_audio_tokens - 1)
        request = TtsRequest(text_ids=text.numpy(), tts_hidden=hidden.numpy(), turn_start=chunk == 0,
                             n_tokens=25, temperature=0.0)
        got = stage.run([StageCall(request, 5, start=chunk == 0)])[0]
        assert got.speech_tokens.tolist() == want
        assert len(got.speech_tokens) == 25 and got.kv_length == past.shape[1]


def _demo_draws(tts: torch.nn.Module, condition: torch.Tensor, temperature: float, monkeypatch) -> torch.Tensor:
    """The distribution `MiniCPMTTS.generate_chunk` (the demo's own, run) draws a chunk's first code from, as its
    `torch.multinomial` is given it (modeling_minicpmo_unified.py:6815)."""
    seen: list[torch.Tensor] = []
    draw = torch.multinomial

    def recorded(scores: torch.Tensor, num_samples: int) -> torch.Tensor:
        seen.append(scores.detach().clone())
        return draw(scores, num_samples)

    monkeypatch.setattr(torch, "multinomial", recorded)
    with torch.no_grad():
        tts.generate_chunk(inputs_embeds=condition, temperature=torch.tensor([temperature]), repetition_penalty=1.05,
                           eos_token=torch.tensor([tts.config.num_audio_tokens - 1]), max_new_token=1,
                           min_new_tokens=1, past_key_values=None, text_start_pos=0)
    monkeypatch.undo()
    [scores] = seen
    return scores[0].double()


def _our_draws(stage: TtsStage, request: TtsRequest, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    """The distribution our stage draws the same code from (what `sampling.sample` is given, through
    `sampling.distribution`) as a vector over the codes, and the logits it was given (temperature, penalty and the
    EOS mask applied)."""
    import minicpmo_triton.stages.tts as tts_stage
    from minicpmo_triton.rules.sampling import distribution

    seen: list[tuple[np.ndarray, object]] = []
    draw = tts_stage.sample

    def recorded(logits: np.ndarray, params, rng) -> int:
        seen.append((logits.copy(), params))
        return draw(logits, params, rng)

    monkeypatch.setattr(tts_stage, "sample", recorded)
    stage.run([StageCall(request, 9, start=True, end=True)])
    monkeypatch.undo()
    logits, params = seen[0]
    ids, probs = distribution(logits, params)
    out = np.zeros(len(logits))
    out[ids] = probs
    return out, logits


def test_tts_draws_as_generate_chunk_does(exported, monkeypatch) -> None:
    """MiniCPM-o's own `generate_chunk` builds top-k 20 / top-p 0.7 warpers (`gen_logits`) and never applies them
    (modeling_minicpmo_unified.py:6711, 6788-6822): each code is drawn from softmax(logits / T) after the
    repetition penalty and the EOS mask alone. The demo's `MiniCPMTTS` and `_convert_results_to_tts_input` run on
    the checkpoint's tensors; the distribution its multinomial is given for a chunk's first code equals the one our
    stage draws from, on the host (ONNX) and on the device (the paged TTS's sampler, its rules from the stage)."""
    from types import SimpleNamespace

    from minicpmo_triton.engine.sampler import candidates, value_ordered
    from minicpmo_triton.rules.sampling import kept_k
    from minicpmo_triton.stages.tts import tts_rules, with_tts_sampling

    from .reference_demo import demo_module
    from .reference_model import demo_tts

    ref, preset, paths = exported
    tts = demo_tts(ref.config, ref.tensors)
    gen = torch.Generator().manual_seed(4)
    text = torch.randint(0, preset.tts.num_text_tokens, (5,), generator=gen)
    hidden = torch.randn(len(text), preset.llm.hidden, generator=gen)
    demo = SimpleNamespace(model=SimpleNamespace(tts=tts), device="cpu")
    with torch.no_grad():
        condition = demo_module("modeling_minicpmo_unified").DuplexCapability._convert_results_to_tts_input(
            demo, [[int(t), h[None, None]] for t, h in zip(text, hidden, strict=True)])
    want = _demo_draws(tts, condition, 0.8, monkeypatch).numpy()

    request = TtsRequest(text_ids=text.numpy(), tts_hidden=hidden.numpy(), n_tokens=25, temperature=0.8)
    stage = TtsStage(OnnxEngine(paths["tts"], threads=1), preset, 600.0)
    got, logits = _our_draws(stage, request, monkeypatch)
    # the device engine's draw (engine/tts.py's TtsHead: its k and top-p per row from the stage's rules)
    rules, vocab = tts_rules(preset), len(logits)
    ids, probs = value_ordered(torch.from_numpy(logits)[None].double(),
                               torch.tensor([kept_k(rules.top_k, vocab)]),
                               candidates(rules.top_k, vocab), torch.tensor([rules.top_p], dtype=torch.float64))
    device = np.zeros(len(logits))
    device[ids[0].numpy()] = probs[0].numpy()
    print(f"first code: {np.count_nonzero(want)} codes drawable (ours {np.count_nonzero(got)}), max |p - reference| "
          f"host {np.abs(got - want).max():.3g}, device {np.abs(device - want).max():.3g}")
    assert np.count_nonzero(want) > 1000  # the whole vocabulary (EOS masked mid-turn), not 20 codes
    assert np.abs(got - want).max() < 1e-6 and np.abs(device - want).max() < 1e-6

    # top-k / top-p stay as settings: vllm-omni's 20 / 0.7 keep at most 20 codes
    opted, _ = _our_draws(TtsStage(OnnxEngine(paths["tts"], threads=1), with_tts_sampling(preset, 20, 0.7), 600.0),
                          request, monkeypatch)
    assert 0 < np.count_nonzero(opted) <= 20

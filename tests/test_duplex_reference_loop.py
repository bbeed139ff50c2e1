"""The duplex loop against MiniCPM-o 4.5's own: the reference's `DuplexCapability` and `StreamDecoder` run.

tests/reference_code/MiniCPMO45/ is OpenBMB/MiniCPM-o-Demo's code as published (README there). Its
`DuplexCapability.prepare`, `streaming_prefill`, `streaming_generate` and `finalize_unit`
(modeling_minicpmo_unified.py:4452-5310) and `StreamDecoder` (utils.py:1168-2200) run unchanged, on
transformers' Qwen3ForCausalLM from the small checkpoint tests/reference_checkpoint.py writes; ours is the LLM
stage on that checkpoint's exported ONNX. What is not the reference's own, and why:

- the audio: both sides get the same embeddings per chunk; the reference's processor and
  `get_audio_embedding_streaming` are stand-ins that hand them over. This file holds the decode loop's rules over
  many chunks and window modes cheaply; the whole path with real speech through the demo's own streaming audio
  encoding, the TTS, the voice and video frames is tests/test_duplex_reference_omni.py;
- what transformers 5 took away that the demo's code calls (DynamicCache's `key_cache` / `value_cache` and 4's
  `crop`, the config's `rope_theta`) is given back in tests/reference_model.py, which says where each is called;
- `generate_audio=False`: the TTS condition (token ids and LLM hidden states per chunk) is compared here.

Greedy, 48 chunks: forced listens (the first three, one the caller forces while the model speaks and one at chunk
33), speaking turns, <|turn_eos|>, the 28-character cut (shown: the token drawn that would reach 28 characters
is neither decided nor in the KV cache); after every chunk the decided tokens, the TTS condition, is_listen,
end_of_turn (a listen's too: False, as the reference's result), the KV length as the step leaves it (before the
unit is closed: what the demo's worker reports) and after the unit is closed must be equal. The sliding window:
`off`, `basic` (watermarks small enough to slide several times) and `context` (24 chunks holding at most 6 units
and 24 tokens of previous text, so units that spoke, units that listened and the previous text's left cut all
slide; the previous text equal after every chunk too).
"""

from __future__ import annotations

import copy
import queue
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from export.checkpoint import load_checkpoint, read_config
from export.config import preset_from_config
from export.onnx_export import export_onnx
from export.presets import MINICPMO45_TOKENS, minicpmo45
from export.stages import build_modules, stage_graphs
from minicpmo_triton.engine.exported import OnnxEngine
from minicpmo_triton.media.tokenizer import HuggingFaceTokenizer
from minicpmo_triton.rules.duplex_rules import forbidden_token_mask, stream_decode
from minicpmo_triton.rules.duplex_window import WINDOW_MODES, WindowConfig
from minicpmo_triton.rules.sampling import SamplingParams
from minicpmo_triton.stage_io import LlmRequest
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.llm import LlmStage
from minicpmo_triton.stages.llm_inflight import InflightLlm
from minicpmo_triton.stages.pool_kv import llm_kv

from .reference_checkpoint import write_checkpoint
from .reference_demo import demo_module
from .reference_model import demo_duplex

# .ci/run's `-m reference` step (minutes of the reference's own loop: the main command stays under 6 minutes); its
# device-engine cases run there too, not in the `engines` step
pytestmark = pytest.mark.reference

CHUNKS = 48
AUDIO_TOKENS = 10  # per 1 s chunk
# the caller forces a listen (force_listen_override) at the first chunk from 20 on where the model speaks (its turn
# open: <|turn_eos|> is fed before the listen), and at 33 whatever it does
MID_TURN_FROM, OVERRIDE = 20, 33
PREFIX = "<|im_start|>system\nStreaming Duplex Conversation! You are a helpful assistant.\n<|audio_start|>"
SUFFIX = "<|audio_end|><|im_end|>"
LOUDER = {MINICPMO45_TOKENS.turn_eos: 3.0, MINICPMO45_TOKENS.listen: 3.0, MINICPMO45_TOKENS.chunk_eos: 2.5}
HIGH, LOW = 400, 300  # the basic window's watermarks, small enough to slide several times in 48 chunks
UNITS, PREVIOUS = 6, 24  # the context window's units held and previous tokens kept, small for the same reason
CONTEXT_CHUNKS = 24  # enough for the context window (its slides begin at the 7th unit)
LONG = set(range(8, 16))  # chunks with a 40-token budget, so the 28-character cut comes before it
# the chunks' embeddings, the reference's decisions, the chunks whose listen was forced
Trace = tuple[list[torch.Tensor], list[dict[str, Any]], set[int]]
SETTINGS = {"temperature": 0.0, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "length_penalty": 1.1}


def _reference_modules() -> types.ModuleType:
    return demo_module("modeling_minicpmo_unified")


class _Features:
    def __init__(self, embeds: torch.Tensor) -> None:
        self.embeds = embeds
        self.audio_features = torch.zeros(1, 80, 100)

    def to(self, device: Any) -> _Features:
        return self


class _Processor:
    """The reference processor's streaming audio calls, handing over the chunk's prepared embeddings."""

    def __init__(self, tokenizer: Any, embeds: list[torch.Tensor]) -> None:
        self.tokenizer = tokenizer
        self._embeds = embeds
        self._streaming_mel_processor = types.SimpleNamespace(get_config=lambda: {"effective_first_chunk_ms": 1035})

    def get_streaming_chunk_size(self) -> int:
        return 16_000

    def process_audio_streaming(self, audio: np.ndarray, reset: bool, return_batch_feature: bool) -> _Features:
        return _Features(self._embeds.pop(0))


def reference_duplex(llm: torch.nn.Module, tokenizer: Any, embeds: list[torch.Tensor], tts: Any = None,
                     **kwargs: Any) -> Any:
    """`DuplexCapability` over the reference LLM, its audio path handing over the given embeddings."""
    model = types.SimpleNamespace(
        processor=_Processor(tokenizer, embeds), llm=llm, tts=tts,
        config=types.SimpleNamespace(audio_chunk_length=1.0), init_streaming_processor=lambda: None,
        get_audio_embedding_streaming=lambda features, **_: [[features.embeds]])
    llm.config.rope_theta = llm.config.rope_parameters["rope_theta"]  # transformers 4's name (reference_model.py)
    return demo_duplex(model, generate_audio=tts is not None, force_listen_count=3, **kwargs)


def _louder_controls(llm: torch.nn.Module) -> None:
    """Random weights seldom say the control tokens: their output rows scaled up, so the script holds
    <|turn_eos|>, <|listen|> and first-draw <|chunk_eos|> decisions of the model's own."""
    with torch.no_grad():
        for token, scale in LOUDER.items():
            llm.lm_head.weight[token] *= scale


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ref = write_checkpoint(tmp_path_factory.mktemp("reference_ckpt"), edit_llm=_louder_controls)
    preset = preset_from_config(minicpmo45(), read_config(ref.folder))
    modules = build_modules(preset, seed=99)
    load_checkpoint(ref.folder, modules, preset)
    out = tmp_path_factory.mktemp("onnx")
    [graph] = [g for g in stage_graphs(preset, modules) if g.name == "llm"]
    export_onnx(graph, out / "llm" / "model.onnx")
    unified = _reference_modules()
    from MiniCPMO45.tokenization_minicpmo_fast import MiniCPMOTokenizerFast

    return {"ref": ref, "preset": preset, "onnx": out / "llm" / "model.onnx", "unified": unified,
            "llm_weights": modules["llm"].state_dict(),
            "tokenizer": MiniCPMOTokenizerFast.from_pretrained(str(ref.folder))}


@pytest.fixture(scope="module")
def reference_trace(checkpoint: dict[str, Any]) -> Callable[[str], Trace]:
    """The reference loop's chunks, run once per window mode: every engine is held to the same trace."""
    traces: dict[str, Trace] = {}

    def trace(window: str) -> Trace:
        if window not in traces:
            embeds = chunk_embeds(CONTEXT_CHUNKS if window == "context" else CHUNKS, checkpoint["preset"].llm.hidden)
            traces[window] = embeds, *run_reference(checkpoint, embeds, window)
        return traces[window]

    return trace


def chunk_embeds(n: int, hidden: int, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(AUDIO_TOKENS, hidden, generator=gen) * 0.5 for _ in range(n)]


def run_reference(checkpoint: dict[str, Any], embeds: list[torch.Tensor], window: str
                  ) -> tuple[list[dict[str, Any]], set[int]]:
    """Each chunk as the reference decides it: `decided` (its total_ids), `drawn` (what StreamDecoder.decode returned,
    a token the 28-character cut rejected included), the result's is_listen / end_of_turn, the TTS condition,
    `kv_live` (the cache's length after streaming_generate, before finalize_unit: what the demo's worker reports as
    kv_cache_length, worker.py:1641-1643) and `kv` (after finalize_unit), the window's slides and previous text."""
    cap = reference_duplex(checkpoint["ref"].modules["llm"], checkpoint["tokenizer"],
                           list(embeds), sliding_window_mode=window, basic_window_high_tokens=HIGH,
                           basic_window_low_tokens=LOW, context_max_units=UNITS, context_previous_max_tokens=PREVIOUS)
    cap.prepare(prefix_system_prompt=PREFIX, suffix_system_prompt=SUFFIX)
    drawn: list[int] = []
    decode = cap.decoder.decode

    def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
        token = decode(*args, **kwargs)
        drawn.append(int(token))
        return token

    cap.decoder.decode = recorded
    out, overrides = [], set()
    for i in range(len(embeds)):
        kv_before = cap.decoder.get_cache_length()
        assert cap.streaming_prefill(audio_waveform=np.zeros(16_000, np.float32))["success"]
        if i == OVERRIDE or (i >= MID_TURN_FROM and not cap.current_turn_ended and not overrides):
            overrides.add(i)
        start = len(cap.total_ids)
        drawn.clear()
        res = cap.streaming_generate(decode_mode="greedy", force_listen_override=i in overrides,
                                     max_new_speak_tokens_per_chunk=40 if i in LONG else 20,
                                     text_repetition_penalty=1.05,
                                     length_penalty=1.1)
        condition = [] if res["is_listen"] else cap.total_hidden[-1]
        kv_live = cap.decoder.get_cache_length()
        cap.finalize_unit()
        out.append({"decided": cap.total_ids[start:-1], "drawn": list(drawn), "is_listen": res["is_listen"],
                    "end_of_turn": res["end_of_turn"], "tts_ids": [int(c[0]) for c in condition],
                    "tts_hidden": np.stack([c[1][0, 0].numpy() for c in condition]) if condition else None,
                    "kv_live": kv_live, "kv": cap.decoder.get_cache_length(),
                    "grew": cap.decoder.get_cache_length() - kv_before,
                    "slides": cap.decoder._sliding_event_count, "previous": list(cap.decoder._previous_token_ids)})
    return out, overrides


def run_ours(checkpoint: dict[str, Any], embeds: list[torch.Tensor], window: str, overrides: set[int],
             engine: str = "onnx") -> list[dict[str, Any]]:
    """The LLM stage on the host path (ONNX, host KV caches) or on the engine core (KV pool, decode rules and
    sampling on the device, iterations overlapped), called as a batch (`paged`) or through the in-flight loop the
    Triton model runs (`inflight`: each call queued, answered when its row is done)."""
    preset = checkpoint["preset"]
    tokenizer = HuggingFaceTokenizer(checkpoint["ref"].folder, set(vars(preset.tokens).values()))
    llm = OnnxEngine(checkpoint["onnx"], threads=1) if engine == "onnx" else \
        llm_kv(checkpoint["llm_weights"], preset, tokenizer, pool_tokens=4096, attention="gather")
    stage = LlmStage(llm, preset, tokenizer, 600.0)
    loop = InflightLlm(stage, 600.0) if engine == "inflight" else None
    try:
        return _drive(checkpoint, stage, loop, embeds, window, overrides)
    finally:
        if loop is not None:
            loop.close()


def _ask(stage: LlmStage, loop: InflightLlm | None, call: StageCall[LlmRequest]) -> Any:
    if loop is None:
        return stage.run([call])[0]
    answer: queue.Queue[Any] = queue.Queue()
    loop.submit(call, answer.put)
    return answer.get(timeout=120)


def _drive(checkpoint: dict[str, Any], stage: LlmStage, loop: InflightLlm | None, embeds: list[torch.Tensor],
           window: str, overrides: set[int]) -> list[dict[str, Any]]:
    preset, tok = checkpoint["preset"], checkpoint["tokenizer"]
    tk = preset.tokens
    system = tok.encode(PREFIX, add_special_tokens=False) + tok.encode(SUFFIX, add_special_tokens=False)
    out = []
    for i, e in enumerate(embeds):
        ids = ([*system] if i == 0 else []) + [tk.unit] + [tk.audio_placeholder] * AUDIO_TOKENS
        request = LlmRequest(input_ids=np.asarray(ids, np.int64), embeds=e.numpy().astype(np.float32),
                             force_listen=i < 3 or i in overrides, max_new_tokens=40 if i in LONG else 20,
                             window_mode=WINDOW_MODES.index(window), window_high=HIGH, window_low=LOW,
                             window_units=UNITS, window_previous=PREVIOUS, **SETTINGS)
        res = _ask(stage, loop, StageCall(request, 1, start=i == 0))
        assert not isinstance(res, Exception), res
        session = stage.store.get(1)
        pending = session.pending
        # the reference closes the unit and slides at once; the stage does both as the next step starts:
        # what that will leave, from a copy of the session's ledger
        ledger = copy.deepcopy(session.units)
        closed = res.kv_length + len(pending)
        ledger.close(closed)
        slides = ledger.plan(closed, WindowConfig(window, HIGH, LOW, UNITS, PREVIOUS, stage.marker))
        closed -= sum(s.drop - len(s.insert) for s in slides)
        decided = [int(t) for t in res.generated]
        if pending[:-1] and pending[-2] in (tk.chunk_eos,) and (not decided or decided[-1] != tk.chunk_eos):
            decided.append(tk.chunk_eos)  # the budget's or the cut's <|chunk_eos|>, deferred as the reference's
        if len(pending) == 3:
            decided.insert(0, tk.turn_eos)  # a forced listen's <|turn_eos|>, fed before the listen
        out.append({"decided": decided, "is_listen": res.is_listen, "end_of_turn": res.end_of_turn,
                    "turn_closed": res.turn_closed, "tts_ids": [int(t) for t in res.text_ids],
                    "tts_hidden": res.tts_hidden if len(res.text_ids) else None, "kv_live": res.kv_cache_length,
                    "kv": closed, "slides": ledger.events, "previous": ledger.previous})
    return out


# the device engine's two paths on the CPU: a `.ci/run` step of their own (engines), today's ONNX in the main command
@pytest.mark.parametrize("engine", ["onnx", pytest.param("paged", marks=pytest.mark.engines),
                                    pytest.param("inflight", marks=pytest.mark.engines)])
@pytest.mark.parametrize("window", ["off", "basic", "context"])
def test_the_duplex_loop_decides_as_minicpm_o_s_own(checkpoint: dict[str, Any], reference_trace: Callable[[str], Trace],
                                                   window: str, engine: str) -> None:
    embeds, want, overrides = reference_trace(window)
    got = run_ours(checkpoint, embeds, window, overrides, engine)
    tk = checkpoint["preset"].tokens
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        print(i, "listen" if w["is_listen"] else "speak", w["decided"], w["kv"], len(w["previous"]))
        for key in ("decided", "is_listen", "end_of_turn", "tts_ids", "kv_live", "kv", "slides", "previous"):
            assert g[key] == w[key], f"chunk {i}: {key} {g[key]} != reference {w[key]}"
        if w["tts_hidden"] is not None:
            np.testing.assert_allclose(g["tts_hidden"], w["tts_hidden"], atol=2e-3, err_msg=f"chunk {i}")
        # a forced listen that closed the model's turn: <|turn_eos|> fed before <|listen|> (MU:5003-5011)
        assert g["turn_closed"] == (i in overrides and w["decided"][:1] == [tk.turn_eos]), f"chunk {i}"
    if window == "context":
        # units that spoke and units that listened have slid out, and the previous text has been cut on the left
        marker = len(checkpoint["tokenizer"].encode("\n\nprevious: ", add_special_tokens=False))
        assert want[-1]["slides"] >= CONTEXT_CHUNKS - UNITS - 1 and len(want[-1]["previous"]) == marker + PREVIOUS
        # what a dropped unit's text leaves out: the reference's own set of special ids (utils.py:1181-1213)
        ours = HuggingFaceTokenizer(checkpoint["ref"].folder, set(vars(tk).values())).special_ids()
        assert ours == checkpoint["unified"].StreamDecoder(None, checkpoint["tokenizer"])._all_special_ids
        return
    # the script holds what the loop's rules decide on: a <|turn_eos|> the model said with the chunk going on,
    # <|listen|> the model chose, a <|chunk_eos|> at once (the first draw), a listen forced while the model spoke,
    # and the 28-character cut
    listened = [w for i, w in enumerate(want) if w["is_listen"] and i >= 3 and i not in overrides]
    assert any(tk.turn_eos in w["decided"][:-2] for w in want), "a <|turn_eos|> with the chunk going on"
    assert listened and any(w["decided"] == [tk.chunk_eos] for w in want)
    assert any(want[i]["decided"] == [tk.turn_eos, tk.listen] for i in overrides), "a forced listen mid-turn"
    assert any(w["is_listen"] and tk.turn_eos in w["decided"] and not w["end_of_turn"] for w in want), \
        "a listen after <|turn_eos|>: end_of_turn False, as the reference's result"
    cut = [i for i, w in enumerate(want) if _cut(w, checkpoint["tokenizer"], tk, window)]
    assert cut, "a chunk cut at 28 characters"
    if window == "basic":
        assert want[-1]["slides"] >= 2 and max(w["kv"] for w in want) <= HIGH + 60


def _cut(w: dict[str, Any], tok: Any, tk: Any, window: str) -> bool:
    """The chunk ended at the 28-character cut (modeling_minicpmo_unified.py:5068-5082): the last token drawn would
    have brought the chunk's text to 28 characters, and it is neither decided (a <|chunk_eos|> in its place) nor in
    the KV cache (the unit's length is its <unit>, audio, decided tokens and </unit>: with the window off, what
    the cache grew by)."""
    drawn, decided = w["drawn"], w["decided"]  # the same but for a mid-turn <|listen|> fed as <|tts_bos|>
    if not drawn or len(drawn) != len(decided) or decided[-1] != tk.chunk_eos:
        return False
    last = drawn[-1]
    if last in (tk.listen, tk.chunk_eos, tk.chunk_tts_eos):
        return False
    before = len(tok.decode(w["tts_ids"], skip_special_tokens=True))
    return before < 28 <= len(tok.decode([*w["tts_ids"], last], skip_special_tokens=True)) and (
        window != "off" or w["grew"] == 1 + AUDIO_TOKENS + len(w["decided"]) + 1)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for the test: a draw's ops over one vocabulary row (softmax, multinomial, sort) run
    about twice as fast on one thread as on two (measured), more so beside other work on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_sampled_draws_follow_the_reference_distribution(checkpoint: dict[str, Any]) -> None:
    """Sampling: the reference draws with torch's generator, the stage with numpy's, so the draws cannot be
    aligned one for one; the distributions must agree. `StreamDecoder.decode` itself (utils.py:2087) draws
    1000 times and `stream_decode` 10000 times from the same logits and history (the first draw's
    <|chunk_eos|>, the penalties, T / top-k / top-p in play): the total variation distance between the two
    histograms stays under 0.08 (two samples of one distribution at these sizes: about 0.05, as two of 2000
    each; without the first draw the <|chunk_eos|> share alone, about 0.2, would move it). The reference's
    draw costs ~10 ms over the 151k-token vocabulary, ours ~0.1 ms: ours draws the more."""
    preset, tk, n, n_ours = checkpoint["preset"], checkpoint["preset"].tokens, 1000, 10_000
    vocab = preset.llm.vocab
    gen = torch.Generator().manual_seed(3)
    logits = torch.full((1, vocab), -12.0)
    words = torch.randperm(200, generator=gen)[:30] + 32  # byte tokens the tokenizer names
    logits[0, words] = torch.randn(30, generator=gen) + 2.0
    logits[0, [tk.chunk_eos, tk.turn_eos, tk.listen, tk.speak]] = torch.tensor([5.0, 2.5, 1.5, 2.2])
    history = [int(t) for t in words[:8]] + [tk.speak]
    settings = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}

    cap = reference_duplex(checkpoint["ref"].modules["llm"], checkpoint["tokenizer"], [])
    torch.manual_seed(11)
    want = np.zeros(vocab)
    for _ in range(n):
        cap.decoder.generated_tokens = list(history)
        want[int(cap.decoder.decode(logits.clone(), mode="sampling", text_repetition_penalty=1.05,
                                    text_repetition_window_size=512, length_penalty=1.1, **settings))] += 1

    tokenizer = HuggingFaceTokenizer(checkpoint["ref"].folder, set(vars(tk).values()))
    forbidden = forbidden_token_mask(vocab, tk, tokenizer.bad_ids(vocab))
    params = SamplingParams(repetition_penalty=1.05, repetition_window=512, **settings)
    rng = np.random.default_rng(11)
    got = np.zeros(vocab)
    raw = logits[0].numpy()
    for _ in range(n_ours):
        got[stream_decode(raw, forbidden, list(history), params, 1.1, tk, rng)] += 1
    got *= n / n_ours  # on the reference's scale
    tv = 0.5 * np.abs(got - want).sum() / n
    print(f"\n<|chunk_eos|> {got[tk.chunk_eos] / n:.3f} (reference {want[tk.chunk_eos] / n:.3f}); "
          f"<|turn_eos|> {got[tk.turn_eos] / n:.3f} ({want[tk.turn_eos] / n:.3f}); "
          f"distinct tokens {np.count_nonzero(got)} ({np.count_nonzero(want)}); total variation {tv:.3f}")
    assert np.count_nonzero(want) > 5 and want[tk.chunk_eos] > 0.1 * n
    assert tv < 0.08


class _SpeechScript:
    """The reference's `model.tts` for its duplex loop with audio: `generate_chunk` gives the n-th voiced chunk the
    n-th of SPEECH's token lists (the TTS's own decode is held to `generate_chunk` in test_reference_parity.py),
    and its `audio_tokenizer.stream` (token2wav) records the chunks it is given, each with its `last_chunk`."""

    def __init__(self, speech: list[list[int]]) -> None:
        self.speech = iter(speech)
        self.config = types.SimpleNamespace(num_audio_tokens=6562)
        self.emb_text = types.SimpleNamespace(weight=torch.zeros(1))
        self.audio_bos_token_id = 0
        self.streamed: list[tuple[list[int], bool]] = []
        self.audio_tokenizer = types.SimpleNamespace(flow=types.SimpleNamespace(pre_lookahead_len=3),
                                                     set_stream_cache=lambda path: ({}, {}), stream=self.stream)

    def generate_chunk(self, **_: Any) -> tuple[torch.Tensor, None]:
        return torch.tensor(next(self.speech))[None, :, None], None

    def stream(self, tokens: list[int], prompt_wav: Any = None, last_chunk: bool = False) -> bytes:
        self.streamed.append((list(tokens), last_chunk))
        return bytes(960)


VOICE_CHUNKS = 30


def test_a_forced_listen_mid_turn_restarts_token2wav_as_the_reference(checkpoint: dict[str, Any]) -> None:
    """The demo restarts token2wav when the caller forces a listen while the model speaks (its buffered speech
    tokens dropped, 3 silence tokens again: modeling_minicpmo_unified.py:5003-5011, 4406-4410) and keeps the
    TTS's turn. Same LLM, same speech tokens per voiced chunk: token2wav is given the same chunks, chunk for
    chunk, by the reference's `_generate_waveform_from_tokens` (:5449-5507) and by our stage driven as the
    pipeline drives it (`VoiceTurn`)."""
    from export.presets import tiny
    from minicpmo_triton.rules.voice_turn import VoiceTurn
    from minicpmo_triton.stage_io import Token2WavRequest
    from minicpmo_triton.stages.token2wav import Token2WavStage

    from .conftest import MODEL_REPOSITORY, ensure_exported

    embeds = chunk_embeds(VOICE_CHUNKS, checkpoint["preset"].llm.hidden)
    gen = np.random.default_rng(4)
    speech = [[int(t) for t in gen.integers(0, 4000, 25)] for _ in range(VOICE_CHUNKS)]
    tts = _SpeechScript(speech)
    cap = reference_duplex(checkpoint["ref"].modules["llm"], checkpoint["tokenizer"],
                           list(embeds), tts=tts)
    cap._convert_results_to_tts_input = lambda hidden: torch.zeros(1, len(hidden) + 1, 1)
    cap.prepare(prefix_system_prompt=PREFIX, suffix_system_prompt=SUFFIX, prompt_wav_path="voice.wav")
    want, closed = [], []
    for i in range(VOICE_CHUNKS):
        assert cap.streaming_prefill(audio_waveform=np.zeros(16_000, np.float32))["success"]
        before = len(tts.streamed)
        if not closed and i >= 8 and not cap.current_turn_ended:  # the caller forces a listen as the model speaks
            closed.append(i)
        cap.streaming_generate(decode_mode="greedy", force_listen_override=i in closed,
                               max_new_speak_tokens_per_chunk=40 if i in LONG else 20,
                               text_repetition_penalty=1.05, length_penalty=1.1)
        cap.finalize_unit()
        want.append(tts.streamed[before:])
    assert closed and any(want[closed[0] + 1:]), "a forced listen while the model speaks, then speech"

    ensure_exported()
    stage = Token2WavStage.load(MODEL_REPOSITORY / "token2wav" / "1", tiny(), 600.0)
    got: list[list[tuple[list[int], bool]]] = []
    real_chunk = stage.streamer.chunk

    def chunk(rows: list[Any]) -> list[np.ndarray]:
        got[-1].extend((list(t), last) for _, t, last in rows)
        return real_chunk(rows)

    stage.streamer.chunk = chunk  # type: ignore[method-assign]
    turn, voiced = VoiceTurn(), iter(speech)
    for r in run_ours(checkpoint, embeds, "off", overrides=set(closed)):
        got.append([])
        if r["is_listen"]:
            turn.listened(r["turn_closed"])
            continue
        _, restart = turn.starts()
        [out] = stage.run([StageCall(Token2WavRequest(speech_tokens=np.asarray(next(voiced), np.int64),
                                                      turn_start=restart, finalize=r["end_of_turn"]), 1,
                                     start=stage.store.get_or_none(1) is None)])
        assert not isinstance(out, Exception), out
        turn.voiced(r["end_of_turn"])
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"chunk {i}: token2wav given {g}, the reference's {w}"
    # what the restart changes: after it the first chunk opens with 3 silence tokens, not the tokens left over
    after = next(w for w in want[closed[0] + 1:] if w)
    assert after[0][0][:3] == [4218] * 3

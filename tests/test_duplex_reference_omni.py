"""What a caller hears and sees, against MiniCPM-o 4.5's own code run: a duplex call of real speech and video frames,
every chunk through the demo's own audio encoding, vision, duplex loop, TTS and token2wav, and through ours.

The reference (OpenBMB/MiniCPM-o-Demo @28b60cf, vendored under tests/reference_code/; "MU" is
MiniCPMO45/modeling_minicpmo_unified.py) is the demo's `MiniCPMO` holding every tensor of a small checkpoint
(tests/reference_model.py, tests/reference_checkpoint.py) in its `DuplexCapability` with `generate_audio=True`, in
the demo's omni mode (a frame with each 1 s chunk, as its omni page sends them):
- `prepare` with the system prompt, its voice reference (`ref_audio`, through `get_audio_embedding`) and the TTS's
  voice (`prompt_wav_path`);
- each chunk `streaming_prefill(audio_waveform=..., frame_list=[frame], max_slice_nums=...)` (MU:4543): the
  streaming mel processor and `get_audio_embedding_streaming` (the Whisper KV cache across chunks), the frame's
  slices through `process_image` and `get_vision_embedding` behind `<image>` / `<slice>`;
- `streaming_generate` (MU:4958) greedy, then `MiniCPMTTS.generate_chunk` and `_generate_waveform_from_tokens` on
  minicpmo-utils 1.0.7's own `Token2wav` (its `stream`, `set_stream_cache`, causal vocoder), then `finalize_unit`.
Ours is the same checkpoint exported by `python -m export --preset minicpm-o-4.5 --checkpoint` (minicpmo-utils
1.0.7's token2wav layout), run by the pipeline the `duplex` model runs (`DuplexPipeline` over `InProcessStages`):
on the ONNX engines (the streaming Whisper graph), and on the paged ones (the LLM and its streaming Whisper in KV
pools, the TTS in its pool, codes and tokens chosen by the device samplers) on the CPU, over the checkpoint's
tensors in fp32 as our loader reads them (the export's paged weights are bf16, for a GPU).

Per chunk, equal: the unit's prefill (its tokens, each image's and slice's placeholders, the audio's), the decision,
the decided tokens, the TTS condition's ids, end_of_turn, the KV cache's length as the step leaves it (our
`kv_cache_length` metric), the speech codes of every spoken chunk; within 1e-4: the audio and vision embeddings fed
and the waveform (the reference's is 16-bit PCM: ours is compared at the same 16 bits, to 1 step).

Where the reference is not run as it is, and why:
- the TTS draws by `torch.multinomial` only (no greedy mode): it runs at a temperature of 1e-7, where its draw is
  the argmax (our TTS at temperature 0, greedy);
- `Token2wav.__init__` and `_prepare_prompt` need CUDA, torchaudio (no build for torch 2.13) and the real S3
  tokenizer: the object is built on the CPU by tests/test_token2wav_1_0_7.py's `official_token2wav`, and its voice
  prompt for `prompt_wav_path` is the features our token2wav computed from that same file (held to the official
  functions in tests/test_voice_features.py); its flow's noise table and its causal vocoder's sine table are drawn
  unseeded when built: ours are given to it;
- transformers 5's API changes the demo's code still calls are given back in tests/reference_model.py.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from export.checkpoint import TOKEN2WAV_ASSETS, load_checkpoint
from export.presets import MINICPMO45_TOKENS
from export.stages import build_modules
from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import DuplexPipeline, StepEvent, StepInput
from minicpmo_triton.stages.token2wav import DEFAULT_VOICE_WAV
from minicpmo_triton.stages.voice_prompt import default_ref_audio

from .conftest import REPO
from .helpers import OTHER_TEXT, SPEAKING_TEXT
from .reference_checkpoint import SMALL_CONFIG, to_1_0_7_layout, write_checkpoint
from .reference_model import demo_duplex, demo_model, demo_sized
from .test_token2wav_1_0_7 import official_token2wav

pytestmark = pytest.mark.reference  # .ci/run's step of its own

CHUNKS = 30
SYSTEM = "Streaming Duplex Conversation! You are a helpful assistant."
HIGH, LOW = 700, 400  # the basic window's watermarks: the call slides them, units (HD ones ~230 tokens) apart
HD = {6: 4, 19: 4}  # chunks whose frame is sliced for HD (max_slice_nums); the rest 1, the demo's default
FORCE_FROM = 8  # the caller forces a listen at the first chunk from here on where the model speaks
TTS_GREEDY = 1e-7  # the reference TTS's temperature: its multinomial draws the argmax
LOUDER = {MINICPMO45_TOKENS.turn_eos: 1.25, MINICPMO45_TOKENS.listen: 4.0, MINICPMO45_TOKENS.chunk_eos: 2.5}
SEED = 1
PAGED = ("audio_encoder", "llm", "tts")  # the stages whose paged engines the paged run uses
TK = MINICPMO45_TOKENS
TERMINATORS = (TK.listen, TK.chunk_eos, TK.chunk_tts_eos)


def _louder_controls(llm: torch.nn.Module) -> None:
    """Random weights seldom say the control tokens: their output rows scaled up, so the call holds listens, spoken
    turns and turns ended by the model (tests/test_duplex_reference_loop.py does the same)."""
    with torch.no_grad():
        for token, scale in LOUDER.items():
            llm.lm_head.weight[token] *= scale


@dataclass
class Chunk:
    """What one side made of one 1 s chunk."""

    unit: list[Any]  # the unit's prefill: token ids, ("img", n) / ("audio", n) for n embeddings
    decided: list[int]  # as the reference's total_ids: a forced listen's <|turn_eos|>, a deferred <|chunk_eos|>
    is_listen: bool
    end_of_turn: bool
    tts_ids: list[int]
    kv: int  # the LLM's cache as the step leaves it
    audio: np.ndarray  # the chunk's audio embeddings
    vision: np.ndarray | None  # its frame's slices' embeddings [slices * 64, H]
    codes: list[int] | None = None  # the TTS's speech codes (a spoken chunk)
    wave: np.ndarray | None = None  # what token2wav made of them (None: nothing yet)
    margin: float = float("inf")  # the reference: its closest call, the smallest gap between its two top logits


# ---- the call ----

def speech_chunks(speech: Callable[[str], np.ndarray]) -> list[np.ndarray]:
    """30 s: espeak-ng speech, pauses the model may answer in, more speech, silence."""
    gap = lambda s: np.zeros(int(s * 16_000), np.float32)  # noqa: E731 (a one-line helper)
    call = np.concatenate([gap(0.4), speech(SPEAKING_TEXT), gap(4.0), speech(OTHER_TEXT), gap(30.0)])
    return [call[i * 16_000:(i + 1) * 16_000].astype(np.float32) for i in range(CHUNKS)]


def frames() -> list[bytes]:
    """A JPEG per chunk, as the demo's omni page sends them: a scene that moves (640x480; 1280x480 for HD)."""
    out = []
    for i in range(CHUNKS):
        width = 1280 if i in HD else 640
        y, x = np.mgrid[0:480, 0:width]
        rng = np.random.default_rng(i)
        img = np.stack([(x + 9 * i) % 256, (y * 2 + 5 * i) % 256, (x + y) // 3 % 256], -1).astype(np.float32)
        img += rng.normal(0, 12, img.shape)
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def unit_schema(ids: list[int], placeholder: int) -> list[Any]:
    """A unit's prefill as the reference records it (`prefill_schema_tokens`, MU:4644-4900): its token ids, each run
    of embeddings as ("img", n) after <image> / <slice>, else ("audio", n)."""
    out: list[Any] = []
    for t in ids:
        if t != placeholder:
            out.append(t)
        elif out and isinstance(out[-1], tuple):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append(("img" if out and out[-1] in (TK.image, TK.slice) else "audio", 1))
    return out


# ---- the reference ----

@dataclass
class _Taps:
    """Each output of the reference's own calls, as it makes them (the calls themselves run as they are)."""

    audio: list[torch.Tensor] = field(default_factory=list)
    vision: list[torch.Tensor] = field(default_factory=list)
    codes: list[list[int]] = field(default_factory=list)
    waves: list[np.ndarray | None] = field(default_factory=list)

    def tap(self, owner: Any, name: str, keep: Callable[[Any], None]) -> None:
        call = getattr(owner, name)

        def tapped(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            keep(out)
            return out

        setattr(owner, name, tapped)


@dataclass
class Trace:
    chunks: list[Chunk]
    overrides: set[int]  # the chunks whose listen the caller forced
    slides: int  # the window's slides


def run_reference(model: Any, prompt_wav: str, ref_audio: np.ndarray, audio: list[np.ndarray],
                  jpegs: list[bytes]) -> Trace:
    cap = demo_duplex(model, generate_audio=True, force_listen_count=3, tts_temperature=TTS_GREEDY,
                      sliding_window_mode="basic", basic_window_high_tokens=HIGH, basic_window_low_tokens=LOW)
    cap.prepare(prefix_system_prompt=f"<|im_start|>system\n{SYSTEM}\n<|audio_start|>",
                suffix_system_prompt="<|audio_end|><|im_end|>", ref_audio=ref_audio, prompt_wav_path=prompt_wav)
    taps = _Taps()
    taps.tap(model, "get_audio_embedding_streaming",
             lambda out: taps.audio.append(torch.cat([t for g in out for t in g])))
    taps.tap(model, "get_vision_embedding", lambda out: taps.vision.append(out[0]))
    taps.tap(model.tts, "generate_chunk", lambda out: taps.codes.append(out[0].reshape(-1).tolist()))
    taps.tap(cap, "_generate_waveform_from_tokens", taps.waves.append)
    gaps: list[float] = []
    decode = cap.decoder.decode

    def decoded(*args: Any, **kwargs: Any) -> torch.Tensor:
        """StreamDecoder.decode, each of its greedy argmaxes (the first draw's, the second's) noted with its gap."""
        argmax = torch.argmax

        def noted(x: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            top = torch.topk(x.reshape(-1).float(), 2).values
            gaps.append(float(top[0] - top[1]))
            return argmax(x, *a, **k)

        torch.argmax = noted  # type: ignore[assignment]
        try:
            return decode(*args, **kwargs)
        finally:
            torch.argmax = argmax

    cap.decoder.decode = decoded
    out, overrides = [], set()
    for i in range(CHUNKS):
        n_vision, n_codes = len(taps.vision), len(taps.codes)
        frame = Image.open(io.BytesIO(jpegs[i]))
        prefilled = cap.streaming_prefill(audio_waveform=audio[i], frame_list=[frame], max_slice_nums=HD.get(i, 1))
        assert prefilled["success"], prefilled
        if i >= FORCE_FROM and not overrides and not cap.current_turn_ended:
            overrides.add(i)
        start = len(cap.total_ids)
        gaps.clear()
        res = cap.streaming_generate(prompt_wav_path=prompt_wav, decode_mode="greedy",
                                     force_listen_override=i in overrides)
        kv = cap.decoder.get_cache_length()  # what the demo's worker reports (worker.py:1641-1643)
        condition = [] if res["is_listen"] else cap.total_hidden[-1]
        spoke = len(taps.codes) > n_codes
        cap.finalize_unit()
        vision = taps.vision[n_vision:]
        out.append(Chunk(
            unit=cap.prefill_schema_tokens[-1], decided=cap.total_ids[start:-1], is_listen=res["is_listen"],
            end_of_turn=res["end_of_turn"], tts_ids=[int(c[0]) for c in condition], kv=kv,
            audio=taps.audio[-1].numpy(), vision=vision[0].reshape(-1, vision[0].shape[-1]).numpy() if vision else None,
            codes=taps.codes[-1] if spoke else None, wave=taps.waves[-1] if spoke else None,
            margin=min(gaps, default=float("inf"))))
    return Trace(out, overrides, cap.decoder._sliding_event_count)


# ---- ours ----

class Recorder:
    """Our stages as the pipeline calls them, each step's calls' requests and answers kept (the calls themselves as
    they are; the session's END calls, which are no step's, are not kept)."""

    def __init__(self, stages: InProcessStages) -> None:
        self.stages = stages
        self.llm_calls: list[tuple[Any, Any]] = []
        self.vision: list[Any] = []
        self.tts_results: list[Any] = []
        self.waves: list[Any] = []
        self.audio: list[np.ndarray] = []
        encoder = stages.llm_stage.encoder
        assert encoder is not None
        launch = encoder.launch  # what the LLM stage calls, on its engine thread or its preparation thread

        def encoded(items: list[Any]) -> tuple[list[Any], Any]:
            out, handoff = launch(items)
            self.audio += out
            return out, handoff

        encoder.launch = encoded  # type: ignore[method-assign]

    async def audio_encoder(self, request: Any) -> Any:
        return await self.stages.audio_encoder(request)

    async def vision_encoder(self, request: Any) -> Any:
        result = await self.stages.vision_encoder(request)
        self.vision.append(result)
        return result

    async def llm(self, call: Any, ready: Any = None) -> Any:
        result = await self.stages.llm(call, ready)
        if not call.end:
            self.llm_calls.append((call.request, result))
        return result

    async def tts(self, call: Any) -> Any:
        result = await self.stages.tts(call)
        if not call.end:
            self.tts_results.append(result)
        return result

    async def token2wav(self, call: Any) -> Any:
        result = await self.stages.token2wav(call)
        if not call.end:
            self.waves.append(result)
        return result


def paged(stages: InProcessStages, weights: dict[str, dict[str, torch.Tensor]]) -> None:
    """The paged engines on the CPU in place of the ONNX ones: the LLM and its streaming Whisper, the TTS; over the
    checkpoint's tensors as our loader reads them, in fp32 (the export writes them in bf16, what a GPU runs: that
    rounding alone moves this random model's logits by ~1e-2, past its closest calls)."""
    from minicpmo_triton.engine.whisper import PagedWhisper
    from minicpmo_triton.stages.audio_encoder import AudioStreamEncoder
    from minicpmo_triton.stages.llm import LlmStage
    from minicpmo_triton.stages.pool_kv import llm_kv, tts_kv
    from minicpmo_triton.stages.tts import TURN_TOKENS, TtsStage

    preset = stages.preset
    whisper = PagedWhisper.build(weights["audio_encoder"], preset.audio, pool_tokens=4096)
    llm = llm_kv(weights["llm"], preset, stages.tokenizer, pool_tokens=8192)
    stages.llm_stage = LlmStage(llm, preset, stages.tokenizer, 600.0,
                                AudioStreamEncoder(whisper, preset.audio, preset.samples_per_audio_token))
    stages.tts_stage = TtsStage(tts_kv(weights["tts"], preset, pool_tokens=4096, max_tokens=TURN_TOKENS), preset, 600.0)


def run_ours(stages: InProcessStages, audio: list[np.ndarray], jpegs: list[bytes], overrides: set[int]) -> list[Chunk]:
    return asyncio.run(_call(stages, audio, jpegs, overrides))


async def _call(stages: InProcessStages, audio: list[np.ndarray], jpegs: list[bytes], overrides: set[int]
                ) -> list[Chunk]:
    rec = Recorder(stages)
    pipeline = DuplexPipeline(rec, stages.preset, stages.tokenizer, 600.0,
                              default_ref_audio=default_ref_audio(stages.repository / "duplex" / "1"))
    options = DuplexOptions.from_config({"do_sample": False, "system_prompt": SYSTEM, "sliding_window_mode": "basic",
                                         "basic_window_high_tokens": HIGH, "basic_window_low_tokens": LOW})
    out = []
    for i in range(CHUNKS):
        events: list[StepEvent] = []

        async def emit(ev: StepEvent, events: list[StepEvent] = events) -> None:
            events.append(ev)

        calls, n_vision, n_tts, n_audio = len(rec.llm_calls), len(rec.vision), len(rec.tts_results), len(rec.audio)
        inp = StepInput(audio=audio[i], frames=[jpegs[i]], max_slice_nums=[HD.get(i, 1)], force_listen=i in overrides,
                        options=options if i == 0 else None)
        await pipeline.step(7, i == 0, i == CHUNKS - 1, inp, emit)
        step = rec.llm_calls[calls:]
        ids = [int(t) for req, _ in step for t in req.input_ids]
        _, res = step[-1]
        unit = ids[len(ids) - ids[::-1].index(TK.unit) - 1:]
        decided = ([TK.turn_eos] if res.turn_closed else []) + [int(t) for t in res.generated]
        if not decided or decided[-1] not in TERMINATORS:
            decided.append(TK.chunk_eos)  # the budget's or the cut's <|chunk_eos|>, deferred as the reference's
        vision = rec.vision[n_vision:]
        spoke = len(rec.tts_results) > n_tts
        wave = rec.waves[-1].waveform if spoke else None
        out.append(Chunk(
            unit=unit_schema(unit, TK.audio_placeholder), decided=decided, is_listen=res.is_listen,
            end_of_turn=res.end_of_turn, tts_ids=[int(t) for t in res.text_ids],
            kv=int(events[0].metrics.kv_cache_length), audio=rec.audio[n_audio],
            vision=vision[0].embeds.reshape(-1, vision[0].embeds.shape[-1]) if vision else None,
            codes=rec.tts_results[-1].speech_tokens.tolist() if spoke else None,
            wave=wave if wave is not None and len(wave) else None))
    return out


# ---- fixtures ----

@pytest.fixture(scope="module")
def call(tmp_path_factory: pytest.TempPathFactory, speech: Callable[[str], np.ndarray]) -> dict[str, Any]:
    """The checkpoint (token2wav in minicpmo-utils 1.0.7's layout), exported into a model repository of its own;
    the call's audio and frames."""
    config = demo_sized(SMALL_CONFIG)
    ref = write_checkpoint(tmp_path_factory.mktemp("omni_ckpt"), config=config, seed=SEED, edit_llm=_louder_controls)
    to_1_0_7_layout(ref.folder / TOKEN2WAV_ASSETS)
    repo = tmp_path_factory.mktemp("omni") / "model_repository"
    done = subprocess.run([sys.executable, "-m", "export", "--preset", "minicpm-o-4.5", "--checkpoint", str(ref.folder),
                           "--model-repository", str(repo)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    preset = load_stage_config(repo / "llm" / "1")
    modules = build_modules(preset, seed=SEED)
    load_checkpoint(ref.folder, modules, preset, require=PAGED)
    weights = {stage: {k: v.detach().float() for k, v in modules[stage].state_dict().items()} for stage in PAGED}
    return {"ref": ref, "config": config, "repo": repo, "audio": speech_chunks(speech), "jpegs": frames(),
            "weights": weights}


@pytest.fixture(scope="module")
def no_compile() -> Iterator[None]:
    """The official flow's conformer `forward_chunk` is torch.compile'd: eager here, as on the CPU it must be; and
    torch on one thread (both sides' small forwards run faster so, beside other work on a 2-core machine)."""
    saved, threads = torch._dynamo.config.disable, torch.get_num_threads()
    torch._dynamo.config.disable = True
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch._dynamo.config.disable = saved
        torch.set_num_threads(threads)


def ours_stages(call: dict[str, Any]) -> InProcessStages:
    return InProcessStages(call["repo"])


@pytest.fixture(scope="module")
def reference(call: dict[str, Any], no_compile: None) -> Trace:
    ref, repo = call["ref"], call["repo"]
    model = demo_model(call["config"], ref.tensors, ref.folder)
    stages = ours_stages(call)  # our token2wav's voice prompt and tables, which the reference is given
    prompt_wav = str(repo / "token2wav" / "1" / DEFAULT_VOICE_WAV)
    voice = stages.t2w_stage.prompts.default
    streamer = stages.t2w_stage.streamer
    official = official_token2wav(ref.folder / TOKEN2WAV_ASSETS, {prompt_wav: (voice.tokens, voice.mel,
                                                                             voice.embedding)}, streamer.rand_noise)
    prepared = official.cache[prompt_wav]
    official._prepare_prompt = lambda wav: prepared  # what it would compute from the wav (module docstring)
    model.tts.audio_tokenizer = official
    call["sine_waves"] = official.hift.m_source.l_sin_gen.sine_waves
    ref_audio = default_ref_audio(repo / "duplex" / "1")
    assert ref_audio is not None
    return run_reference(model, prompt_wav, ref_audio, call["audio"], call["jpegs"])


@pytest.mark.parametrize("engine", ["onnx", "paged"])
def test_a_call_is_heard_seen_and_voiced_as_minicpm_o_s_own_code_does(call: dict[str, Any], reference: Trace,
                                                                       engine: str, no_compile: None) -> None:
    want, overrides = reference.chunks, reference.overrides
    stages = ours_stages(call)
    assert stages.t2w_stage.streamer.causal is not None
    stages.t2w_stage.streamer.causal.model.m_source.l_sin_gen.sine_waves = call["sine_waves"]
    if engine == "paged":
        paged(stages, call["weights"])
    got = run_ours(stages, call["audio"], call["jpegs"], overrides)
    worst = {"audio": 0.0, "vision": 0.0, "wave": 0.0}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        print(i, "listen" if w.is_listen else "speak", w.decided, w.kv, w.codes is not None, f"margin {w.margin:.2g}")
        for key in ("unit", "decided", "is_listen", "end_of_turn", "tts_ids", "kv", "codes"):
            assert getattr(g, key) == getattr(w, key), f"chunk {i}: {key} {getattr(g, key)} != {getattr(w, key)}"
        worst["audio"] = max(worst["audio"], float(np.abs(g.audio - w.audio).max()))
        assert g.vision is not None and w.vision is not None and g.vision.shape == w.vision.shape, f"chunk {i}"
        worst["vision"] = max(worst["vision"], float(np.abs(g.vision - w.vision).max()))
        assert (g.wave is None) == (w.wave is None), f"chunk {i}: waveform {g.wave is None} != {w.wave is None}"
        if w.wave is not None and g.wave is not None:
            assert len(g.wave) == len(w.wave), f"chunk {i}"
            worst["wave"] = max(worst["wave"], float(np.abs(g.wave - w.wave).max()))
            pcm = (np.clip(g.wave, -1, 1) * 32767.0).astype("<i2").astype(np.float32) / 32768.0
            assert np.abs(pcm - w.wave).max() <= 1 / 32768, f"chunk {i}: the waveform"  # one 16-bit step at most
    print(f"max |ours - reference| over {CHUNKS} chunks: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
    assert worst["audio"] < 1e-4 and worst["vision"] < 1e-4 and worst["wave"] < 1e-4
    # the call holds what the rules decide on: listens, spoken chunks with their codes and voice, a listen forced
    # while the model spoke (token2wav restarts, the TTS's turn goes on), a turn the model ended in voice, HD
    # frames, the window's slides
    spoken = [w for w in want if w.codes is not None]
    assert len(spoken) >= 3 and any(w.wave is not None and np.abs(w.wave).max() > 0.01 for w in spoken)
    assert any(w.is_listen for w in want[3:]) and any(w.end_of_turn for w in spoken)
    assert any(want[i].decided[:1] == [TK.turn_eos] for i in overrides), "a listen forced while the model spoke"
    assert sum(1 for w in want if TK.slice in w.unit) == len(HD)
    assert reference.slides > 0

"""token2wav's device path: the flow and the vocoder as torch modules on the instance's device (its GPU; the CPU
runs the same code where a test forces it), every session's caches in slots (token2wav_ring), the chunks of all
sessions given to `chunk` run as one batch per length.

The face is `Token2WavStreamer`'s (the ONNX host path's): `setup` a voice, `new_stream`, `restart` a turn,
`chunk` rows of (stream, tokens, last), plus `close` (a session gone: END, eviction, a new voice) and `forget`
(a voice the prompt cache let go). The numbers are the host path's: same modules, same trims, same noise
(tests/test_token2wav_ring.py holds the two, and through the host path the official streaming, within 1e-5).

Ownership: a turn takes a slot of the pool at its first chunk and gives it back in `_end_turn`, the one place a
turn's slot is released (its last chunk, a restart, `close`); a voice holds a slot of the same pool from its setup
until no stream and not the prompt cache refer to it (`_unref`, the one place a voice's slot is released). What
crosses between host and device each chunk is counted (`traffic`: tokens and the rows' key lists up, HiFT's noise
up, the audio down; the caches never move), flat in a turn's length. On the CPU (a test's placement) HiFT runs its
ONNX graph (`OnnxVocoder`) and torch the threads set at load; on CUDA a whole chunk's CFM replays a CUDA graph
(token2wav_graphs).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.exported import Engine, load_engine
from ..engine.traffic import Traffic
from ..errors import Code, StepError
from ..model_config import Token2WavDims
from ..vocoder.causal_vocoder import FOLDER as CAUSAL_FOLDER
from ..vocoder.causal_vocoder import CausalSlots, CausalTurn, CausalVocoder
from ..vocoder.hift import VocoderChunk, build_hift, fold_weight_norm
from ..vocoder.official_stepaudio2 import load_flow_yaml
from .token2wav_flow import RingFlow
from .token2wav_graphs import CfmGraphs
from .token2wav_ring import (
    UP_RATE,
    ChunkPlan,
    FlowPool,
    FlowRows,
    Slots,
    TurnFrames,
    commit_chunk,
    padded,
    plan_chunk,
    row_keys,
)
from .token2wav_stream import SAMPLES_PER_FRAME, TABLES_FILE, draw_noise, project_speaker, prompt_tokens

# in model_repository/token2wav/1: flow.yaml, flow.pt, hift.pt (the export writes them). Not "torch": the stub puts
# the version folder on sys.path, where a folder of that name imports as torch (a namespace) if torch is not installed
TORCH_FOLDER = "device_modules"
SLOTS = 64  # the setting t2w_slots' default: turns speaking at once per instance
FIRST_SLOTS = 4  # allocated at load; the pool doubles as turns need more, up to the setting


def cache_dtype(choice: str, device: str) -> torch.dtype:
    """The setting token2wav_cache_dtype: auto (bf16 on a GPU, fp32 on the CPU), bf16 or fp32."""
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if choice == "auto":
        return dtypes["fp32" if device == "cpu" else "bf16"]
    if choice not in dtypes:
        raise ValueError(f"token2wav_cache_dtype must be auto, bf16 or fp32, not {choice!r}")
    return dtypes[choice]


@dataclass(eq=False)
class DeviceVoice:
    """A voice prompt set up on the device: its frames live in `slot` of the streamer's pool."""

    spk: np.ndarray  # [80]: the CAM++ vector, projected
    frames: int  # mel frames of the prompt
    slot: int
    refs: int = 1  # the prompt cache's, and each stream's with this voice
    bytes_per_slot: int = 0

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot


@dataclass(eq=False)
class SlotStream:
    """One session's stream on the device path: tokens awaiting their lookahead, its turn's slot and its record."""

    prompt: DeviceVoice
    pending: list[int] = field(default_factory=list)
    slot: int | None = None  # its turn's slot, from its first chunk to its end
    frames: TurnFrames = field(default_factory=TurnFrames)
    mel_len: int = 0  # HiFT (1.0.5): mel frames carried (right-aligned in the slot's 8)
    source_len: int = 0  # HiFT: source samples carried (left-aligned)
    speech_len: int = 0  # HiFT: held tail samples, to cross-fade (left-aligned)
    first_chunk: bool = True
    causal: CausalTurn | None = None  # 1.0.7's causal vocoder: its turn's place (its histories in its slot)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    slot_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.slot_bytes if self.slot is not None else 0


class HiftSlots:
    """HiFT's (1.0.5) streaming caches of every slot: the last 8 mel frames, the source's last 3840 samples and the
    held tail that the next chunk cross-fades into."""

    def __init__(self, d: Token2WavDims, slots: int, device: torch.device) -> None:
        self.d, self.device = d, device
        self.mel = torch.zeros(slots, d.n_mels, d.mel_cache_frames, device=device)
        self.source = torch.zeros(slots, d.source_cache_samples, device=device)
        self.speech = torch.zeros(slots, d.source_cache_samples, device=device)

    def grow(self, slots: int) -> None:
        for name in ("mel", "source", "speech"):
            old = getattr(self, name)
            new = torch.zeros((slots, *old.shape[1:]), device=self.device)
            new[:old.shape[0]] = old
            setattr(self, name, new)

    @property
    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.mel, self.source, self.speech))


def load_flow_modules(folder: Path, d: Token2WavDims, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The official flow and HiFT from the export's copies (`folder`/torch: flow.yaml, flow.pt, hift.pt), eval, on
    `device`."""
    files = folder / TORCH_FOLDER
    if not (files / "flow.pt").exists():
        raise FileNotFoundError(f"{files / 'flow.pt'} is missing: run `python -m export` again (the device path "
                                "runs token2wav's torch modules)")
    flow = load_flow_yaml(files / "flow.yaml")
    flow.load_state_dict(torch.load(files / "flow.pt", map_location="cpu", weights_only=True), strict=True)
    state = torch.load(files / "hift.pt", map_location="cpu", weights_only=True)
    hift = build_hift(d)
    hift.load_state_dict({k.removeprefix("generator."): v for k, v in state.items()}, strict=True)
    return flow.eval().to(device), fold_weight_norm(hift).eval().to(device)


class OnnxVocoder:
    """HiFT's exported graph (vocoder.onnx, the host path's) behind `VocoderChunk`'s call: the device path on a
    CPU instance runs it, faster there than torch's convolutions; on a GPU the module runs itself."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self, mel: torch.Tensor, cache_source: torch.Tensor, cache_len: torch.Tensor, rand_ini: torch.Tensor,
                 sine_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feeds = {"mel": mel, "cache_source": cache_source, "cache_len": cache_len, "rand_ini": rand_ini,
                 "sine_noise": sine_noise}
        out = self.engine.run({k: np.ascontiguousarray(v.numpy()) for k, v in feeds.items()})
        return torch.from_numpy(out["speech"]), torch.from_numpy(out["source"])


class DeviceStreamer:
    def __init__(self, flow: torch.nn.Module, hift: torch.nn.Module | OnnxVocoder, tables: dict[str, np.ndarray],
                 d: Token2WavDims, device: str = "cpu", max_slots: int = SLOTS,
                 cache_dtype: torch.dtype = torch.float32, causal: CausalVocoder | None = None,
                 graphs: bool | None = None) -> None:
        """Takes `flow` and `hift` as its own; `hift` may be its ONNX graph on the CPU (`OnnxVocoder`). `graphs`:
        whole chunks' CFM through `CfmGraphs` (by default on CUDA, captured; on the CPU, their padded call)."""
        self.d, self.device = d, torch.device(device)
        self.ring = RingFlow(flow, d)
        self.vocoder: Any = hift if isinstance(hift, OnnxVocoder) else VocoderChunk(hift).to(self.device).eval()
        self.causal = None if causal is None else CausalSlots(causal, FIRST_SLOTS)
        self.max_slots = max_slots
        self.spk_weight, self.spk_bias = tables["spk_weight"], tables["spk_bias"]
        self.harmonics = int(tables["harmonics"])
        self.rand_noise = torch.from_numpy(np.ascontiguousarray(tables["rand_noise"])).to(self.device)  # [80, 30000]
        self.window = torch.from_numpy(np.hamming(2 * d.source_cache_samples)).to(self.device)  # float64, as the host
        t_span = np.linspace(0, 1, d.n_timesteps + 1, dtype=np.float32)
        self.t_span = (1 - np.cos(t_span * np.float32(0.5 * np.pi))).astype(np.float32)  # cosine schedule
        self.noise = lambda s, n: draw_noise(s, n, self.harmonics)  # tests put the reference's draws here
        chunk_frames = UP_RATE * (d.chunk_tokens + d.lookahead)
        self.pool = FlowPool(d, FIRST_SLOTS, d.cache_tail_frames + chunk_frames, self.device, cache_dtype)
        self.hift = HiftSlots(d, FIRST_SLOTS, self.device)
        self.slots = Slots(FIRST_SLOTS)  # voices' and turns' alike
        self.turns = 0  # slots held by turns (at most `max_slots`)
        self.graphs: CfmGraphs | None = None
        if graphs if graphs is not None else self.device.type == "cuda":
            self.graphs = CfmGraphs(self.ring, self.t_span, UP_RATE * d.chunk_tokens, self.device.type == "cuda")
            self.scratch = self._acquire()  # where the graphs' padding rows write: no turn's, no voice's
        self.chunk_frames = chunk_frames
        self.traffic = Traffic()
        self.lock = threading.RLock()  # the pools: one batch or one voice's setup at a time
        self.threads: int | None = None  # on the CPU: torch's threads in whichever thread runs the batches

    @classmethod
    def load(cls, folder: Path, d: Token2WavDims, device: str, max_slots: int = SLOTS,
             cache_dtype: torch.dtype = torch.float32, threads: int = 1) -> DeviceStreamer:
        """On the CPU (a test's, CI's placement): torch on `threads` threads, HiFT's ONNX graph."""
        flow, hift = load_flow_modules(folder, d, device)
        vocoder: torch.nn.Module | OnnxVocoder = hift
        if device == "cpu":
            vocoder = OnnxVocoder(load_engine(folder, threads, name="vocoder"))
        causal = CausalVocoder.load(folder / CAUSAL_FOLDER, device) if (folder / CAUSAL_FOLDER).is_dir() else None
        with np.load(folder / TABLES_FILE) as tables:
            streamer = cls(flow, vocoder, dict(tables), d, device, max_slots, cache_dtype, causal)
        streamer.threads = threads
        return streamer

    # ---- voices ----
    @torch.inference_mode()
    def setup(self, tokens: np.ndarray, mel: np.ndarray, embedding: np.ndarray) -> DeviceVoice:
        """setup_cache on the device: the prompt's frames computed into a voice slot, read there by every turn."""
        d = self.d
        tokens = prompt_tokens(tokens, mel, d, causal=self.causal is not None)
        frames = len(mel)
        self._own_threads()
        with self.lock:
            self._room(voice_frames=frames)
            slot = self._acquire()
            voice = DeviceVoice(project_speaker(self.spk_weight, self.spk_bias, embedding), frames, slot,
                                bytes_per_slot=self.pool.slot_bytes())
            plan = ChunkPlan(list(range(frames // UP_RATE)), list(range(frames)), list(range(frames)))
            rows = self._rows([row_keys(TurnFrames(), plan, slot, None, 0, self.pool.frames)], [slot])
            cond = self._up("inputs", mel.T[None].astype(np.float32))
            self._flow(rows, self._up("inputs", tokens[None]), [len(tokens)], [0], voice.spk[None], cond)
        return voice

    def forget(self, voice: Any) -> None:
        """The prompt cache let this voice go: its slot follows when no stream uses it."""
        with self.lock:
            self._unref(voice)

    def _unref(self, voice: DeviceVoice) -> None:
        voice.refs -= 1
        if voice.refs == 0:
            self.slots.release(voice.slot)

    # ---- streams ----
    def new_stream(self, prompt: Any, seed: int = 0) -> SlotStream:
        with self.lock:
            prompt.refs += 1
        return SlotStream(prompt, rng=np.random.default_rng(seed))

    def restart(self, stream: SlotStream) -> None:
        """A turn starts (and the previous one, if open, ends): its slot is taken at its first chunk."""
        d = self.d
        with self.lock:
            self._end_turn(stream)
        stream.pending = [d.silence_token] * d.turn_lead_silence
        stream.causal = None if self.causal is None else CausalTurn()

    def close(self, stream: Any) -> None:
        """The session is gone (END, eviction) or changed its voice: its turn's slot and its voice let go."""
        with self.lock:
            self._end_turn(stream)
            self._unref(stream.prompt)

    def _end_turn(self, stream: SlotStream) -> None:
        if stream.slot is not None:
            self.slots.release(stream.slot)
            self.turns -= 1
        stream.slot, stream.frames = None, TurnFrames()
        stream.mel_len = stream.source_len = stream.speech_len = 0
        stream.first_chunk = True

    def free_slots(self) -> int:
        """Turns that can start now (the pool may still grow to the setting's bound)."""
        return self.max_slots - self.turns

    def _start_turn(self, stream: SlotStream) -> None:
        if self.turns >= self.max_slots:
            raise StepError(Code.POOL_FULL, f"token2wav: {self.max_slots} turns are speaking (token2wav_slots)")
        stream.slot = self._acquire()
        self.turns += 1
        stream.slot_bytes = self.pool.slot_bytes() + (self.hift.slot_bytes if self.causal is None
                                                      else self.causal.slot_bytes)
        stream.frames = TurnFrames(est_prompt=np.arange(stream.prompt.frames))
        self.pool.copy_conv(stream.prompt.slot, stream.slot)
        if self.causal is not None:
            self.causal.reset(stream.slot)
            stream.causal = CausalTurn()

    # ---- the pool ----
    def _acquire(self) -> int:
        """A free slot, the pool doubled when there is none."""
        slot = self.slots.acquire()
        if slot is None:
            count = 2 * self.pool.slots
            self.pool.grow(count, self.pool.frames)
            self.hift.grow(count)
            if self.causal is not None:
                self.causal.grow(count)
            self.slots.grow(count)
            slot = self.slots.acquire()
            assert slot is not None
        return slot

    def _room(self, voice_frames: int) -> None:
        """Frames for a voice this long in every slot: a turn keeps its voice's frames' count of its own, or the
        last 100, whichever is more (the estimator's trim), and a chunk's."""
        self.pool.grow(self.pool.slots, max(voice_frames, self.d.cache_tail_frames) + self.chunk_frames)

    # ---- uploads ----
    def _up(self, kind: str, value: np.ndarray) -> torch.Tensor:
        value = np.ascontiguousarray(value)
        self.traffic.to_device[kind] += value.nbytes
        return torch.as_tensor(value).to(self.device, non_blocking=True)

    def _down(self, tensor: torch.Tensor) -> np.ndarray:
        self.traffic.to_host["outputs"] += tensor.numel() * tensor.element_size()
        return tensor.detach().cpu().numpy()

    def _rows(self, keys: list[dict[str, list[int]]], own: list[int]) -> FlowRows:
        """The rows' key lists, padded, up to the device."""
        up: dict[str, torch.Tensor] = {"own": self._up("inputs", np.asarray(own, np.int64))}
        for cache in ("tok", "mel", "est"):
            ids, valid = padded([k[f"{cache}_keys"] for k in keys])
            up[f"{cache}_keys"], up[f"{cache}_valid"] = self._up("inputs", ids), self._up("inputs", valid)
            up[f"{cache}_new"] = self._up("inputs", np.asarray([k[f"{cache}_new"] for k in keys], np.int64))
        return FlowRows(**up)

    # ---- one batched chunk per stream ----
    @torch.inference_mode()
    def chunk(self, rows: list[tuple[SlotStream, list[int], bool]]) -> list[np.ndarray]:
        """Each row: (stream, tokens with their lookahead, is the turn's last chunk) -> its new audio."""
        self._own_threads()
        with self.lock:
            return self._chunk(rows)

    def _own_threads(self) -> None:
        """On the CPU, torch's threads as set at load, in the calling thread (OpenMP's count is per thread: the
        engine thread's and the voice preparer's are not the loader's)."""
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def _chunk(self, rows: list[tuple[SlotStream, list[int], bool]]) -> list[np.ndarray]:
        d = self.d
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(rows)
        for stream, tokens, _ in rows:
            if tokens and stream.slot is None:
                self._start_turn(stream)
        groups: dict[int, list[int]] = defaultdict(list)  # rows by their tokens (with the last's lookahead pad)
        for i, (_, tokens, last) in enumerate(rows):
            if tokens:
                groups[len(tokens) + (d.lookahead if last else 0)].append(i)
        mels: dict[int, torch.Tensor] = {}
        for width, idx in groups.items():
            for i, mel in zip(idx, self._flow_rows([rows[i] for i in idx], width), strict=True):
                mels[i] = mel
        if self.causal is not None:  # 1.0.7: each turn's fresh mel through its causal vocoder stream, batched
            empty = torch.zeros(d.n_mels, 0, device=self.device)
            voiced = [(i, s.slot, s.causal) for i, (s, _, _) in enumerate(rows) if s.slot is not None and s.causal]
            audio = self.causal.stream([(slot, turn, mels.get(i, empty), rows[i][2]) for i, slot, turn in voiced])
            for (i, _, _), wav in zip(voiced, audio, strict=True):
                out[i] = wav
                self.traffic.to_host["outputs"] += wav.nbytes
        else:
            out = self._vocode(rows, mels)
        for stream, _, last in rows:
            if last:
                self._end_turn(stream)
        return out

    def _flow_rows(self, rows: list[tuple[SlotStream, list[int], bool]], width: int) -> list[torch.Tensor]:
        """Rows whose chunks are `width` tokens long (a last chunk padded with its lookahead): conformer and CFM,
        their caches read and written in their slots; returns each row's mel [80, frames] (on the device)."""
        d = self.d
        n_tokens = width - d.lookahead
        plans, keys, offsets, slots = [], [], [], []
        for stream, _, _ in rows:
            assert stream.slot is not None, "chunk() starts a turn before its first chunk"
            plan = plan_chunk(stream.frames, n_tokens, self.pool.frames)
            plans.append(plan)
            keys.append(row_keys(stream.frames, plan, stream.slot, stream.prompt.slot, stream.prompt.frames,
                                 self.pool.frames))
            offsets.append(len(stream.frames.est_prompt) + len(stream.frames.est))  # the CFM's noise offset
            slots.append(stream.slot)
        flow_rows = self._rows(keys, slots)
        tokens = np.asarray([t + [0] * (width - len(t)) for _, t, _ in rows], np.int64)
        spk = np.stack([s.prompt.spk for s, _, _ in rows])
        mel = self._flow(flow_rows, self._up("inputs", tokens), [len(t) for _, t, _ in rows], offsets, spk, None)
        for (stream, _, _), plan in zip(rows, plans, strict=True):
            stream.frames = commit_chunk(stream.frames, plan, stream.prompt.frames, d.cache_tail_frames)
        return list(mel)

    def _flow(self, rows: FlowRows, tokens: torch.Tensor, n_real: list[int], offsets: list[int], spk: np.ndarray,
              cond: torch.Tensor | None) -> torch.Tensor:
        """Conformer then the CFM for `rows`; their new conv caches written to their slots. -> mel [B, 80, n]."""
        dtype, pool = self.rand_noise.dtype, self.pool
        mu, new_cnn = self.ring.conformer(tokens, self._up("inputs", np.asarray(n_real, np.int64)), rows, pool)
        mu = mu.transpose(1, 2)  # [B, 80, n]
        b, _, n = mu.shape
        at = self._up("inputs", np.asarray(offsets, np.int64))[:, None] + torch.arange(n, device=self.device)
        x = self.rand_noise.index_select(1, at.flatten()).view(-1, b, n).transpose(0, 1)  # the CFM's noise table
        cond = torch.zeros_like(mu) if cond is None else cond
        if self.graphs is not None and self.graphs.fits(rows, n):
            mel, new_est_cnn = self.graphs.run(mu, x.to(dtype), self._up("inputs", spk), cond, rows, pool, self.scratch)
        else:
            mel, new_est_cnn = self.ring.cfm(mu, x.to(dtype), self._up("inputs", spk), cond, self.t_span, rows, pool)
        pool["cnn"][rows.own] = new_cnn.to(pool.dtype)
        cfg = torch.cat([2 * rows.own, 2 * rows.own + 1])
        pool["est_cnn"][:, :, cfg] = new_est_cnn.to(pool.dtype)
        return mel

    def _vocode(self, rows: list[tuple[SlotStream, list[int], bool]], mels: dict[int, torch.Tensor]
                ) -> list[np.ndarray]:
        """HiFT (1.0.5) on each row's carried mel + its chunk's, batched by shape; the cross-fade with the held
        tail and the carried caches on the device; each row's audio comes back."""
        d, ls = self.d, self.d.source_cache_samples
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(rows)
        groups: dict[tuple[int, int, int, int, bool, bool], list[int]] = defaultdict(list)
        for i, (stream, _, last) in enumerate(rows):
            if i in mels:
                key = (stream.mel_len, mels[i].shape[1], stream.source_len, stream.speech_len, last,
                       stream.first_chunk)
                groups[key].append(i)
            elif last and stream.slot is not None and stream.speech_len:  # nothing left to decode: the held tail
                out[i] = self._down(self.hift.speech[stream.slot, :stream.speech_len])
        for (carried, new, source_len, held, last, first), idx in groups.items():
            streams = [rows[i][0] for i in idx]
            slots = self._up("inputs", np.asarray([s.slot for s in streams], np.int64))
            frames = carried + new
            mel = torch.cat([self.hift.mel[slots][:, :, d.mel_cache_frames - carried:],
                             torch.stack([mels[i] for i in idx]).to(self.hift.mel.dtype)], dim=2)
            noise = [self.noise(s, frames * SAMPLES_PER_FRAME) for s in streams]
            speech, source = self.vocoder(mel, self.hift.source[slots][:, None],
                                          torch.full((len(idx),), source_len, dtype=torch.int64, device=self.device),
                                          self._up("inputs", np.stack([r for r, _ in noise])),
                                          self._up("inputs", np.stack([n for _, n in noise])))
            if held:  # cross-fade into the previous chunk's held tail (in float64, as the host path)
                fade = (speech[:, :held].double() * self.window[:held]
                        + self.hift.speech[slots][:, :held].double() * self.window[ls:ls + held])
                speech = torch.cat([fade.float(), speech[:, held:]], dim=1)
            keep = min(frames, d.mel_cache_frames)
            self.hift.mel[slots, :, d.mel_cache_frames - keep:] = mel[:, :, -keep:]
            tail = min(speech.shape[1], ls)
            self.hift.source[slots, :tail] = source[:, 0, -tail:]
            self.hift.speech[slots, :tail] = speech[:, -tail:]
            if not last:
                speech = speech[:, :-ls]
                if first:  # as the official stream: the first chunk keeps its length
                    speech = torch.cat([torch.zeros(len(idx), ls, device=self.device), speech], dim=1)
            audio = self._down(speech)
            for row, (i, stream) in enumerate(zip(idx, streams, strict=True)):
                out[i] = audio[row]
                stream.mel_len, stream.source_len, stream.speech_len = keep, tail, 0 if last else tail
                stream.first_chunk = False
        return out

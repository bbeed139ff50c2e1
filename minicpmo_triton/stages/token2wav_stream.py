"""Step-Audio2 token2wav streaming in numpy around three ONNX graphs, batched across sessions.

It streams as MiniCPM-o's Token2wav.stream does (stepaudio2 `setup_cache` / `inference_chunk` and the
original HiFT's 8-frame mel / 3840-sample source caches with a Hamming cross-fade):
- a voice prompt = S3 tokens + 3 silence tokens, its 24 kHz mel and its CAM++ vector; `setup` runs it through
  the conformer and the CFM once and keeps the caches (shared by every session with that voice);
- a chunk = up to 25 tokens + 3 lookahead (fewer when the stage flushes early; a turn's last chunk: what is
  left, padded) -> conformer -> mu ->
  n_timesteps Euler steps of the DiT estimator from the CFM's noise table (offset = cached frames) -> mel;
- attention caches keep the prompt + the last 100 mel frames (the conformer's token-rate layers half that);
- the vocoder runs on the previous chunk's last 8 mel frames + this chunk's, its source's first 3840 samples
  replaced by the previous tail, and the first 3840 samples cross-faded with the previous chunk's held tail.

minicpmo-utils 1.0.7's layout (`causal`, a `CausalVocoder`) streams as its Token2wav.stream does instead: the
prompt's setup is led into by its own first 3 tokens (not silence), and each chunk's fresh mel goes through the
causal HiFT's `BoundedVocoder` in torch, per session (its state in `Stream.vocoder`), no cross-fade.

Rows of many sessions run as one forward per graph: caches of different lengths are padded and masked;
chunks of different lengths go in separate forwards.

The voice prompt's frames of the attention caches are held once, by the prompt, and shared by every session with
that voice: a session's `Stream.flow` holds only its own frames, and a batch's cache input is built from the
prompt's frames and the session's in one copy (`_stack_joined`). The conformer's caches are `cat(cache, new)`:
the prompt's frames lead and the session's follow (`_own` drops the prompt's again). The estimator's are
`cat(new, cache)`, the newest chunk first: the session's frames lead and the prompt's frames that the trim has
kept end it (`FlowCache.est_prompt`: which, by index; all of them until the cache passes the prompt + 100 frames).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..engine.exported import Engine, load_engine
from ..model_config import Token2WavDims
from ..vocoder.causal_vocoder import FOLDER as CAUSAL_FOLDER
from ..vocoder.causal_vocoder import CausalVocoder, VocoderState

TABLES_FILE = "tables.npz"
GRAPHS = ("encoder", "estimator", "vocoder")
UP_RATE = 2  # mel frames per token
SAMPLES_PER_FRAME = 480  # 24 kHz / 50 Hz mel


@dataclass(eq=False)
class FlowCache:
    """One stream's flow caches: a voice prompt's after setup, or a session's own (its attention caches hold only
    the frames after its prompt's, which it shares by reference: `Stream.prompt.cache`)."""

    cnn: np.ndarray  # [C, 6]: pre-lookahead conv (2) + upsample conv (4)
    token_att: np.ndarray  # [L1, H, T1, 2*dk]: token-rate conformer layers
    mel_att: np.ndarray  # [L2, H, 2*T1, 2*dk]: mel-rate conformer layers
    est_cnn: np.ndarray  # [n_timesteps, depth, 2 (cond, uncond), 2*hidden, 2]
    est_att: np.ndarray  # [n_timesteps, depth, 2, H, Te, 2*head_dim], the newest chunk first
    # a session's: its est_att goes on with these frames of its prompt's est_att (indices on Te; read, not held)
    est_prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.cnn, self.token_att, self.mel_att, self.est_cnn, self.est_att))


@dataclass(frozen=True, eq=False)
class VoicePrompt:
    spk: np.ndarray  # [80]: the CAM++ vector, normalised and projected (spk_embed_affine_layer)
    frames: int  # mel frames of the prompt (the caches keep these)
    cache: FlowCache  # after setup: every turn starts from it

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes


@dataclass(eq=False)
class Stream:
    """One session's streaming state (flow caches, vocoder caches, tokens waiting for their lookahead)."""

    prompt: VoicePrompt
    flow: FlowCache
    pending: list[int] = field(default_factory=list)
    mel: np.ndarray = field(default_factory=lambda: np.zeros((80, 0), np.float32))  # last 8 mel frames
    source: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # last 3840 source samples
    speech: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # held tail, to cross-fade
    first_chunk: bool = True
    vocoder: VocoderState | None = None  # 1.0.7's causal vocoder state (its turn's), else the caches above
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    @property
    def nbytes(self) -> int:
        vocoder = 0 if self.vocoder is None else self.vocoder.nbytes
        return self.flow.nbytes + self.mel.nbytes + self.source.nbytes + self.speech.nbytes + vocoder


Noise = Callable[[Any, int], tuple[np.ndarray, np.ndarray]]  # (a stream with its `rng`, samples) -> the draws


def draw_noise(stream: Any, samples: int, harmonics: int) -> tuple[np.ndarray, np.ndarray]:
    """HiFT's source randomness: initial phases (none for the fundamental) and additive noise."""
    rand_ini = stream.rng.random(harmonics, dtype=np.float32)
    rand_ini[0] = 0.0
    return rand_ini, stream.rng.standard_normal((samples, harmonics), dtype=np.float32)


def prompt_tokens(tokens: np.ndarray, mel: np.ndarray, d: Token2WavDims, causal: bool) -> np.ndarray:
    """A voice prompt's tokens as its setup runs them: + 3 lookahead tokens, 3 silence tokens (1.0.5) or the
    prompt's own first 3 (1.0.7's `set_stream_cache`, token2wav.py:197-199); its mel must be 2 frames a token."""
    lead = tokens[:d.lookahead] if causal else np.full(d.lookahead, d.silence_token)
    out = np.concatenate([tokens.astype(np.int64), np.asarray(lead, np.int64)])
    if (len(out) - d.lookahead) * UP_RATE != len(mel):
        raise ValueError(f"a voice prompt of {len(out) - d.lookahead} tokens needs "
                         f"{(len(out) - d.lookahead) * UP_RATE} mel frames, got {len(mel)}")
    return out


def project_speaker(weight: np.ndarray, bias: np.ndarray, embedding: np.ndarray) -> np.ndarray:
    """The CAM++ vector, normalised and projected (flow.spk_embed_affine_layer): [192] -> [80]."""
    e = embedding.astype(np.float32)
    e = e / max(float(np.linalg.norm(e)), 1e-12)  # F.normalize
    return (weight @ e + bias).astype(np.float32)


def _stack_joined(rows: list[tuple[np.ndarray, ...]], axis: int, left: bool) -> np.ndarray:
    """Each row's parts (its own frames and its prompt's shared ones) joined on `axis`, stacked, zero-padded (left
    or right) to the longest: one copy, straight into the batch."""
    totals = [sum(p.shape[axis] for p in parts) for parts in rows]
    shape = list(rows[0][0].shape)
    shape[axis] = max(totals)
    out = np.zeros((len(rows), *shape), np.float32)
    for r, (parts, total) in enumerate(zip(rows, totals, strict=True)):
        at = shape[axis] - total if left else 0
        for part in parts:
            index: list[slice] = [slice(None)] * len(shape)
            index[axis] = slice(at, at + part.shape[axis])
            out[r][tuple(index)] = part
            at += part.shape[axis]
    return out


def _own(full: np.ndarray, axis: int, prefix: int, head: int, tail: int) -> np.ndarray:
    """A stream's own frames of a cache the graph gave back (`prefix` frames of it its prompt's): past the prefix,
    trimmed as `_trim(full, axis, head, tail)` trims the whole, in arrays of its own (no view keeps the batch's
    output, prompt frames and all, alive)."""
    own = np.take(full, np.arange(prefix, full.shape[axis]), axis)
    return _trim(own, axis, head - prefix, tail)


def est_keep(n_own: int, prompt: np.ndarray, head: int, tail: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference's estimator trim (MiniCPM-o's Token2wav.stream: `att[..., :frames]` + `att[..., -100:]` of
    the newest-first cache) on a session's layout: its own frames (`n_own`, newest chunk first) then its voice's
    frames still kept (`prompt`, indices). Keeps the first `head` and the last `tail` of the whole once it is
    longer: returns the own frames kept (layout indices) and the voice's frames kept (indices)."""
    total = n_own + len(prompt)
    if total <= head + tail:
        return np.arange(n_own), prompt
    keep = np.r_[0:head, total - tail:total]
    return keep[keep < n_own], prompt[keep[keep >= n_own] - n_own]


def _est_own(own: np.ndarray, prompt: np.ndarray, head: int, tail: int) -> tuple[np.ndarray, np.ndarray]:
    """A session's estimator cache, [.., own frames then its prompt's frames `prompt`, D], trimmed as `est_keep`
    says: the own frames it keeps (a copy, once trimmed) and the prompt's frames that still end it."""
    n = own.shape[4]
    kept, prompt_kept = est_keep(n, prompt, head, tail)
    return (own, prompt) if len(kept) == n and len(prompt_kept) == len(prompt) else (np.take(own, kept, 4),
                                                                                      prompt_kept)


def _frames(a: np.ndarray, axis: int, index: np.ndarray) -> np.ndarray:
    """`a`'s frames `index` on `axis`: `a` itself when that is all of them in order (read in place)."""
    if len(index) == a.shape[axis] and (index == np.arange(len(index))).all():
        return a
    return np.take(a, index, axis)


def _trim(a: np.ndarray, axis: int, head: int, tail: int) -> np.ndarray:
    """Keep the first `head` and the last `tail` frames on `axis` once there are more."""
    n = a.shape[axis]
    if n <= head + tail:
        return a
    idx = np.r_[0:head, n - tail:n]
    return np.take(a, idx, axis)


class Streamer(Protocol):
    """What the token2wav stage drives: this module's host path, or the device path (token2wav_device)."""

    d: Token2WavDims

    def setup(self, tokens: np.ndarray, mel: np.ndarray, embedding: np.ndarray) -> Any: ...
    def new_stream(self, prompt: Any, seed: int = 0) -> Any: ...
    def restart(self, stream: Any) -> None: ...
    def chunk(self, rows: list[tuple[Any, list[int], bool]]) -> list[np.ndarray]: ...
    def close(self, stream: Any) -> None: ...
    def forget(self, prompt: Any) -> None: ...


class Token2WavStreamer:
    def __init__(self, engines: dict[str, Engine], tables: dict[str, np.ndarray], d: Token2WavDims,
                 noise: Noise | None = None, causal: CausalVocoder | None = None) -> None:
        self.enc, self.est, self.voc = (engines[g] for g in GRAPHS)
        self.causal = causal  # 1.0.7's layout: its causal vocoder, run in torch, instead of the vocoder graph
        self.d = d
        self.rand_noise = tables["rand_noise"]  # [80, 30000]
        self.spk_weight, self.spk_bias = tables["spk_weight"], tables["spk_bias"]
        self.harmonics = int(tables["harmonics"])
        self.window = np.hamming(2 * d.source_cache_samples)  # float64, as torch.from_numpy gives
        self.noise: Noise = noise or (lambda s, n: draw_noise(s, n, self.harmonics))
        t_span = np.linspace(0, 1, d.n_timesteps + 1, dtype=np.float32)
        self.t_span = (1 - np.cos(t_span * np.float32(0.5 * np.pi))).astype(np.float32)  # cosine schedule

    @classmethod
    def load(cls, folder: Path, d: Token2WavDims, threads: int = 1) -> Token2WavStreamer:
        engines = {g: load_engine(folder, threads, name=g) for g in GRAPHS}
        causal = CausalVocoder.load(folder / CAUSAL_FOLDER) if (folder / CAUSAL_FOLDER).is_dir() else None
        with np.load(folder / TABLES_FILE) as tables:
            return cls(engines, dict(tables), d, causal=causal)

    # ---- voice prompts ----
    def setup(self, tokens: np.ndarray, mel: np.ndarray, embedding: np.ndarray) -> VoicePrompt:
        """setup_cache: the prompt's tokens + 3 lookahead tokens (`prompt_tokens`), its mel [2*len(tokens), 80]."""
        d = self.d
        tokens = prompt_tokens(tokens, mel, d, causal=self.causal is not None)
        empty = self._empty_cache()
        spk = project_speaker(self.spk_weight, self.spk_bias, embedding)
        prompt = VoicePrompt(spk, len(mel), empty)  # no prefix: the prompt's frames are its stream's own
        stream = Stream(prompt, empty)
        mu = self._conformer([(stream, tokens, len(tokens))])[0]
        self._cfm([(stream, mu, mel.T.astype(np.float32))])
        return VoicePrompt(spk, len(mel), stream.flow)

    def _empty_cache(self) -> FlowCache:
        d = self.d
        dk, hd = 2 * d.channels // d.heads, 2 * d.dit_head_dim
        def zeros(shape: tuple[int, ...]) -> np.ndarray:
            return np.zeros(shape, np.float32)

        return FlowCache(
            cnn=zeros((d.channels, 2 + 2 * UP_RATE)),
            token_att=zeros((d.num_blocks, d.heads, 0, dk)),
            mel_att=zeros((d.num_up_blocks, d.heads, 0, dk)),
            est_cnn=zeros((d.n_timesteps, d.dit_depth, 2, 2 * d.dit_hidden, 2)),
            est_att=zeros((d.n_timesteps, d.dit_depth, 2, d.dit_heads, 0, hd)))

    @staticmethod
    def _fresh(prompt: VoicePrompt) -> FlowCache:
        """A session's own flow caches at a turn's start: the prompt's conv caches (replaced, never written, so
        shared), no attention frames of its own."""
        c = prompt.cache
        return FlowCache(cnn=c.cnn, token_att=c.token_att[:, :, :0], mel_att=c.mel_att[:, :, :0], est_cnn=c.est_cnn,
                         est_att=c.est_att[:, :, :, :, :0], est_prompt=np.arange(c.est_att.shape[4]))

    def new_stream(self, prompt: VoicePrompt, seed: int = 0) -> Stream:
        return Stream(prompt, self._fresh(prompt), rng=np.random.default_rng(seed))

    def close(self, stream: Stream) -> None:
        """A session gone: its arrays are its own, freed with it."""

    def forget(self, prompt: VoicePrompt) -> None:
        """The prompt cache let a voice go: sessions with it keep it alive by reference."""

    def restart(self, stream: Stream) -> None:
        """A turn starts from the prompt's caches, its vocoder empty, after 3 silence tokens."""
        d = self.d
        stream.flow = self._fresh(stream.prompt)
        stream.pending = [d.silence_token] * d.turn_lead_silence
        stream.mel = np.zeros((d.n_mels, 0), np.float32)
        stream.source = np.zeros(0, np.float32)
        stream.speech = np.zeros(0, np.float32)
        stream.first_chunk = True
        stream.vocoder = None if self.causal is None else self.causal.new_state()

    # ---- one batched chunk per stream ----
    def chunk(self, rows: list[tuple[Stream, list[int], bool]]) -> list[np.ndarray]:
        """Each row: (stream, tokens with their lookahead, is the turn's last chunk) -> its new audio."""
        d = self.d
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(rows)
        flow_rows = [(i, s, t, last) for i, (s, t, last) in enumerate(rows) if t]
        mels: dict[int, np.ndarray] = {}
        if flow_rows:
            # a last chunk is padded with the conformer's lookahead (zeroed frames past n_real)
            items = [(s, np.asarray(t + [0] * (d.lookahead if last else 0), np.int64), len(t))
                     for _, s, t, last in flow_rows]
            mus = self._conformer(items)
            feats = self._cfm([(s, mu, np.zeros(mu.shape, np.float32))
                               for (_, s, _, _), mu in zip(flow_rows, mus, strict=True)])
            mels = {i: f for (i, _, _, _), f in zip(flow_rows, feats, strict=True)}  # the chunk's mel
        if self.causal is not None:  # per session, in torch; an empty last chunk flushes its delay
            empty = np.zeros((d.n_mels, 0), np.float32)
            for i, (stream, _, last) in enumerate(rows):
                assert stream.vocoder is not None, "restart() sets a turn's vocoder state"
                out[i] = self.causal.stream(stream.vocoder, mels.get(i, empty), last)
            return out
        voc = []
        for i, (stream, _, last) in enumerate(rows):
            if i in mels:
                voc.append((i, stream, mels[i], last))
            elif last:  # nothing left to decode: the held tail is the end of the turn
                out[i] = stream.speech
                stream.speech = np.zeros(0, np.float32)
        for i, speech in self._vocode([(s, m, last) for _, s, m, last in voc]).items():
            out[voc[i][0]] = speech
        return out

    def _conformer(self, items: list[tuple[Stream, np.ndarray, int]]) -> list[np.ndarray]:
        """Conformer chunk for (stream, tokens, n_real) rows; returns mu [80, frames] per row, caches updated."""
        results: list[np.ndarray] = [np.zeros(0)] * len(items)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, (_, tokens, _) in enumerate(items):
            groups[len(tokens)].append(i)
        for idx in groups.values():
            streams = [items[i][0] for i in idx]
            lens = np.asarray([s.prompt.cache.token_att.shape[2] + s.flow.token_att.shape[2] for s in streams],
                              np.int64)
            out = self.enc.run({
                "tokens": np.stack([items[i][1] for i in idx]),
                "n_real": np.asarray([items[i][2] for i in idx], np.int64),
                "cnn_cache": np.stack([s.flow.cnn for s in streams]),
                "token_cache": _stack_joined([(s.prompt.cache.token_att, s.flow.token_att) for s in streams], 2,
                                             left=True).swapaxes(0, 1),
                "mel_cache": _stack_joined([(s.prompt.cache.mel_att, s.flow.mel_att) for s in streams], 2,
                                           left=True).swapaxes(0, 1),
                "cache_len": lens,
            })
            n_new = out["mu"].shape[1] // UP_RATE
            for row, (i, s) in enumerate(zip(idx, streams, strict=True)):
                t1 = lens[row] + n_new
                tok = out["new_token_cache"][:, row, :, -t1:]
                mel = out["new_mel_cache"][:, row, :, -UP_RATE * t1:]
                p, tail = s.prompt.frames, self.d.cache_tail_frames
                shared = s.prompt.cache.mel_att.shape[2]
                if mel.shape[2] <= p + tail:  # no trim yet: the prompt + the last 100 frames (50 tokens) are kept
                    p, tail = mel.shape[2], 0
                s.flow = replace(s.flow, cnn=out["new_cnn_cache"][row].copy(),
                                 token_att=_own(tok, 2, shared // UP_RATE, p // UP_RATE, tail // UP_RATE),
                                 mel_att=_own(mel, 2, shared, p, tail))
                results[i] = out["mu"][row].T
        return results

    def _cfm(self, items: list[tuple[Stream, np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """n_timesteps Euler steps for (stream, mu [80, T], cond [80, T]) rows; returns mel [80, T] per row."""
        results: list[np.ndarray] = [np.zeros(0)] * len(items)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, (_, mu, _) in enumerate(items):
            groups[mu.shape[1]].append(i)
        for n, idx in groups.items():
            streams = [items[i][0] for i in idx]
            b = len(idx)
            lens = np.asarray([len(s.flow.est_prompt) + s.flow.est_att.shape[4] for s in streams], np.int64)
            x = np.stack([self.rand_noise[:, o:o + n] for o in lens])
            mu = np.stack([items[i][1] for i in idx])
            cond = np.stack([items[i][2] for i in idx])
            spk = np.stack([s.prompt.spk for s in streams])
            new_cnn, new_att = [], []
            ts = self.t_span
            t, dt = ts[0], ts[1] - ts[0]
            for step in range(1, len(ts)):
                k = step - 1
                cnn = np.concatenate([np.stack([s.flow.est_cnn[k, :, j] for s in streams], 1) for j in (0, 1)], 1)
                att = _stack_joined([(s.flow.est_att[k], _frames(s.prompt.cache.est_att[k], 3, s.flow.est_prompt))
                                     for s in streams], 3, left=False)
                # [B, depth, 2, ..] -> [depth, 2B, ..]
                att = np.concatenate([att[:, :, 0], att[:, :, 1]], 0).swapaxes(0, 1)
                out = self.est.run({"x": x, "mu": mu, "t": np.full(b, t, np.float32), "spk": spk, "cond": cond,
                                        "cnn_cache": cnn, "att_cache": att, "cache_len": lens})
                x = x + float(dt) * out["velocity"]  # float32 whichever arrays (dt is float32's value)
                t = t + dt
                if step < len(ts) - 1:
                    dt = ts[step + 1] - t
                new_cnn.append(out["new_cnn_cache"])
                new_att.append(out["new_att_cache"])
            for row, (i, s) in enumerate(zip(idx, streams, strict=True)):
                keep = n + lens[row]
                est_cnn = np.stack([np.stack([c[:, row], c[:, b + row]], 1) for c in new_cnn])
                own = keep - len(s.flow.est_prompt)  # the new chunk, then the session's frames; the prompt's end it
                est_att = np.stack([np.stack([a[:, row, :, :own], a[:, b + row, :, :own]], 1) for a in new_att])
                est_att, est_prompt = _est_own(est_att, s.flow.est_prompt, s.prompt.frames,
                                               self.d.cache_tail_frames)
                s.flow = replace(s.flow, est_cnn=est_cnn, est_att=est_att, est_prompt=est_prompt)
                results[i] = x[row]
        return results

    def _vocode(self, items: list[tuple[Stream, np.ndarray, bool]]) -> dict[int, np.ndarray]:
        """HiFT for (stream, chunk mel [80, T], last) rows with the streams' caches; returns speech per row."""
        d = self.d
        ls = d.source_cache_samples
        results: dict[int, np.ndarray] = {}
        groups: dict[int, list[int]] = defaultdict(list)
        mels = []
        for i, (s, chunk_mel, _) in enumerate(items):
            mels.append(np.concatenate([s.mel, chunk_mel], axis=1).astype(np.float32))
            groups[mels[-1].shape[1]].append(i)
        for frames, idx in groups.items():
            noise = [self.noise(items[i][0], frames * SAMPLES_PER_FRAME) for i in idx]
            sources = [items[i][0].source for i in idx]
            out = self.voc.run({
                "mel": np.stack([mels[i] for i in idx]),
                "cache_source": np.stack([np.pad(s, (0, ls - len(s)))[None] for s in sources]).astype(np.float32),
                "cache_len": np.asarray([len(s) for s in sources], np.int64),
                "rand_ini": np.stack([r for r, _ in noise]),
                "sine_noise": np.stack([n for _, n in noise]),
            })
            for row, i in enumerate(idx):
                s, _, last = items[i]
                speech = out["speech"][row]
                held = len(s.speech)
                if held:  # cross-fade into the previous chunk's held tail
                    speech = speech.copy()
                    speech[:held] = (speech[:held] * self.window[:held] + s.speech[-held:] * self.window[ls:ls + held]
                                     ).astype(np.float32)
                s.mel = mels[i][:, -d.mel_cache_frames:]
                s.source = out["source"][row, 0, -ls:]
                s.speech = speech[-ls:]
                if not last:
                    speech = speech[:-ls]
                    if s.first_chunk:  # as the official stream: the first chunk keeps its length
                        speech = np.concatenate([np.zeros(ls, np.float32), speech])
                else:
                    s.speech = np.zeros(0, np.float32)
                s.first_chunk = False
                results[i] = speech.astype(np.float32)
        return results

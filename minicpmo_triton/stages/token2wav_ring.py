"""token2wav's caches on the device path: every session's in one preallocated tensor per cache, indexed by slot.

A slot holds one speaking turn's own frames (a turn starts from its voice's caches, so between turns a session
holds nothing): the conformer's keys/values at token and mel rate, the DiT estimator's for each of its Euler
steps (the conditional and the unconditional row of classifier-free guidance side by side), and the conv caches.
A voice's prompt frames live once, in a slot of their own in the same pool, and every turn with that voice reads
them there (never copied per session). The pool (`FlowPool`) grows (its tensors reallocated, what they hold
copied) when it runs out of slots, or of frames for a longer voice than any before.

Frames are written in place, where a slot has room (`Frames.place`), and the host keeps which positions hold
which frames (`TurnFrames`): the conformer's in time order (its attention is relative to position), the
estimator's in the reference's layout order (newest chunk first: its attention has no positions, so which frames
are kept is all that matters, `est_keep`). Trimming a cache is forgetting positions, never moving frames.

A chunk's forward reads, for each row and cache, the flat ids of the frames it keeps (`FlowRows`, `row_keys`):
one gather per layer, of exactly those frames, is the attention's read. A forward writes its new frames to free
positions only, so a failed forward leaves a turn's kept frames intact; the host's record (`TurnFrames`) moves
on in `commit_chunk`, after the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..model_config import Token2WavDims
from .token2wav_stream import est_keep

UP_RATE = 2  # mel frames per token


class Slots:
    """Which of a pool's slots are taken; the lowest free one first. `acquire` and `release` are the only ways a
    slot changes hands (the caller is its one owner in between)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count))

    def grow(self, count: int) -> None:
        self._free.extend(range(self.count, count))
        self.count = count

    def acquire(self) -> int | None:
        if not self._free:
            return None
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.count:
            raise ValueError(f"slot {slot} is not taken")
        self._free.append(slot)

    @property
    def taken(self) -> int:
        return self.count - len(self._free)


class FlowPool:
    """The flow's caches of `slots` slots (a turn's or a voice's), `frames` mel frames each (token rate: half).

    tok  [L1, slots, frames/2, H, 2*dk]   conformer token-rate keys|values (dk = channels / heads)
    mel  [L2, slots, frames, H, 2*dk]     conformer mel-rate keys|values
    est  [steps, depth, slots*2, frames, Hd, 2*hd]  DiT keys|values per Euler step; row 2s: conditional, 2s+1: not
    cnn  [slots, 6, C]                    conformer conv caches: pre-lookahead (2) + upsample (4) input frames
    est_cnn [steps, depth, slots*2, 2, 2*hidden]   DiT conv caches: each block's two convs' last 2 input frames
    (the conv caches channels-last: the official keeps them channels-first)
    """

    def __init__(self, d: Token2WavDims, slots: int, frames: int, device: str | torch.device,
                 dtype: torch.dtype) -> None:
        self.d, self.device, self.dtype = d, torch.device(device), dtype
        self.slots, self.frames = 0, 0
        self.version = 0  # one more at each reallocation (what holds the tensors by address must let go)
        self.tensors: dict[str, torch.Tensor] = {}
        self.grow(slots, frames)

    def _shapes(self, slots: int, frames: int) -> dict[str, tuple[int, ...]]:
        d = self.d
        dk = 2 * d.channels // d.heads
        hd = 2 * d.dit_head_dim
        return {"tok": (d.num_blocks, slots, frames // UP_RATE, d.heads, dk),
                "mel": (d.num_up_blocks, slots, frames, d.heads, dk),
                "est": (d.n_timesteps, d.dit_depth, 2 * slots, frames, d.dit_heads, hd),
                "cnn": (slots, 2 + 2 * UP_RATE, d.channels),
                "est_cnn": (d.n_timesteps, d.dit_depth, 2 * slots, 2, 2 * d.dit_hidden)}

    def grow(self, slots: int, frames: int) -> bool:
        """At least `slots` slots of `frames` frames (even: token rate is half): reallocate and copy when either is
        more than now. True when the tensors were replaced (whatever held views of them must take new ones)."""
        slots, frames = max(slots, self.slots), max(frames + frames % 2, self.frames)
        if slots == self.slots and frames == self.frames:
            return False
        new = {name: torch.zeros(shape, dtype=self.dtype, device=self.device)
               for name, shape in self._shapes(slots, frames).items()}
        for name, old in self.tensors.items():
            index: list[Any] = [slice(None)] * old.dim()
            for axis in range(old.dim()):
                index[axis] = slice(0, old.shape[axis])
            new[name][tuple(index)] = old
        self.tensors, self.slots, self.frames = new, slots, frames
        self._flat: dict[tuple[Any, ...], torch.Tensor] = {}  # `flat`'s views of these tensors
        self.version += 1
        return True

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def slot_bytes(self) -> int:
        return self.nbytes // max(self.slots, 1)

    def copy_conv(self, voice_slot: int, slot: int) -> None:
        """A turn's conv caches start as its voice's (the prompt's setup left them)."""
        self["cnn"][slot] = self["cnn"][voice_slot]
        self["est_cnn"][:, :, 2 * slot:2 * slot + 2] = self["est_cnn"][:, :, 2 * voice_slot:2 * voice_slot + 2]

    def flat(self, name: str, *lead: int) -> torch.Tensor:
        """One layer's (and step's) frames of every slot as one axis: [slots * frames, H, 2*d], a view (the flat ids
        of `FlowRows` index it), made once per allocation."""
        key = (name, *lead)
        view = self._flat.get(key)
        if view is None:
            t = self[name][lead]
            view = self._flat[key] = t.view(-1, *t.shape[-2:])
        return view


@dataclass
class Frames:
    """One cache's positions in a slot: `order` lists the positions in use, in the cache's order."""

    capacity: int
    order: list[int] = field(default_factory=list)

    def place(self, n: int) -> list[int]:
        """`n` free positions (the lowest), for a chunk's new frames."""
        used = set(self.order)
        free = [p for p in range(self.capacity) if p not in used][:n]
        if len(free) < n:
            raise RuntimeError(f"a slot of {self.capacity} frames has no room for {n} more (its pool did not grow)")
        return free


@dataclass
class TurnFrames:
    """The host's record of one turn's own frames in its slot (what `FlowRows` is built from)."""

    tok: list[int] = field(default_factory=list)  # token-rate conformer positions, oldest first
    mel: list[int] = field(default_factory=list)  # mel-rate conformer positions, oldest first
    est: list[int] = field(default_factory=list)  # estimator positions, the reference's order (newest chunk first)
    est_prompt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the voice's est frames kept

    def tokens_seen(self) -> int:
        return len(self.tok)


@dataclass
class ChunkPlan:
    """Where one row's chunk goes in its slot, before the forward: positions of its new frames."""

    tok_new: list[int]
    mel_new: list[int]
    est_new: list[int]


def plan_chunk(frames: TurnFrames, n_tokens: int, capacity: int) -> ChunkPlan:
    """Free positions for a chunk of `n_tokens` new token frames (2x at mel rate)."""
    tok = Frames(capacity // UP_RATE, frames.tok).place(n_tokens)
    mel = Frames(capacity, frames.mel).place(UP_RATE * n_tokens)
    est = Frames(capacity, frames.est).place(UP_RATE * n_tokens)
    return ChunkPlan(tok, mel, est)


def commit_chunk(frames: TurnFrames, plan: ChunkPlan, voice_frames: int, tail: int) -> TurnFrames:
    """The turn's frames after its chunk, trimmed as the reference trims them: the conformer keeps the prompt +
    the last `tail` mel frames (`tail`/2 tokens: minicpmo-utils 1.0.7 `_trim_conformer_cache`), the estimator
    `est_keep` of its layout with this chunk first."""
    tok = frames.tok + plan.tok_new
    mel = frames.mel + plan.mel_new
    if len(mel) > tail:
        tok, mel = tok[-(tail // UP_RATE):], mel[-tail:]
    layout = plan.est_new + frames.est
    own, est_prompt = est_keep(len(layout), frames.est_prompt, voice_frames, tail)
    return TurnFrames(tok, mel, [layout[i] for i in own], est_prompt)


@dataclass
class FlowRows:
    """What one batched chunk forward reads and writes, per row (all on the device). Each cache's rows read their
    keys with one gather by flat frame id (slot * frames + position, the estimator's rows by (2 * slot + 1 for
    the unconditional) * frames + position): the voice's frames the row keeps, then its own, then this chunk's,
    in time order (the conformer's relative positions are places in that list), padded to the batch's longest.

    own [B]: the rows' slots (where their conv caches are)
    tok_keys, mel_keys, est_keys [B, K]: flat ids of the frames each row reads (the estimator's: conditional rows)
    tok_valid, mel_valid, est_valid [B, K]: which of them are real (the rest are padding)
    tok_new, mel_new, est_new [B, n]: flat ids this chunk's new frames are written to, in time order
    """

    own: torch.Tensor
    tok_keys: torch.Tensor
    tok_valid: torch.Tensor
    tok_new: torch.Tensor
    mel_keys: torch.Tensor
    mel_valid: torch.Tensor
    mel_new: torch.Tensor
    est_keys: torch.Tensor
    est_valid: torch.Tensor
    est_new: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.own.shape[0])


def row_keys(frames: TurnFrames, plan: ChunkPlan, slot: int, voice_slot: int | None, voice_frames: int,
             capacity: int) -> dict[str, list[int]]:
    """One row's key lists and new frames' ids (`FlowRows`), before padding: what goes up to the device, flat in
    the turn's length (a turn keeps at most the voice's frames and 100 more)."""
    ft = capacity // UP_RATE
    voice_tok = [] if voice_slot is None else [voice_slot * ft + j for j in range(voice_frames // UP_RATE)]
    voice_mel = [] if voice_slot is None else [voice_slot * capacity + j for j in range(voice_frames)]
    voice_est = [] if voice_slot is None else [2 * voice_slot * capacity + int(j) for j in frames.est_prompt]
    tok_new = [slot * ft + p for p in plan.tok_new]
    mel_new = [slot * capacity + p for p in plan.mel_new]
    est_new = [2 * slot * capacity + p for p in plan.est_new]
    return {"tok_keys": voice_tok + [slot * ft + p for p in frames.tok] + tok_new, "tok_new": tok_new,
            "mel_keys": voice_mel + [slot * capacity + p for p in frames.mel] + mel_new, "mel_new": mel_new,
            "est_keys": voice_est + [2 * slot * capacity + p for p in frames.est] + est_new, "est_new": est_new}


def padded(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ids as [B, longest] (padding 0) and which entries are real."""
    width = max(len(x) for x in lists)
    ids = np.zeros((len(lists), width), np.int64)
    valid = np.zeros((len(lists), width), bool)
    for r, x in enumerate(lists):
        ids[r, :len(x)] = x
        valid[r, :len(x)] = True
    return ids, valid

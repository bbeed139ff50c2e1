"""The TTS's side of the engine core: MiniCPM-o 4.5's TTS Llama (`DuplexTTS`, engine/tts_model.py) over a KV pool
of its own (its layers and heads are not the LLM's), the same `PagedDecoder` layers and attention, its own input,
head and rules.

Input (as `DuplexTTS.forward`, the ONNX graph): a chunk's condition is emb_text(id) + `DuplexTTS.semantic(h)` where
a text token has an LLM hidden state, then emb_text(audio_bos); every later position is a code, emb_code(code).
Head: `head_code` over the speech codes; the logits [B, 6562] never leave the device. Rules (`TtsStage`'s `TtsRows`,
MiniCPM-o's `MiniCPMTTS.generate_chunk`, OpenBMB/MiniCPM-o-Demo MiniCPMO45/modeling_minicpmo_unified.py:6792-6816),
step for step and in the same precision: the logits divided by the temperature (float32); the repetition penalty per
occurrence over the chunk's codes in its window (`CustomRepetitionPenaltyLogitsProcessorRepeat`, :6950-6968: alpha =
penalty ** count in float64, stored float32); EOS masked mid-turn (:6809-6810); then the argmax when greedy, else
top-k / top-p (`sampling.distribution`: off at top_k 0 / top_p 1) and the inverse CDF at the session rng's uniform for
that code. A chunk ends on EOS or on its (n_tokens + 1)-th code (chosen, dropped); the device knows both, so a TTS row
is never wasted by the overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..model_config import TtsDims
from ..rules.sampling import kept_k
from .model import PagedDecoder
from .protocol import ENDED, NOT_FINITE, TtsFeed, TtsRow, TtsRules
from .sampler import candidates, inverse_cdf, not_finite, put, take, value_ordered
from .staging import DeviceWrites, Staging
from .tts_model import DuplexTTS


class TtsHead:
    def __init__(self, model: PagedDecoder, tts: TtsDims, rules: TtsRules, capacity: int, writes: DeviceWrites,
                 steps: int = 32) -> None:
        self.model, self.rules, self.writes = model, rules, writes
        net = model.net
        assert isinstance(net, DuplexTTS)
        self.net = net
        self.device = dev = model.device
        self.vocab = tts.num_audio_tokens
        self.capacity = r = capacity
        self.head_bytes = sum(t.numel() * t.element_size() for t in net.head_code.parameters())
        self.narrow = candidates(rules.top_k, self.vocab)
        self.temperature = torch.ones(r, device=dev)  # float32, as the host divides its float32 logits
        self.greedy = torch.zeros(r, dtype=torch.bool, device=dev)
        self.allow_eos = torch.zeros(r, dtype=torch.bool, device=dev)
        self.n_tokens = torch.zeros(r, dtype=torch.int64, device=dev)
        self.steps = torch.zeros(r, dtype=torch.int64, device=dev)  # codes chosen
        self.ring = torch.full((r, rules.window), self.vocab, dtype=torch.int64, device=dev)  # the chunk's codes
        self.penalty = torch.tensor(rules.repetition_penalty, dtype=torch.float64, device=dev)
        self.eos = torch.full((1,), rules.eos, dtype=torch.int64, device=dev)
        self.top_p = torch.full((r,), rules.top_p, dtype=torch.float64, device=dev)
        self.ks = torch.full((r,), kept_k(rules.top_k, self.vocab),
                             dtype=torch.int64, device=dev)
        self.neg = torch.full((), float("-inf"), device=dev)
        self.steps_cap = 0
        self.uniforms = torch.zeros(0, dtype=torch.float64, device=dev)
        self._grow(steps)

    def _grow(self, steps: int) -> None:
        uniforms = torch.zeros(self.capacity, steps, dtype=torch.float64, device=self.device)
        if self.steps_cap:
            uniforms[:, : self.steps_cap] = self.uniforms
        self.uniforms, self.steps_cap = uniforms, steps

    # ---- the host side ----
    def admit(self, slots: list[int], rows: list[TtsRow]) -> bool:
        need = max(r.n_tokens + 1 for r in rows)
        grew = need > self.steps_cap
        if grew:
            self._grow(1 << (need - 1).bit_length())
        n = len(rows)
        width = max(1, max(len(r.uniforms) for r in rows))  # only the draws the rows have go up
        uniforms = np.zeros((n, width))
        for i, row in enumerate(rows):
            uniforms[i, : len(row.uniforms)] = row.uniforms
        put = self.writes.rows
        put(self.temperature, slots, np.array([r.temperature if r.temperature > 0 else 1.0 for r in rows]))
        put(self.greedy, slots, np.array([r.temperature <= 0 for r in rows]))
        put(self.allow_eos, slots, np.array([r.allow_eos for r in rows]))
        put(self.n_tokens, slots, np.array([r.n_tokens for r in rows], np.int64))
        put(self.steps, slots, np.zeros(n, np.int64))
        put(self.ring, slots, np.full((n, self.rules.window), self.vocab, np.int64))
        put(self.uniforms[:, :width], slots, uniforms)
        return grew

    def width(self, rows: list[Any]) -> int:
        return self.narrow

    def prefill_input(self, staging: Staging, feeds: list[TtsFeed]) -> Callable[[], torch.Tensor]:
        """The conditions' input: emb_text of every id, plus L2norm(projector_semantic(h)) where a text token has
        its LLM hidden state (host arrays go with the iteration's copy; device ones, the LLM's rows where they are,
        are used in place)."""
        ids = staging.put(np.concatenate([f.text_ids for f in feeds]).astype(np.int64))
        starts = np.cumsum([0] + [len(f) for f in feeds[:-1]])
        at = np.concatenate([s + np.arange(len(f.hidden)) for s, f in zip(starts, feeds, strict=True)])
        where = staging.put(at.astype(np.int64)) if len(at) else None
        parts = [staging.put(np.asarray(f.hidden, np.float32)) if isinstance(f.hidden, np.ndarray) else f.hidden
                 for f in feeds if len(f.hidden)]

        def make() -> torch.Tensor:
            x = self.net.emb_text(staging.view(ids))
            if where is None:
                return x
            h = torch.cat([p if isinstance(p, torch.Tensor) else staging.view(p) for p in parts]).to(x.dtype)
            return x.index_add(0, staging.view(where), self.net.semantic(h))

        return make

    # ---- the device side ----
    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        return self.net.emb_code[0](codes)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net.head_code[0](hidden).to(torch.float32)

    def keep_decoded(self, hidden: torch.Tensor, b: int, was_live: torch.Tensor) -> None:
        """The TTS keeps no hidden rows."""

    def keep_prefilled(self, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        """The TTS keeps no hidden rows."""

    def adjusted(self, raw: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32: the logits after temperature, the per-occurrence penalty and the EOS mask."""
        x = raw.to(torch.float32) / take(self.temperature, rows)[:, None]
        ring = take(self.ring, rows)
        counts = torch.zeros((x.shape[0], self.vocab + 1), dtype=torch.float64, device=x.device)
        counts.scatter_add_(1, ring, torch.ones(ring.shape, dtype=torch.float64, device=x.device))
        alpha = torch.pow(self.penalty, counts[:, : self.vocab])
        x64 = x.to(torch.float64)
        x = torch.where(x64 < 0, x64 * alpha, x64 / alpha).to(torch.float32)
        eos = x.index_select(1, self.eos)
        return x.index_copy(1, self.eos, torch.where(take(self.allow_eos, rows)[:, None], eos, self.neg))

    def choose(self, raw: torch.Tensor, rows: slice | torch.Tensor, state: Any, was_live: torch.Tensor, width: int,
               chat: bool = True) -> None:
        x = self.adjusted(raw, rows)
        greedy, steps = take(self.greedy, rows), take(self.steps, rows)
        uniforms = take(self.uniforms, rows)
        u = uniforms.gather(1, steps.clamp(max=self.steps_cap - 1)[:, None])[:, 0]
        top_ids, probs = value_ordered(x.to(torch.float64), take(self.ks, rows), width, take(self.top_p, rows))
        code = torch.where(greedy, x.argmax(1), inverse_cdf(top_ids, probs, u))
        bad = not_finite(x)
        stop = (code == self.rules.eos) | (steps == take(self.n_tokens, rows))
        goes_on = was_live & ~bad & ~stop
        ring = take(self.ring, rows)
        at = (steps % self.rules.window)[:, None]
        put(self.ring, rows, ring.scatter(1, at, torch.where(goes_on, code, ring.gather(1, at)[:, 0])[:, None]))
        put(self.steps, rows, torch.where(was_live, steps + 1, steps))
        put(state.ids, rows, torch.where(goes_on, code, take(state.ids, rows)))
        put(state.positions, rows, take(state.positions, rows) + goes_on.to(torch.int64))
        put(state.live, rows, goes_on)
        flags = bad.to(torch.int64) * NOT_FINITE + (~goes_on).to(torch.int64) * ENDED
        put(state.out, rows, torch.stack([code, flags], 1))

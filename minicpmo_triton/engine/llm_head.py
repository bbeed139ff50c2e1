"""The LLM's side of the engine core: its input (token embeddings, the audio and image embeddings spliced in), its
head (lm_head) and its rules on the device, over per-row buffers that live as long as the batch.

A row's rules are written once, when it is admitted (`admit`: its sampling settings, repetition window, the
session rng's uniforms for the whole chunk, its forced tokens); after that every iteration runs on what the device
already holds (`choose`), as `duplex_rules.stream_decode` + `ChunkDecoder.accept` (a duplex row) and
`ChatDecoder.adjust` + `apply_repetition_penalty` + `sampling.sample` + `ChatDecoder.accept` (a chat row) do on
the host:
- the draws (engine/sampler.py) at the row's next uniforms (`draws`: two per duplex draw that goes past
  <|chunk_eos|>, one otherwise, none when greedy or forced);
- the repetition window as a ring per row, gaining each drawn token as the host's history does;
- what the next iteration feeds: the token, <|listen|> made <|tts_bos|> while a turn is open, nothing after a
  terminator (<|listen|>, <|chunk_eos|>, <|chunk_tts_eos|>; <|im_end|> or the budget for chat) or past the
  budget; the turn's state; whether the fed token is text (its hidden row is kept for the TTS).
So the next iteration can be launched before the host has read this one's tokens (engine/core.py). One host rule
is not mirrored: the 28-character cut (`ChunkDecoder.accept` decodes the chunk's text with the tokenizer); a row it
ends runs one more iteration on the device, wasted, and is retired by the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..model_config import SpecialTokens
from ..rules.sampling import kept_k
from .model import DuplexLLM, PagedDecoder
from .protocol import CHAT, DREW_SECOND, DUPLEX, ENDED, NO_TOKEN, NOT_FINITE, LlmRow, Prefill
from .sampler import candidates, first_draw, index_ordered, inverse_cdf, not_finite, put, take, value_ordered
from .staging import DeviceWrites, Staging


class LlmHead:
    def __init__(self, model: PagedDecoder, tokens: SpecialTokens, forbidden: np.ndarray, capacity: int,
                 writes: DeviceWrites, window: int = 512, steps: int = 64, top_k: int = 20) -> None:
        """`forbidden`: [DUPLEX / CHAT, vocab] the rule sets' masks; `window`: the repetition window; `steps`: a
        row's most decisions (its buffers' width: grown when a row needs more); `top_k`: the largest k the fixed
        top-k width serves (a row asking more, or 0, runs with the whole vocabulary that iteration)."""
        self.model, self.tokens, self.writes = model, tokens, writes
        self.device = dev = model.device
        self.vocab = model.d.vocab
        self.capacity = r = capacity
        self.window = window
        self.forbidden = torch.as_tensor(forbidden, device=dev)  # uploaded once
        self.narrow = candidates(top_k, self.vocab)
        net = model.net
        assert isinstance(net, DuplexLLM)
        self.net = net
        self.head_bytes = net.lm_head.weight.numel() * net.lm_head.weight.element_size()
        z = torch.zeros
        self.is_chat = z(r, dtype=torch.bool, device=dev)
        self.greedy = z(r, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(r, device=dev)  # float32: the duplex rules divide float32 logits by it
        self.temperature64 = torch.ones(r, dtype=torch.float64, device=dev)  # `sample` divides float64 ones
        self.top_k = torch.ones(r, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(r, dtype=torch.float64, device=dev)
        self.penalty = torch.ones(r, device=dev)
        self.inv_penalty = torch.ones(r, device=dev)  # 1 / penalty in float32, as the host multiplies by it
        self.length_penalty = torch.ones(r, device=dev)
        self.max_new = torch.ones(r, dtype=torch.int64, device=dev)
        self.ring = z(r, window, dtype=torch.int64, device=dev)  # the repetition window, as a ring
        self.ring_at = z(r, dtype=torch.int64, device=dev)  # where the next token goes
        self.ring_any = z(r, dtype=torch.bool, device=dev)
        self.draws = z(r, dtype=torch.int64, device=dev)  # uniforms used
        self.steps = z(r, dtype=torch.int64, device=dev)  # decisions made (`len(dec.generated)`)
        self.n_forced = z(r, dtype=torch.int64, device=dev)
        self.turn_ended = z(r, dtype=torch.bool, device=dev)
        self.text_next = z(r, dtype=torch.bool, device=dev)  # the token fed next is text: keep its hidden row
        self.hidden_n = z(r, dtype=torch.int64, device=dev)
        self.rows = torch.arange(r, device=dev)
        self.turn_eos = torch.full((1,), tokens.turn_eos, dtype=torch.int64, device=dev)
        self.neg = torch.full((), float("-inf"), device=dev)
        self.steps_cap = 0
        self.uniforms = self.forced = self.hidden = torch.zeros(0, device=dev)
        self._grow(steps)

    def _grow(self, steps: int) -> None:
        """The per-step buffers at `steps` columns (a new row that needs more grows them: graphs are recaptured)."""
        r, dev, old = self.capacity, self.device, self.steps_cap
        uniforms = torch.zeros(r, 2 * steps, dtype=torch.float64, device=dev)
        forced = torch.full((r, steps), -1, dtype=torch.int64, device=dev)
        hidden = torch.zeros(r, steps, self.model.d.hidden, dtype=self.model.dtype, device=dev)
        if old:
            uniforms[:, : 2 * old] = self.uniforms
            forced[:, :old] = self.forced
            hidden[:, :old] = self.hidden
        self.uniforms, self.forced, self.hidden, self.steps_cap = uniforms, forced, hidden, steps

    # ---- the host side: a row's rules written once ----
    def admit(self, slots: list[int], rows: list[LlmRow]) -> bool:
        """Queue the admitted rows' rules (applied with the iteration's one copy). True when the per-step buffers
        grew (captured graphs are stale)."""
        need = max(r.max_new for r in rows)
        grew = need > self.steps_cap
        if grew:
            self._grow(1 << (need - 1).bit_length())
        n, w, cap, v = len(rows), self.window, self.steps_cap, self.vocab
        ring = np.zeros((n, w), np.int64)
        ring_at = np.zeros(n, np.int64)
        # only what the rows have goes up (the columns past it are never read: draws and decisions stop first)
        drawn = max(1, max(len(r.uniforms) for r in rows))
        n_forced = max(1, max(len(r.forced[:cap]) for r in rows))
        uniforms = np.zeros((n, drawn))
        forced = np.full((n, n_forced), -1, np.int64)
        for i, row in enumerate(rows):
            hist = row.history[-w:]
            if hist:  # the window's unused places repeat its last id: the set (what is penalised) is the same
                ring[i] = hist[-1]
                ring[i, : len(hist)] = hist
                ring_at[i] = len(hist) % w
            uniforms[i, : len(row.uniforms)] = row.uniforms
            f = row.forced[:cap]
            forced[i, : len(f)] = f
        k = np.array([kept_k(r.top_k, v) for r in rows], np.int64)
        pen = np.array([r.repetition_penalty for r in rows], np.float32)
        put = self.writes.rows
        put(self.is_chat, slots, np.array([r.kind == CHAT for r in rows]))
        put(self.greedy, slots, np.array([r.temperature <= 0 for r in rows]))
        temperature = np.array([r.temperature if r.temperature > 0 else 1.0 for r in rows])
        put(self.temperature, slots, temperature)
        put(self.temperature64, slots, temperature)
        put(self.top_k, slots, k)
        put(self.top_p, slots, np.array([r.top_p for r in rows], np.float64))
        put(self.penalty, slots, pen)
        put(self.inv_penalty, slots, (1.0 / pen.astype(np.float64)).astype(np.float32))
        put(self.length_penalty, slots, np.array([r.length_penalty for r in rows], np.float32))
        put(self.max_new, slots, np.array([r.max_new for r in rows], np.int64))
        put(self.ring, slots, ring)
        put(self.ring_at, slots, ring_at)
        put(self.ring_any, slots, np.array([bool(r.history) for r in rows]))
        put(self.uniforms[:, :drawn], slots, uniforms)
        put(self.forced[:, :n_forced], slots, forced)
        put(self.n_forced, slots, np.array([min(len(r.forced), cap) for r in rows], np.int64))
        put(self.turn_ended, slots, np.array([r.turn_ended for r in rows]))
        put(self.text_next, slots, np.zeros(n, bool))
        put(self.hidden_n, slots, np.zeros(n, np.int64))
        put(self.draws, slots, np.zeros(n, np.int64))
        put(self.steps, slots, np.zeros(n, np.int64))
        return grew

    def width(self, rows: list[LlmRow]) -> int:
        """The top-k width these rows need (the fixed one unless a row asks for more)."""
        return max([self.narrow] + [candidates(r.top_k, self.vocab) for r in rows])

    def prefill_input(self, staging: Staging, prefills: list[Prefill]) -> Callable[[], torch.Tensor]:
        """The rows' token embeddings with their audio / image embeddings spliced in where `use`: host arrays go
        with the iteration's copy, device ones (the streaming Whisper's) are spliced where they are."""
        ids = staging.put(np.concatenate([p.ids for p in prefills]).astype(np.int64))
        use = np.flatnonzero(np.concatenate([p.use for p in prefills]))
        at = staging.put(use) if len(use) else None
        parts = [staging.put(np.asarray(p.embeds, np.float32)) if isinstance(p.embeds, np.ndarray) else p.embeds
                 for p in prefills if p.use.any()]

        def make() -> torch.Tensor:
            x = self.embed(staging.view(ids))
            if at is None:
                return x
            rows = [p if isinstance(p, torch.Tensor) else staging.view(p) for p in parts]
            return x.index_copy(0, staging.view(at), torch.cat(rows).to(x.dtype))

        return make

    # ---- the device side ----
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net.model.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, vocab] fp32 for the rows' last hidden states; they never leave the device."""
        return self.net.lm_head(hidden).to(torch.float32)

    def keep_decoded(self, hidden: torch.Tensor, b: int, was_live: torch.Tensor) -> None:
        """The decode step's rows whose fed token is text keep its hidden state (the TTS's condition)."""
        self._keep(hidden, slice(0, b), was_live & self.text_next[:b])

    def keep_prefilled(self, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows whose prefill's first token is text (a chat chunk's carried token) keep its hidden state."""
        self._keep(hidden, slots, torch.ones_like(slots, dtype=torch.bool))

    def _keep(self, hidden: torch.Tensor, rows: slice | torch.Tensor, wanted: torch.Tensor) -> None:
        """Each wanted row's hidden state [n, hidden] into its next place in its row's buffer."""
        n_rows = take(self.rows, rows)
        at = take(self.hidden_n, rows)
        spot = n_rows * self.steps_cap + at.clamp(max=self.steps_cap - 1)
        flat = self.hidden.view(-1, self.hidden.shape[-1])
        flat.index_copy_(0, spot, torch.where(wanted[:, None], hidden.to(flat.dtype), flat.index_select(0, spot)))
        put(self.hidden_n, rows, at + wanted.to(torch.int64))

    def choose(self, raw: torch.Tensor, rows: slice | torch.Tensor, state: Any, was_live: torch.Tensor,
               width: int, chat: bool = True) -> None:
        """Every row's next token from its logits raw [n, vocab] (fp32), under its rules; the row's state moves on
        and (token, flags) go to `state.out`. `was_live`: the rows that decide now (the others keep their state);
        `width`: the top-k's columns; `chat`: some row is a chat row (else its rules are not computed)."""
        tk, neg = self.tokens, self.neg
        is_chat, greedy = take(self.is_chat, rows), take(self.greedy, rows)
        steps, draws = take(self.steps, rows), take(self.draws, rows)
        ring, ring_any = take(self.ring, rows), take(self.ring_any, rows)
        penalty, inv_penalty = take(self.penalty, rows)[:, None], take(self.inv_penalty, rows)[:, None]
        temperature, ks, top_p = take(self.temperature, rows), take(self.top_k, rows), take(self.top_p, rows)
        uniforms = take(self.uniforms, rows)
        u1 = uniforms.gather(1, draws.clamp(max=uniforms.shape[1] - 1)[:, None])[:, 0]
        u2 = uniforms.gather(1, (draws + 1).clamp(max=uniforms.shape[1] - 1)[:, None])[:, 0]
        penalised = (ring_any & (take(self.penalty, rows) != 1.0))[:, None]

        # duplex (`stream_decode`): the first draw from the raw softmax ends the chunk on <|chunk_eos|>
        first = torch.where(greedy, raw.argmax(1), first_draw(raw, u1))
        out = torch.where(self.forbidden[DUPLEX], neg, raw)
        vals = out.gather(1, ring)  # the window's ids (repeats write the same value)
        out = out.scatter(1, ring, torch.where(penalised, torch.where(penalty > 1.0, vals / penalty,
                                                                      vals * inv_penalty), vals))
        lp = take(self.length_penalty, rows)
        eos = out[:, tk.turn_eos]
        out = out.index_copy(1, self.turn_eos, torch.where(eos > 0, eos / lp, eos * lp)[:, None])
        second = torch.where(greedy, out.argmax(1),
                             index_ordered(out / temperature[:, None], ks, width, top_p, u2))
        ends_first = first == tk.chunk_eos
        duplex_token = torch.where(ends_first, first, second)

        if chat:  # `ChatDecoder.adjust`, `apply_repetition_penalty`, `sample`
            x = torch.where(self.forbidden[CHAT], neg, raw)
            vals = x.gather(1, ring)
            x = x.scatter(1, ring, torch.where(penalised, torch.where(vals < 0, vals * penalty, vals / penalty),
                                               vals))
            top_ids, probs = value_ordered(x.to(torch.float64) / take(self.temperature64, rows)[:, None], ks, width,
                                           top_p)
            chat_token = torch.where(greedy, x.argmax(1), inverse_cdf(top_ids, probs, u1))
            chat_bad = not_finite(x)
        else:
            chat_token, chat_bad = duplex_token, not_finite(raw)

        forced_at = take(self.forced, rows).gather(1, steps.clamp(max=self.steps_cap - 1)[:, None])[:, 0]
        forced = (steps < take(self.n_forced, rows)) & (forced_at >= 0)
        no_token = ~is_chat & (steps >= take(self.max_new, rows) - 1)  # `must_end`: <|chunk_eos|>, no draw
        drew = ~forced & ~no_token
        token = torch.where(forced, forced_at, torch.where(is_chat, chat_token, duplex_token))
        drew_second = drew & ~is_chat & ~ends_first
        bad = drew & torch.where(is_chat, chat_bad, not_finite(raw))
        draws = draws + torch.where(drew & ~greedy, torch.where(is_chat | ends_first, 1, 2), 0)

        # the history gains the token as the host's does (a forced one, a duplex draw past <|chunk_eos|>, a chat draw)
        joins = was_live & ~bad & torch.where(is_chat, ~forced, forced | drew_second) & ~no_token
        ring_at = take(self.ring_at, rows)
        fill = joins & ~ring_any  # an empty window: every place holds the first id
        ring = torch.where(fill[:, None], token[:, None], ring)
        at = ring_at[:, None]
        ring = ring.scatter(1, at, torch.where(joins, token, ring.gather(1, at)[:, 0])[:, None])
        put(self.ring, rows, ring)
        put(self.ring_at, rows, torch.where(joins, (ring_at + 1) % self.window, ring_at))
        put(self.ring_any, rows, ring_any | joins)

        # `ChunkDecoder.accept` / `ChatDecoder.accept`: what is fed next
        turn_ended = take(self.turn_ended, rows)
        fed = torch.where(~is_chat & (token == tk.listen) & ~turn_ended, tk.tts_bos, token)
        stop = torch.where(is_chat, (fed == tk.im_end) | (steps + 1 >= take(self.max_new, rows)),
                           (fed == tk.listen) | (fed == tk.chunk_eos) | (fed == tk.chunk_tts_eos))
        goes_on = was_live & ~no_token & ~bad & ~stop
        put(self.turn_ended, rows, torch.where(goes_on & ~is_chat, fed == tk.turn_eos, turn_ended))
        put(self.text_next, rows, goes_on & (is_chat | (steps != 0)))
        put(self.steps, rows, torch.where(was_live & ~no_token, steps + 1, steps))
        put(self.draws, rows, torch.where(was_live, draws, take(self.draws, rows)))
        put(state.ids, rows, torch.where(goes_on, fed, take(state.ids, rows)))
        put(state.positions, rows, take(state.positions, rows) + goes_on.to(torch.int64))
        put(state.live, rows, goes_on)
        flags = (drew_second.to(torch.int64) * DREW_SECOND + bad.to(torch.int64) * NOT_FINITE
                 + (~goes_on).to(torch.int64) * ENDED + no_token.to(torch.int64) * NO_TOKEN)
        put(state.out, rows, torch.stack([token, flags], 1))

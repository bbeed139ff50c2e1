"""The paged LLM engine: a packed prefill of every row's chunk, then one batched decode forward per token, the KV
cache in the pool, the choice of each token on the device; the host sees token ids and the hidden rows it asks for.

A `RowDriver` is the stage's side of the loop (the host's decode rules): per row, whether it wants the hidden
state of the token just fed (the TTS conditions on text tokens' hidden states), what the next pick is (or
None when the row is done), and what to feed after a token (or None when the chunk is over).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..model_config import DecoderDims, SpecialTokens
from .attention import Rows
from .build import build_decoder, load_weights
from .model import PagedDecoder
from .protocol import Prefill, RowPick
from .sampler import DeviceSampler
from .traffic import Traffic


class RowDriver(Protocol):
    def wants_hidden(self, row: int) -> bool: ...

    def add_hidden(self, row: int, hidden: np.ndarray) -> None: ...

    def pick(self, row: int) -> RowPick | None: ...

    def accept(self, row: int, token: int, drew_second: bool) -> int | None: ...


Admit = Callable[[], list[tuple[int, int, Prefill]]]  # -> new rows: (session id, its length, its prefill)
Done = Callable[[int, int], None]  # (row, its new length): the row left the loop after this iteration


@dataclass
class Forward:
    logits: torch.Tensor  # [B, vocab] fp32, device
    hidden: torch.Tensor  # [N, hidden], device
    first: list[int]  # each row's first token in `hidden`


@dataclass
class LoopTiming:
    prefill_ms: float
    decode_ms: float
    steps: int


class PagedLlmEngine:
    name = "paged"

    def __init__(self, model: PagedDecoder, traffic: Traffic) -> None:
        self.model = model
        self.pool = model.pool
        self.traffic = traffic
        self.device = model.device
        self.sampler: DeviceSampler | None = None
        self.iterations = 0  # forwards run by `run` since the engine was built: the in-flight loop's clock

    def use_rules(self, forbidden: np.ndarray, tokens: SpecialTokens) -> None:
        """The rule sets' forbidden tokens [DUPLEX / CHAT, vocab], uploaded once: the stage's decode rules own them."""
        self.sampler = DeviceSampler(forbidden, tokens, self.device, self.traffic)

    @classmethod
    def build(cls, weights: dict[str, torch.Tensor], dims: DecoderDims, **build: Any) -> PagedLlmEngine:
        """`build`: `build.build_decoder`'s settings (the pool's size, dtypes, attention backend)."""
        model = build_decoder(weights, dims, **build)
        return cls(model, model.pool.traffic)

    def forward(self, seqs: list[int], pasts: list[int], rows_in: list[Prefill]) -> Forward:
        counts = [len(p.ids) for p in rows_in]
        for seq, past, n in zip(seqs, pasts, counts, strict=True):
            self.pool.reserve(seq, past + n)  # a no-op when the stage reserved the step at its check
        rows = Rows(self.pool.block_table(seqs, [p + n for p, n in zip(pasts, counts, strict=True)]), pasts, counts)
        up = self.traffic.upload
        ids = up("inputs", np.concatenate([p.ids for p in rows_in]).astype(np.int64), self.device)
        x = self.model.embed(ids)
        if any(p.use.any() for p in rows_in):
            use = up("inputs", np.concatenate([p.use for p in rows_in]), self.device)
            x[use] = up("inputs", np.concatenate([p.embeds for p in rows_in if p.use.any()]), self.device).to(x.dtype)
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(pasts, counts, strict=True)])
        slots = torch.cat([self.pool.slots(s, p, n) for s, p, n in zip(seqs, pasts, counts, strict=True)])
        hidden = self.model.forward(x, up("inputs", positions, self.device), up("inputs", slots, self.device), rows)
        last = up("inputs", [s + n - 1 for s, n in zip(rows.start, counts, strict=True)], self.device)
        return Forward(self.model.logits(hidden[last]), hidden, rows.start)

    def hidden_rows(self, out: Forward, positions: list[int]) -> np.ndarray:
        index = self.traffic.upload("inputs", [out.first[p] for p in positions], self.device)
        return self.traffic.download("outputs", out.hidden[index].to(torch.float32))

    def run(self, seqs: list[int], pasts: list[int], prefill: list[Prefill], driver: RowDriver,
            admit: Admit | None = None, done: Done | None = None) -> tuple[list[int], LoopTiming]:
        """Prefill every row, then decode until every row is done. Returns each row's new length.

        `admit`, called before each decode iteration, may bring new rows (their session, its length, their
        prefill): they join that iteration's forward, their prefill packed beside the others' one-token steps (no
        padding, nobody waits for them), and are decided from then on like the rest; they are numbered on from
        the rows given (the driver must know them) and their lengths are returned after them. `done`, when given,
        is told of each row in the iteration it finishes, so its caller can be answered before the others are."""
        t0 = time.perf_counter()
        seqs, lengths = list(seqs), list(pasts)
        feed: dict[int, Prefill] = dict(enumerate(prefill))  # row -> what it feeds in the next forward
        prefill_ms, steps = 0.0, 0
        while feed:
            rows = list(feed)
            out = self.forward([seqs[r] for r in rows], [lengths[r] for r in rows], [feed[r] for r in rows])
            for r in rows:
                lengths[r] += len(feed[r].ids)
            if not steps:
                prefill_ms = (time.perf_counter() - t0) * 1000
            steps += 1
            self.iterations += 1
            feed = self._decide(out, rows, driver)
            if done is not None:
                for r in rows:
                    if r not in feed:
                        done(r, lengths[r])
            for seq, past, pre in admit() if admit is not None else []:
                feed[len(seqs)] = pre
                seqs.append(seq)
                lengths.append(past)
        timing = LoopTiming(prefill_ms, (time.perf_counter() - t0) * 1000 - prefill_ms, max(0, steps - 1))
        return lengths, timing

    def _decide(self, out: Forward, rows: list[int], driver: RowDriver) -> dict[int, Prefill]:
        """Each row's next token, chosen on the device; what the rows still going feed next."""
        wants = [pos for pos, row in enumerate(rows) if driver.wants_hidden(row)]
        if wants:
            for pos, vec in zip(wants, self.hidden_rows(out, wants), strict=True):
                driver.add_hidden(rows[pos], vec)
        asked = [(pos, row, driver.pick(row)) for pos, row in enumerate(rows)]
        picks = [(pos, row, p) for pos, row, p in asked if p is not None]
        if not picks:
            return {}
        at = self.traffic.upload("inputs", [pos for pos, _, _ in picks], self.device)
        assert self.sampler is not None, "use_rules first"
        picked = self.sampler.pick(out.logits[at], [p for _, _, p in picks])
        feed = {}
        for (_, row, _), tok, second in zip(picks, picked.tokens, picked.drew_second, strict=True):
            nxt = driver.accept(row, int(tok), bool(second))
            if nxt is not None:
                feed[row] = Prefill(np.array([nxt], np.int64), np.zeros((0, 1), np.float32), np.zeros(1, bool))
        return feed


def load_paged_engine(folder: Path, dims: DecoderDims, device: str, context_tokens: int, **build: Any
                      ) -> PagedLlmEngine:
    """The paged engine over the exported LLM weights (`folder`/weights.safetensors) on `device`."""
    return PagedLlmEngine.build(load_weights(folder, device), dims, device=device, max_tokens=context_tokens,
                                **build)

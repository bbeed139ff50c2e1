"""The paged LLM engine: a packed prefill of every row's chunk, then one batched decode forward per token, the KV
cache in the pool, the choice of each token on the device; the host sees token ids and the hidden rows it asks for.

A `RowDriver` is the stage's side of the loop (the host's decode rules): per row, whether it wants the hidden
state of the token just fed (the TTS conditions on text tokens' hidden states), what the next pick is (or
None when the row is done), and what to feed after a token (or None when the chunk is over).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..model_config import DecoderDims, SpecialTokens
from .build import build_decoder, load_weights
from .loop import DecodeLoop, LoopTiming, asking, packed_forward  # noqa: F401 (LoopTiming: the stages import it from here)
from .model import PagedDecoder
from .protocol import Prefill, RowPick
from .sampler import DeviceSampler
from .traffic import Traffic


class RowDriver(Protocol):
    def wants_hidden(self, row: int) -> bool: ...

    def add_hidden(self, row: int, hidden: np.ndarray) -> None: ...

    def pick(self, row: int) -> RowPick | None: ...

    def accept(self, row: int, token: int, drew_second: bool) -> int | None: ...


@dataclass
class Forward:
    logits: torch.Tensor  # [B, vocab] fp32, device
    hidden: torch.Tensor  # [N, hidden], device
    first: list[int]  # each row's first token in `hidden`


class PagedLlmEngine(DecodeLoop[Prefill, Forward, RowDriver]):
    name = "paged"

    def __init__(self, model: PagedDecoder, traffic: Traffic) -> None:
        self.model = model
        self.pool = model.pool
        self.traffic = traffic
        self.device = model.device
        self.sampler: DeviceSampler | None = None

    def use_rules(self, forbidden: np.ndarray, tokens: SpecialTokens) -> None:
        """The rule sets' forbidden tokens [DUPLEX / CHAT, vocab], uploaded once: the stage's decode rules own them."""
        self.sampler = DeviceSampler(forbidden, tokens, self.device, self.traffic)

    @classmethod
    def build(cls, weights: dict[str, torch.Tensor], dims: DecoderDims, **build: Any) -> PagedLlmEngine:
        """`build`: `build.build_decoder`'s settings (the pool's size, dtypes, attention backend)."""
        model = build_decoder(weights, dims, **build)
        return cls(model, model.pool.traffic)

    def forward(self, seqs: list[int], pasts: list[int], feeds: list[Prefill]) -> Forward:
        up = self.traffic.upload
        ids = up("inputs", np.concatenate([p.ids for p in feeds]).astype(np.int64), self.device)
        x = self.model.embed(ids)
        if any(p.use.any() for p in feeds):
            use = up("inputs", np.concatenate([p.use for p in feeds]), self.device)
            x[use] = up("inputs", np.concatenate([p.embeds for p in feeds if p.use.any()]), self.device).to(x.dtype)
        hidden, rows, last = packed_forward(self.model, self.traffic, seqs, pasts, [len(p) for p in feeds], x)
        return Forward(self.model.logits(hidden[last]), hidden, rows.start)

    def hidden_rows(self, out: Forward, positions: list[int]) -> np.ndarray:
        index = self.traffic.upload("inputs", [out.first[p] for p in positions], self.device)
        return self.traffic.download("outputs", out.hidden[index].to(torch.float32))

    def decide(self, out: Forward, rows: list[int], driver: RowDriver) -> dict[int, Prefill]:
        wants = [pos for pos, row in enumerate(rows) if driver.wants_hidden(row)]
        if wants:
            for pos, vec in zip(wants, self.hidden_rows(out, wants), strict=True):
                driver.add_hidden(rows[pos], vec)
        asked, picks, logits = asking(out.logits, rows, driver.pick, self.traffic, self.device)
        if not picks:
            return {}
        assert self.sampler is not None, "use_rules first"
        picked = self.sampler.pick(logits, picks)
        feed = {}
        for row, tok, second in zip(asked, picked.tokens, picked.drew_second, strict=True):
            nxt = driver.accept(row, int(tok), bool(second))
            if nxt is not None:
                feed[row] = Prefill(np.array([nxt], np.int64), np.zeros((0, 1), np.float32), np.zeros(1, bool))
        return feed


def load_paged_engine(folder: Path, dims: DecoderDims, device: str, context_tokens: int, **build: Any
                      ) -> PagedLlmEngine:
    """The paged engine over the exported LLM weights (`folder`/weights.safetensors) on `device`."""
    return PagedLlmEngine.build(load_weights(folder, device), dims, device=device, max_tokens=context_tokens,
                                **build)

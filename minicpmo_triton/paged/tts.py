"""The paged TTS engine: MiniCPM-o 4.5's TTS Llama over a KV pool of its own (its layers and heads are not the
LLM's), the same `PagedDecoder` layers and attention, its own inputs and head around them.

A forward packs every row's new positions (a chunk's condition, or one fed-back code) with no padding, writes
their keys and values into the pool in place and returns each row's last logits over the speech codes. The
input is `DuplexTTS.forward`'s (export/modules/tts.py): emb_text(id) + L2norm(projector_semantic(h)) where a
text token has an LLM hidden state, emb_code(code) where the position is a code. The logits [B, 6562] stay on
the device: the stage's sampling rules run there (`tts_sampler`), and only each row's code comes back, so a
step's bytes are a few dozen per row whatever the turn's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.nn import functional

from ..model_config import TtsDims
from .build import build_decoder, load_weights
from .loop import DecodeLoop, asking, packed_forward
from .model import PagedDecoder
from .protocol import TtsPick, TtsRules
from .tts_sampler import TtsSampler


@dataclass
class TtsFeed:
    """One row's new positions."""

    text_ids: np.ndarray  # [n] int64 (0 where the position is a code)
    hidden: np.ndarray  # [k, llm_hidden] the LLM hidden states of the k positions `has_hidden` marks, in order
    has_hidden: np.ndarray  # [n] bool
    code_ids: np.ndarray  # [n] int64
    is_code: np.ndarray  # [n] bool

    def __len__(self) -> int:
        return len(self.text_ids)


class TtsDriver(Protocol):
    """The stage's side of the loop: a row's next pick (None: it is done), and what to feed after its code (None:
    the chunk is over). `accept` is given -1 where the row's logits were not finite (it raises for that row)."""

    def pick(self, row: int) -> TtsPick | None: ...

    def accept(self, row: int, code: int) -> int | None: ...


class PagedTtsEngine(DecodeLoop[TtsFeed, torch.Tensor, TtsDriver]):
    name = "paged"

    def __init__(self, model: PagedDecoder, tts: TtsDims) -> None:
        self.model = model
        self.pool = model.pool
        self.traffic = model.pool.traffic
        self.device = model.device
        self.normalize = tts.normalize_projected_hidden
        self.llm_hidden = model.w["projector_semantic.linear1.weight"].shape[1]
        self.sampler: TtsSampler | None = None

    def use_rules(self, rules: TtsRules) -> None:
        """The sampling rules' settings: the stage owns them."""
        self.sampler = TtsSampler(rules, self.device, self.traffic)

    @classmethod
    def build(cls, weights: dict[str, torch.Tensor], tts: TtsDims, **build: Any) -> PagedTtsEngine:
        """`build`: `build.build_decoder`'s settings (the pool's size, dtypes, attention backend)."""
        return cls(build_decoder(weights, tts.decoder, **build), tts)

    def code_feed(self, code: int) -> TtsFeed:
        return TtsFeed(np.zeros(1, np.int64), np.zeros((0, self.llm_hidden), np.float32), np.zeros(1, bool),
                       np.array([code], np.int64), np.ones(1, bool))

    def _embed(self, feeds: list[TtsFeed]) -> torch.Tensor:
        w, up = self.model.w, self.traffic.upload
        x = w["emb_text.weight"][up("inputs", np.concatenate([f.text_ids for f in feeds]), self.device)]
        has = np.concatenate([f.has_hidden for f in feeds])
        if has.any():
            h = up("inputs", np.concatenate([f.hidden for f in feeds]), self.device).to(x.dtype)
            h = functional.linear(functional.relu(functional.linear(h, w["projector_semantic.linear1.weight"],
                                                                    w["projector_semantic.linear1.bias"])),
                                  w["projector_semantic.linear2.weight"], w["projector_semantic.linear2.bias"])
            if self.normalize:
                h = functional.normalize(h, p=2, dim=-1)
            x[up("inputs", has, self.device)] += h
        is_code = np.concatenate([f.is_code for f in feeds])
        if is_code.any():
            codes = up("inputs", np.concatenate([f.code_ids for f in feeds])[is_code], self.device)
            x[up("inputs", is_code, self.device)] = w["emb_code.0.weight"][codes]
        return x

    def forward(self, seqs: list[int], pasts: list[int], feeds: list[TtsFeed]) -> torch.Tensor:
        """Each row's next-code logits [B, num_audio_tokens] fp32, on the device; the rows' positions are written
        into the pool at past .. past + len(feed) - 1."""
        hidden, _, last = packed_forward(self.model, self.traffic, seqs, pasts, [len(f) for f in feeds],
                                         self._embed(feeds))
        return functional.linear(hidden[last], self.model.w["head_code.0.weight"]).to(torch.float32)

    def decide(self, out: torch.Tensor, rows: list[int], driver: TtsDriver) -> dict[int, TtsFeed]:
        asked, picks, logits = asking(out, rows, driver.pick, self.traffic, self.device)
        if not picks:
            return {}
        assert self.sampler is not None, "use_rules first"
        codes, bad = self.sampler.pick(logits, picks)
        feed = {}
        for row, code, broken in zip(asked, codes, bad, strict=True):
            nxt = driver.accept(row, -1 if broken else int(code))
            if nxt is not None:
                feed[row] = self.code_feed(nxt)
        return feed


def load_paged_tts(folder: Path, tts: TtsDims, device: str, **build: Any) -> PagedTtsEngine:
    """The paged TTS over the exported TTS weights (`folder`/weights.safetensors) on `device`."""
    return PagedTtsEngine.build(load_weights(folder, device), tts, device=device, **build)

"""The paged TTS engine: MiniCPM-o 4.5's TTS Llama over a KV pool of its own (its layers and heads are not the
LLM's), the same `PagedDecoder` layers and attention, its own inputs and head around them.

A forward packs every row's new positions (a chunk's condition, or one fed-back code) with no padding, writes
their keys and values into the pool in place and returns each row's last logits over the speech codes. The
input is `DuplexTTS.forward`'s (export/modules/tts.py): emb_text(id) + L2norm(projector_semantic(h)) where a
text token has an LLM hidden state, emb_code(code) where the position is a code. The logits [B, 6562] come to
the host for the stage's sampling rules (top-k 20 / top-p 0.7 and the per-occurrence repetition penalty: not on
the device yet); they are as wide whatever the history, so a step's bytes do not grow with the turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from ..model_config import TtsDims
from .attention import Rows
from .build import build_decoder, load_weights
from .model import PagedDecoder


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


Choose = Callable[[int, np.ndarray], "int | None"]  # (row, its logits) -> the code to feed next, or None: done


class PagedTtsEngine:
    name = "paged"

    def __init__(self, model: PagedDecoder, tts: TtsDims) -> None:
        self.model = model
        self.pool = model.pool
        self.traffic = model.pool.traffic
        self.device = model.device
        self.normalize = tts.normalize_projected_hidden
        self.llm_hidden = model.w["projector_semantic.linear1.weight"].shape[1]

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

    def logits(self, seqs: list[int], pasts: list[int], feeds: list[TtsFeed]) -> np.ndarray:
        """Each row's next-code logits [B, num_audio_tokens] fp32, on the host; the rows' positions are written
        into the pool at past .. past + len(feed) - 1."""
        counts = [len(f) for f in feeds]
        for seq, past, n in zip(seqs, pasts, counts, strict=True):
            self.pool.reserve(seq, past + n)  # a no-op when the stage reserved the chunk at its check
        rows = Rows(self.pool.block_table(seqs, [p + n for p, n in zip(pasts, counts, strict=True)]), pasts, counts)
        up = self.traffic.upload
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(pasts, counts, strict=True)])
        slots = torch.cat([self.pool.slots(s, p, n) for s, p, n in zip(seqs, pasts, counts, strict=True)])
        hidden = self.model.forward(self._embed(feeds), up("inputs", positions, self.device),
                                    up("inputs", slots, self.device), rows)
        last = up("inputs", [s + n - 1 for s, n in zip(rows.start, counts, strict=True)], self.device)
        logits = functional.linear(hidden[last], self.model.w["head_code.0.weight"]).to(torch.float32)
        return self.traffic.download("logits", logits)

    def run(self, seqs: list[int], pasts: list[int], feeds: list[TtsFeed], choose: Choose) -> list[int]:
        """Prefill every row, then one batched forward per code until every row's `choose` says it is done (rows
        that finish leave the batch at once). Returns each row's new length."""
        lengths = list(pasts)
        feed: dict[int, TtsFeed] = dict(enumerate(feeds))
        while feed:
            rows = list(feed)
            logits = self.logits([seqs[r] for r in rows], [lengths[r] for r in rows], [feed[r] for r in rows])
            for r in rows:
                lengths[r] += len(feed[r])
            feed = {}
            for r, row_logits in zip(rows, logits, strict=True):
                code = choose(r, row_logits)
                if code is not None:
                    feed[r] = self.code_feed(code)
        return lengths


def load_paged_tts(folder: Path, tts: TtsDims, device: str, **build: Any) -> PagedTtsEngine:
    """The paged TTS over the exported TTS weights (`folder`/weights.safetensors) on `device`."""
    return PagedTtsEngine.build(load_weights(folder, device), tts, device=device, **build)

"""What the host's decode rules and the paged engine exchange (no torch here: the stages import it on any host).

Per row and step the host sends a `RowPick` (its rule set, a teacher-forced token, the repetition window, the
sampling settings, its uniform draws) and gets a token back (`Picked`); a forward's rows bring a `Prefill`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..sampling import SamplingParams

DUPLEX, CHAT = 0, 1  # rule sets: rows of the forbidden-token masks


@dataclass(frozen=True)
class PagedCache:
    """A session's place in a paged engine's KV pool: its id there and how many of its tokens are real (the
    pool may hold more blocks: they are given back after the step, or reused)."""

    seq: int
    length: int

    def truncated(self, length: int) -> PagedCache:
        return PagedCache(self.seq, length)


@dataclass
class Prefill:
    ids: np.ndarray  # [n] int64
    embeds: np.ndarray  # [rows of `use`, hidden] the embeddings spliced in where `use`
    use: np.ndarray  # [n] bool

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class RowPick:
    kind: int  # DUPLEX or CHAT
    params: SamplingParams
    forced: int = -1  # >= 0: decided in place of a draw (teacher forcing)
    history: list[int] = field(default_factory=list)  # the repetition window
    length_penalty: float = 1.0  # duplex: on <|turn_eos|>
    u: tuple[float, float] = (0.0, 0.0)  # the row's uniform draws (duplex: first and second; chat: one)
    rewind: Any = None  # the rng's state after the first draw, restored when the second was not needed


@dataclass(frozen=True)
class TtsRules:
    """The TTS sampling rules' settings, the same for every row (the preset's `duplex.tts_*`)."""

    eos: int
    top_k: int
    top_p: float
    repetition_penalty: float


@dataclass
class TtsPick:
    """A TTS row's next code: what the stage's rules need beyond the logits (`TtsStage.choose`)."""

    temperature: float  # 0: greedy
    history: list[int]  # the chunk's codes in the repetition window, penalised once per occurrence
    allow_eos: bool  # False mid-turn until the chunk is a full second
    u: float = 0.0  # the row's uniform draw (sampled rows)


@dataclass
class Picked:
    tokens: np.ndarray  # [B] int64
    drew_second: np.ndarray  # [B] bool: a duplex row went past its first draw (the token joins the history)


def pick_engine(choice: str, cuda: bool, key: str = "llm_engine") -> str:
    """`auto`: the paged engine on CUDA (the state stays on the GPU); on the CPU, ONNX (it measured faster on tiny:
    docs/performance.md); `paged` / `onnx` to choose. `key`: the setting's name (llm_engine, tts_engine)."""
    if choice not in ("auto", "paged", "onnx"):
        raise ValueError(f"{key} must be auto, paged or onnx, not {choice!r}")
    return ("paged" if cuda else "onnx") if choice == "auto" else choice


def pick_llm_engine(choice: str, cuda: bool) -> str:
    return pick_engine(choice, cuda, "llm_engine")

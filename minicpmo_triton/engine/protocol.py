"""What the stages and the engine core exchange (no torch here: the stages import it on any host).

A stage turns each call into a `Request` for the core (engine/request.py) carrying its prefill (`Prefill`) and, when
it decodes, its row's device rules as plain numbers (`LlmRow`, `TtsRow`: set once when the row is admitted, never
per token). A session's place in a pool is a `PagedCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

DUPLEX, CHAT = 0, 1  # rule sets: rows of the forbidden-token masks

# what the device reports per row and iteration, beside the token (engine/llm_head.py, engine/tts_head.py)
DREW_SECOND = 1  # a duplex row went past its first draw (the token joins the history, two uniforms used)
NOT_FINITE = 2  # the row's logits were not finite: its error, never a token
ENDED = 4  # the device's rules end the row with this token (the host's confirm decides; they agree)
NO_TOKEN = 8  # the chunk's budget was spent before this draw (duplex `must_end`): nothing was chosen


@dataclass(frozen=True)
class PagedCache:
    """A session's place in a KV pool: its id there and how many of its tokens are real (the pool may hold more
    blocks: they are given back after the step, or reused)."""

    seq: int
    length: int

    def truncated(self, length: int) -> PagedCache:
        return PagedCache(self.seq, length)


@dataclass
class Prefill:
    """One row's new positions: token ids, with embeddings spliced in where `use` (audio, images). `embeds` may be
    a device tensor (the streaming Whisper's output, never brought to the host) or a host array."""

    ids: np.ndarray  # [n] int64
    embeds: Any  # [rows of `use`, hidden]: np.ndarray or torch.Tensor
    use: np.ndarray  # [n] bool

    def __len__(self) -> int:
        return len(self.ids)

    def part(self, start: int, stop: int) -> Prefill:
        """Positions [start, stop) (a chunk of a long prefill), with their embeddings."""
        if start == 0 and stop == len(self.ids):
            return self
        first = int(self.use[:start].sum())
        n = int(self.use[start:stop].sum())
        return Prefill(self.ids[start:stop], self.embeds[first: first + n], self.use[start:stop])


@dataclass
class TtsFeed:
    """A TTS chunk's condition: text ids (audio_bos last), the LLM hidden states of its first `len(hidden)`
    positions."""

    text_ids: np.ndarray  # [n] int64
    hidden: Any  # [k, llm_hidden], k < n: np.ndarray (or the LLM's hidden rows where they are, a torch.Tensor)

    def __len__(self) -> int:
        return len(self.text_ids)

    def part(self, start: int, stop: int) -> TtsFeed:
        return TtsFeed(self.text_ids[start:stop], self.hidden[start: min(stop, len(self.hidden))])


@dataclass
class LlmRow:
    """A decoding LLM row's rules, as numbers the device keeps for the row's life in the batch."""

    kind: int  # DUPLEX or CHAT
    temperature: float  # 0: greedy
    top_k: int  # 0: the whole vocabulary
    top_p: float
    repetition_penalty: float
    length_penalty: float  # duplex: on <|turn_eos|>
    max_new: int  # duplex: the chunk's budget (its last step is <|chunk_eos|> without a draw); chat: tokens
    history: list[int]  # the repetition window as the row starts (duplex draws or chat tokens)
    forced: list[int]  # teacher-forced tokens, in order (chat: -1 where its rules refuse the token: a draw)
    turn_ended: bool  # duplex: no turn open as the chunk starts
    uniforms: np.ndarray  # the session rng's draws for the whole budget, in the order the host would make them
    hidden_at_prefill: bool = False  # the prefill's first token is text (a chat chunk's carried token)


@dataclass
class TtsRow:
    """A TTS chunk's rules as numbers (the stage's `TtsRows`): sampled at `temperature` (0: greedy), EOS allowed or
    not, `n_tokens` codes kept (the next one is chosen and dropped), the rng's draws for each code."""

    temperature: float
    allow_eos: bool
    n_tokens: int
    uniforms: np.ndarray


@dataclass(frozen=True)
class TtsRules:
    """The TTS sampling rules' settings, the same for every row (the preset's `duplex.tts_*`)."""

    eos: int
    top_k: int  # 0: the whole vocabulary
    top_p: float  # 1.0: off
    repetition_penalty: float
    window: int = 16


def pick_engine(choice: str, cuda: bool, key: str = "llm_engine") -> str:
    """`auto`: the device engine on CUDA (the state stays on the GPU); on the CPU, ONNX (it measured faster on tiny:
    docs/performance.md); `paged` / `onnx` to choose. `key`: the setting's name (llm_engine, tts_engine)."""
    if choice not in ("auto", "paged", "onnx"):
        raise ValueError(f"{key} must be auto, paged or onnx, not {choice!r}")
    return ("paged" if cuda else "onnx") if choice == "auto" else choice


def tts_in_llm(choice: str, llm_engine: str, tts_engine: str, cuda: bool) -> bool:
    """`tts_in_llm`: whether the llm model runs the TTS's engine core too (one request per speaking step). auto: where
    the LLM and the TTS both resolve to the device engine; 1 asks for it and needs the LLM's device engine (the
    in-process TTS is the device one whatever `tts_engine` says); 0: the tts model, a hop of its own."""
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"tts_in_llm must be auto, 0 or 1, not {choice!r}")
    llm_paged = pick_engine(llm_engine, cuda) == "paged"
    if choice == "1" and not llm_paged:
        raise ValueError("tts_in_llm = 1 needs llm_engine on the device engine (paged)")
    return choice == "1" or (choice == "auto" and llm_paged and pick_engine(tts_engine, cuda, "tts_engine") == "paged")


def token2wav_on_device(stage_engine: str, cuda: bool) -> bool:
    """Whether token2wav's `stage_engine` resolves to its device path (the torch streamer) on this machine."""
    return stage_engine == "device" or (stage_engine == "auto" and cuda)


def token2wav_in_llm(choice: str, tts_here: bool, on_device: bool) -> bool:
    """`token2wav_in_llm`: whether the llm model runs token2wav too (its speaking step's one request answers with
    audio). auto: where the llm model runs the TTS (`tts_here`) and token2wav's placement is the device
    (`on_device`); 1 asks for it (its path then as `stage_engine` says) and needs the TTS there; 0: the token2wav
    model, a hop of its own."""
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"token2wav_in_llm must be auto, 0 or 1, not {choice!r}")
    if choice == "1" and not tts_here:
        raise ValueError("token2wav_in_llm = 1 needs tts_in_llm (the llm model runs the TTS whose codes it voices)")
    return choice == "1" or (choice == "auto" and tts_here and on_device)

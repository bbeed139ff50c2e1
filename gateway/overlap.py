"""What to do with the caller's audio while the assistant is speaking (pure code).

- below an RMS floor: noise, `drop` it;
- a short backchannel ("ok", "mm-hm", "嗯"; or speech shorter than `short_ack_ms`): `listen`, the
  assistant keeps speaking;
- sustained speech (`barge_in_ms` or more), or any VAD onset under `barge_in_on_speech`: `barge_in`.
Speech between the two bounds is kept as `listen` while it lasts; the decision is reported each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

POLICIES = ("listen_only", "barge_in_on_speech", "sustained_speech")
BACKCHANNELS = frozenset({
    "ok", "okay", "yes", "yeah", "yep", "right", "sure", "uh-huh", "uh huh", "mm", "mhm", "mm-hm", "hmm", "go on",
    "i see", "got it", "嗯", "对", "好", "好的", "是", "嗯嗯", "对对",
})


def is_backchannel(hint: str | None) -> bool:
    return hint is not None and hint.strip().lower().strip(".!?,。！？") in BACKCHANNELS


def rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio, dtype=np.float64)))) if len(audio) else 0.0


@dataclass(frozen=True)
class OverlapSettings:
    policy: str = "sustained_speech"
    short_ack_ms: int = 700
    barge_in_ms: int = 1200
    silence_rms: float = 0.003


@dataclass(frozen=True)
class OverlapDecision:
    action: Literal["drop", "listen", "barge_in"]
    reason: str  # noise | backchannel | short_speech | sustained_speech | speech_onset | listen_only
    speech_ms: int


@dataclass
class OverlapPolicy:
    settings: OverlapSettings
    speech_ms: int = 0  # overlapping speech so far in this assistant turn

    def reset(self) -> None:
        self.speech_ms = 0

    def decide(self, audio: np.ndarray, speech_ms: int, vad_onset: bool = False,
               hint: str | None = None) -> OverlapDecision:
        """One piece of caller audio heard while the assistant speaks; `speech_ms`: how much of it is speech."""
        s = self.settings
        if rms(audio) < s.silence_rms or (speech_ms == 0 and not vad_onset):
            self.speech_ms = 0  # the caller paused: a later burst starts counting afresh
            return OverlapDecision("drop", "noise", 0)
        self.speech_ms += speech_ms
        if is_backchannel(hint):
            return OverlapDecision("listen", "backchannel", self.speech_ms)
        if s.policy == "listen_only":
            return OverlapDecision("listen", "listen_only", self.speech_ms)
        if s.policy == "barge_in_on_speech" and vad_onset:
            return OverlapDecision("barge_in", "speech_onset", self.speech_ms)
        if self.speech_ms >= s.barge_in_ms:
            return OverlapDecision("barge_in", "sustained_speech", self.speech_ms)
        if self.speech_ms < s.short_ack_ms:
            return OverlapDecision("listen", "backchannel", self.speech_ms)
        return OverlapDecision("listen", "short_speech", self.speech_ms)

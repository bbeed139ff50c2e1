"""`token2wav_in_llm`: token2wav in the llm model's process, so a speaking duplex step's one Triton request answers its
text, then its audio (the TTS's codes never leave the process).

It is the stage the token2wav model builds (`Token2WavStage`), run the way that model runs it: where its placement is
the device, its streamer's engine thread (`InflightToken2Wav`), which batches every session's chunks in flight; else
its host path, one call at a time on a thread of its own (never on the LLM's or the TTS's engine thread). Either way a
call with a new voice reference waits for its prompt on `VoicePreparer`'s worker, off those threads, within the same
`voice_prep_queue` bound (`queue_full`), and the answer comes through the call's `answer`, on whichever thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..stage_io import Token2WavRequest
from .base import StageCall
from .token2wav import Token2WavStage
from .voice_prep import Answer, VoicePreparer

if TYPE_CHECKING:
    from .token2wav_inflight import InflightToken2Wav


class LocalToken2Wav:
    """token2wav of one llm model instance: `submit` a call, its answer comes back through `answer`."""

    def __init__(self, stage: Token2WavStage, inflight: InflightToken2Wav | None, max_queued: int,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.stage = stage
        self.inflight = inflight
        self.on_change = on_change  # the live-sequence gauge: after a call's answer
        self.voices = VoicePreparer(stage, max_queued, submit=None if inflight is None else inflight.submit)
        # the host path's one thread: a call's ONNX work never holds the TTS's engine thread, which hands it the codes
        self._host = None if inflight is not None else ThreadPoolExecutor(1, thread_name_prefix="token2wav")

    def submit(self, call: StageCall[Token2WavRequest], answer: Answer) -> None:
        if self._host is None:
            self.voices.serve([call], [answer])  # queued on the engine thread (a new voice: once prepared)
        else:
            self._host.submit(self._serve_host, call, answer)

    def _serve_host(self, call: StageCall[Token2WavRequest], answer: Answer) -> None:
        with self.voices.lock:  # here the store has one user between calls: idle sessions go now
            if self.stage.store.evict_expired():
                self.on_change()
        self.voices.serve([call], [answer], after=self.on_change)

    def close(self) -> None:
        if self._host is not None:
            self._host.shutdown(wait=True, cancel_futures=True)
        self.voices.close()
        if self.inflight is not None:
            self.inflight.close()

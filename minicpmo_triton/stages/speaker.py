"""`tts_in_llm`: the TTS's engine core in the llm model's process, so a speaking duplex step is one Triton request.

The LLM's engine thread answers a call; when the call asked to speak (`LlmRequest.speak`) and its row spoke, the
answer goes out at once without the final flag (the duplex model emits the text), and the TTS's chunk is built from
it here (`stage_io.speech_request`: the text ids and their hidden rows, handed over inside the process) and queued on
the TTS's own engine thread (`InflightTts`), which joins it to its running decode between two iterations and answers
it, with the final flag, in the iteration its last code is chosen (a refusal as `SpeechRefused`). No Triton hop, no
tts batcher delay between them.

Every other use of the TTS comes here too (`voice`: a turn-based reply's chunks, sent to the llm model as TTS calls,
`stage_io.SPEECH_CALL`), so a GPU holds one TTS engine core and one TTS pool: the tts model holds none on this path.

The TTS's sequence follows the LLM's: started with a session's first spoken chunk (a refused start is ENDed at
once, and the next spoken chunk starts it again, as the duplex pipeline does with the tts model), ENDed with the
LLM's END, whose final answer waits for it (the session's TTS blocks are back when the caller hears the END).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ..stage_io import LlmRequest, SpeechRefused, TtsRequest, speech_request, spoke
from .base import StageCall
from .inflight import InflightLoop, Reply

Send = Callable[[Any, bool], None]  # (a result or an error, whether it is the call's last response)
END_ONLY = TtsRequest(n_tokens=0)  # what an END alone asks of the TTS (no work: its state is freed)
NO_HIDDEN = np.zeros((0, 0), np.float32)


class Speaker:
    """The in-process TTS of one llm model instance: which sessions it has started, and the LLM's answers that
    go on to it."""

    def __init__(self, tts: InflightLoop[Any, Any]) -> None:
        self.tts = tts
        self._started: set[int] = set()  # sessions whose TTS sequence is live (both engine threads read it)
        self._lock = threading.Lock()

    def reply(self, call: StageCall[LlmRequest], send: Send) -> Reply:
        """The answer to an LLM call, called on the LLM's engine thread once its row is done."""
        def answer(result: Any) -> None:
            if call.start:  # a new sequence: its TTS starts again with its first spoken chunk
                self._forget(call.corr_id)
            if not isinstance(result, Exception) and spoke(call.request, result):
                send(replace(result, tts_hidden=NO_HIDDEN), False)  # the rows go on to the TTS, not to the caller
                # a refusal as a tensor, not an error response: one after a first response never reaches a BLS caller
                self._speak(call.corr_id, call.end, speech_request(call.request, result), send, SpeechRefused.of)
            elif call.end and self._forget(call.corr_id):
                self.tts.submit(StageCall(END_ONLY, call.corr_id, end=True),
                                lambda ended: send(ended if _failed(ended, result) else result, True))
            else:
                send(result, True)

        return answer

    def voice(self, call: StageCall[TtsRequest], send: Send) -> None:
        """A TTS chunk sent on its own (a turn-based reply's voice), on the session's TTS sequence as a spoken
        duplex step's; its refusal is its one response, an error."""
        self._speak(call.corr_id, False, call.request, send, lambda exc: exc)

    def _speak(self, corr: int, end: bool, request: TtsRequest, send: Send,
               refusal: Callable[[Exception], Any]) -> None:
        """`request` on the TTS's thread, the session's TTS sequence started first where it is not live; `refusal`:
        what a refused chunk is answered with."""
        with self._lock:
            start = corr not in self._started
            if not end:
                self._started.add(corr)
            else:
                self._started.discard(corr)

        def spoken(result: Any) -> None:  # on the TTS's engine thread
            if not isinstance(result, Exception):
                send(result, True)
                return
            if start and not end and self._forget(corr):
                # a refused start: the state it made is ENDed now (queued before any later chunk of the session)
                self.tts.submit(StageCall(END_ONLY, corr, end=True), lambda _: None)
            send(refusal(result), True)

        self.tts.submit(StageCall(request, corr, start=start, end=end), spoken)

    def _forget(self, corr_id: int) -> bool:
        """The session's TTS sequence is no longer live; whether it was."""
        with self._lock:
            was = corr_id in self._started
            self._started.discard(corr_id)
        return was

    def close(self) -> None:
        self.tts.close()


def _failed(ended: Any, result: Any) -> bool:
    """The END's answer is the TTS's error only when the LLM's own answer was not one."""
    return isinstance(ended, Exception) and not isinstance(result, Exception)

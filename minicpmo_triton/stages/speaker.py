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

`token2wav_in_llm`: token2wav runs here too (`LocalToken2Wav`), and the TTS's codes go on to it in the process: the
second response is their audio and count (`VoicedSpeech`), not the codes. token2wav's call is the one the duplex
pipeline would send the token2wav model (`stage_io.voice_request`: the turn's restart and voice from the LLM call, the
LLM's end of turn as `finalize`); its sequence too is started with the session's first voiced chunk (a refused start
ENDed at once, started again by the next chunk) and ENDed with the LLM's END, after the TTS's, before the final answer.
A refusal of either, after the text, is the second response's `SpeechRefused`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..stage_io import (
    LlmRequest,
    SpeechRefused,
    Token2WavRequest,
    TtsRequest,
    VoicedSpeech,
    speech_request,
    spoke,
    voice_request,
)
from .base import StageCall
from .inflight import InflightLoop, Reply

if TYPE_CHECKING:
    from .token2wav_local import LocalToken2Wav

Send = Callable[[Any, bool], None]  # (a result or an error, whether it is the call's last response)
Done = Callable[[Any], None]  # a stage's answer (a result or an error), on whichever thread gives it
END_ONLY = TtsRequest(n_tokens=0)  # what an END alone asks of the TTS (no work: its state is freed)
END_VOICE = Token2WavRequest()  # ... and of token2wav
NO_HIDDEN = np.zeros((0, 0), np.float32)


class _Live:
    """The sessions whose sequence on one in-process stage is live (both engine threads read it)."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._lock = threading.Lock()

    def take(self, corr_id: int, end: bool) -> bool:
        """A call of the session goes to the stage (`end`: its last): whether it starts the sequence."""
        with self._lock:
            start = corr_id not in self._ids
            if end:
                self._ids.discard(corr_id)
            else:
                self._ids.add(corr_id)
            return start

    def forget(self, corr_id: int) -> bool:
        """The session's sequence is no longer live; whether it was."""
        with self._lock:
            was = corr_id in self._ids
            self._ids.discard(corr_id)
            return was


def _unstart(live: _Live, stage: Any, end_only: Any, corr: int) -> None:
    """A refused start on an in-process stage: the state it made is ENDed now (queued before any later chunk of the
    session, which starts the sequence again)."""
    if live.forget(corr):
        stage.submit(StageCall(end_only, corr, end=True), lambda _: None)


class Speaker:
    """The in-process TTS (and token2wav, `token2wav_in_llm`) of one llm model instance: which sessions it has
    started on each, and the LLM's answers that go on to them."""

    def __init__(self, tts: InflightLoop[Any, Any], vocoder: LocalToken2Wav | None = None) -> None:
        self.tts = tts
        self.vocoder = vocoder
        self._tts_live = _Live()
        self._voice_live = _Live()

    def reply(self, call: StageCall[LlmRequest], send: Send) -> Reply:
        """The answer to an LLM call, called on the LLM's engine thread once its row is done."""
        def answer(result: Any) -> None:
            if call.start:  # a new sequence: its TTS and token2wav start again with its first spoken chunk
                self._tts_live.forget(call.corr_id)
                self._voice_live.forget(call.corr_id)
            if not isinstance(result, Exception) and spoke(call.request, result):
                send(replace(result, tts_hidden=NO_HIDDEN), False)  # the rows go on to the TTS, not to the caller
                voice = None if self.vocoder is None else voice_request(call.request, result)
                # a refusal as a tensor, not an error response: one after a first response never reaches a BLS caller
                self._speak(call.corr_id, call.end, speech_request(call.request, result), voice, send,
                            SpeechRefused.of)
            elif call.end:
                self._end(call.corr_id, lambda failed: send(result if failed is None or isinstance(
                    result, Exception) else failed, True))  # the END's failure only where the LLM's answer is none
            else:
                send(result, True)

        return answer

    def voice(self, call: StageCall[TtsRequest], send: Send, voice: Token2WavRequest | None = None) -> None:
        """A TTS chunk sent on its own (a turn-based reply's voice), on the session's TTS sequence as a spoken
        duplex step's, and its codes on to token2wav where it runs here (`voice`: its call, the codes left out);
        its refusal is its one response, an error."""
        request = None
        if self.vocoder is not None:
            request = replace(voice or Token2WavRequest(turn_start=call.request.turn_start),
                              finalize=call.request.turn_end)
        self._speak(call.corr_id, False, call.request, request, send, lambda exc: exc)

    def _speak(self, corr: int, end: bool, request: TtsRequest, voice: Token2WavRequest | None, send: Send,
               refusal: Callable[[Exception], Any]) -> None:
        """`request` on the TTS's thread, the session's TTS sequence started first where it is not live; its codes
        then to `voice` (token2wav's call) where token2wav runs here; `refusal`: what a refused chunk is answered
        with."""
        start = self._tts_live.take(corr, end)

        def spoken(result: Any) -> None:  # on the TTS's engine thread
            if isinstance(result, Exception):
                if start and not end:
                    _unstart(self._tts_live, self.tts, END_ONLY, corr)
                if end:  # the session's last call: its token2wav sequence goes with it
                    self._end_voice(corr, lambda _: send(refusal(result), True))
                else:
                    send(refusal(result), True)
            elif voice is None:
                send(result, True)
            else:
                self._voice(corr, end, replace(voice, speech_tokens=result.speech_tokens), send, refusal)

        self.tts.submit(StageCall(request, corr, start=start, end=end), spoken)

    def _voice(self, corr: int, end: bool, request: Token2WavRequest, send: Send,
               refusal: Callable[[Exception], Any]) -> None:
        """The codes' audio from the in-process token2wav, its sequence started first where it is not live."""
        vocoder = self.vocoder
        assert vocoder is not None
        start = self._voice_live.take(corr, end)
        n_codes = len(request.speech_tokens)

        def voiced(result: Any) -> None:  # on token2wav's engine thread, its host thread or the voice preparer's
            if not isinstance(result, Exception):
                send(VoicedSpeech(result.waveform, n_codes), True)
                return
            if start and not end:
                _unstart(self._voice_live, vocoder, END_VOICE, corr)
            send(refusal(result), True)

        vocoder.submit(StageCall(request, corr, start=start, end=end), voiced)

    def _end(self, corr: int, then: Done) -> None:
        """The session's TTS sequence, then its token2wav sequence, ENDed where live; `then` gets the first failure
        (None: none)."""
        def tts_ended(ended: Any) -> None:
            self._end_voice(corr, lambda voiced: then(ended if isinstance(ended, Exception) else voiced))

        if self._tts_live.forget(corr):
            self.tts.submit(StageCall(END_ONLY, corr, end=True), tts_ended)
        else:
            tts_ended(None)

    def _end_voice(self, corr: int, then: Done) -> None:
        """The session's token2wav sequence ENDed where live; `then` gets its failure (None: none)."""
        if self.vocoder is None or not self._voice_live.forget(corr):
            then(None)
            return
        self.vocoder.submit(StageCall(END_VOICE, corr, end=True),
                            lambda ended: then(ended if isinstance(ended, Exception) else None))

    def close(self) -> None:
        self.tts.close()
        if self.vocoder is not None:
            self.vocoder.close()

"""Turn-taking in the OpenAI Realtime dialect, one object per mode (pure code): who ends the caller's turn and who
opens a response. The session's config chooses the mode (`turn_taking`, again after each `session.update`); the
dialect (`openai.OpenAIRealtimeState`) asks its mode and never which mode it is.

- `Duplex` (where the URL opted in, `openai_extensions`): every second of caller audio is a duplex step and the
  model decides whether to speak; a spoken turn opens a response and its end closes it. While the assistant
  speaks, the overlap policy judges the caller's audio: noise is dropped, a backchannel is heard and the reply
  goes on, sustained speech barges in. The conversation is a record (the model's context is its KV cache).
- `ServerVad` (`server_vad`, the default as OpenAI's, and `semantic_vad`: the same VAD, its silence set by its
  eagerness): the VAD segments the caller's speech; its end commits the buffer as a user item and starts a
  response (a chat turn over the conversation); speech during a reply interrupts it.
- `Manual` (`turn_detection: null`): the client commits and asks for responses itself.

A mode keeps what only it needs (the speech segmenter, the overlap policy); the session's data (the caller's
duplex audio, the input buffer, the conversation, the open response) stays with the session (`Host`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from minicpmo_triton.duplex_contract import Context, StepInput

from ..audio import INPUT_RATE
from ..codes import ClientCode
from ..inputs import MAX_FRAMES
from ..limits import Limits
from ..overlap import OverlapPolicy, rms
from ..vad import WINDOW_MS, SpeechSegmenter
from ..wire import ProtocolError, new_id
from . import openai_events as oe
from .openai_config import DUPLEX, RealtimeConfig
from .openai_conversation import Conversation, InputBuffer, Item
from .openai_duplex import DuplexInput, Mark
from .openai_extensions import Extensions
from .openai_input import Heard, whole_tenths
from .openai_response import Response
from .realtime_events import error_event
from .state import Effects, PlannedStep, ServerEvent

Step = PlannedStep[oe.ResponseCreate]  # a step of this dialect: its cause, a response.create (duplex)

MIN_COMMIT_MS = 100


class Host(Protocol):
    """What a mode reads and asks of the session it serves (`openai.OpenAIRealtimeState`)."""

    epoch: int
    limits: Limits
    conversation: Conversation
    duplex: DuplexInput[oe.ResponseCreate]
    buffer: InputBuffer
    to_say: Item | None

    @property
    def active(self) -> Response | None: ...

    def interrupt(self, reason: str, heard_ms: float | None = None) -> Effects: ...

    def respond(self, budget: int | None = None, instructions: str | None = None,
                metadata: dict[str, str] | None = None) -> Effects: ...


class TurnTaking:
    """A mode: each method is one point where the session's behaviour depends on who takes turns."""

    def __init__(self, config: RealtimeConfig, ext: Extensions, position_ms: int = 0) -> None:
        td = config.turn_detection
        self.config = config
        self.ext = ext
        # the caller's speech along the stream (VAD events carry its positions); fed where the mode reads speech
        self.segmenter = SpeechSegmenter(td.threshold, td.prefix_padding_ms, td.silence_ms, position_ms=position_ms)

    def reads_speech(self, responding: bool) -> bool:
        """Whether reading an append runs the VAD over it."""
        raise NotImplementedError

    def hear(self, s: Host, heard: Heard) -> Effects:
        """Caller audio (16 kHz float32, its speech probabilities beside it)."""
        raise NotImplementedError

    def commit(self, s: Host) -> Effects:
        """`input_audio_buffer.commit`."""
        raise NotImplementedError

    def check_item(self, s: Host, item: Item) -> None:
        """Whether a client's item may join the conversation: a `ProtocolError` if not (nothing changed yet)."""
        raise NotImplementedError

    def item_added(self, s: Host, item: Item) -> list[Step]:
        """A client's item joined the conversation: the steps it asks for."""
        raise NotImplementedError

    def create_response(self, s: Host, msg: oe.ResponseCreate, budget: int) -> Effects:
        """`response.create`, its fields checked."""
        raise NotImplementedError

    def room(self, s: Host, item: Item) -> None:
        """Whether `item` may join the conversation (limits.conversation), checked before anything changes."""
        raise NotImplementedError

    def trim(self, s: Host, item: Item) -> list[ServerEvent]:
        """After `item` joined: the items forgotten to keep within the bounds (`conversation.item.deleted`)."""
        raise NotImplementedError

    def rollback(self, s: Host, r: Response, always: bool = False) -> None:
        """A reply was cut to what was heard: what the model's context does about the rest."""
        raise NotImplementedError

    def interrupted(self) -> None:
        """A reply was interrupted."""

    def opening(self, r: Response, epoch: int) -> list[ServerEvent]:
        """What the mode says before a response's own opening events."""
        return []

    def closing(self, r: Response, epoch: int, status: str) -> list[ServerEvent]:
        """What the mode says after a response's own closing events."""
        return []


class TurnBased(TurnTaking):
    """Turns end by a commit (the client's, or the VAD's); a response is a chat turn over the conversation, which
    is what each response sends: past its bounds the caller deletes items, else `conversation_full`."""

    def commit(self, s: Host) -> Effects:
        return self.commit_buffer(s, None)

    def commit_buffer(self, s: Host, item_id: str | None) -> Effects:
        """The input buffer becomes a user item (`item_id`: the one the VAD announced)."""
        item = Item(item_id or new_id("item"), "user", audio=committable(s.buffer.take()))
        self.room(s, item)
        previous = s.conversation.add(item)
        return Effects([
            *self.trim(s, item),
            oe.BufferCommitted(item.id, previous),
            oe.ItemAdded(previous, item.to_dict()),
            oe.ItemDone(item.to_dict()),
        ])

    def check_item(self, s: Host, item: Item) -> None:
        pass

    def item_added(self, s: Host, item: Item) -> list[Step]:
        return []

    def create_response(self, s: Host, msg: oe.ResponseCreate, budget: int) -> Effects:
        return s.respond(budget, msg.instructions, msg.metadata)

    def room(self, s: Host, item: Item) -> None:
        s.limits.conversation(len(s.conversation.items) + 1, s.conversation.nbytes() + item.nbytes)

    def trim(self, s: Host, item: Item) -> list[ServerEvent]:
        return []

    def rollback(self, s: Host, r: Response, always: bool = False) -> None:
        pass  # the next turn's messages carry the cut transcript; the LLM stage rebuilds


class Manual(TurnBased):
    def reads_speech(self, responding: bool) -> bool:
        return False

    def hear(self, s: Host, heard: Heard) -> Effects:
        if not s.buffer.room(len(heard.audio)):
            raise s.buffer.full()
        s.buffer.add(heard.audio)
        return Effects()


class ServerVad(TurnBased):
    def __init__(self, config: RealtimeConfig, ext: Extensions, position_ms: int = 0) -> None:
        super().__init__(config, ext, position_ms)
        self.speech_item: str | None = None  # the user item the caller's speech will be

    def reads_speech(self, responding: bool) -> bool:
        return True

    def hear(self, s: Host, heard: Heard) -> Effects:
        """A long append a second at a time: speech longer than the buffer holds is dropped, and said once."""
        out = Effects()
        full = False
        for piece in heard.pieces():
            if self.segmenter.in_speech and not s.buffer.room(len(piece.audio)):
                full = True
                continue
            out.extend(self._hear(s, piece))
        if full:
            out.events.append(error_event(s.buffer.full()))
        return out

    def _hear(self, s: Host, heard: Heard) -> Effects:
        td = self.config.turn_detection
        out = Effects()
        s.buffer.add(heard.audio)
        for vad_ev in self.segmenter.feed(heard.probs):
            if vad_ev.kind == "speech_started":
                self.speech_item = new_id("item")
                out.events.append(oe.SpeechStarted(vad_ev.audio_ms, self.speech_item))
                if s.active is not None and td.interrupt_response:
                    out.extend(s.interrupt("barge_in"))
            else:
                out.events.append(oe.SpeechStopped(vad_ev.audio_ms, self.speech_item))
                out.extend(self.commit_buffer(s, self.speech_item))
                if td.create_response and s.active is None:
                    out.extend(s.respond())
        if not self.segmenter.in_speech:  # before speech starts only its prefix padding is worth keeping
            s.buffer.keep_last(td.prefix_padding_ms * INPUT_RATE // 1000)
        return out


class Duplex(TurnTaking):
    def __init__(self, config: RealtimeConfig, ext: Extensions, position_ms: int = 0) -> None:
        super().__init__(config, ext, position_ms)
        self.overlap = OverlapPolicy(config.overlap)
        self.reported: tuple[str, str] | None = None  # the overlap decision last reported in this reply

    def reads_speech(self, responding: bool) -> bool:
        return responding  # to judge the caller's speech under a reply

    def hear(self, s: Host, heard: Heard) -> Effects:
        out = Effects()
        for piece in heard.pieces():
            onset = any(e.kind == "speech_started" for e in self.segmenter.feed(piece.probs))
            audio = self._judge_overlap(s, piece, onset, out)
            out.steps += s.duplex.add(audio, s.epoch)
        return out

    def _judge_overlap(self, s: Host, heard: Heard, onset: bool, out: Effects) -> np.ndarray:
        r, audio, probs = s.active, heard.audio, heard.probs
        if r is None:
            self.overlap.reset()
            self.reported = None
            return audio
        if probs:
            speech_ms = sum(p >= self.config.turn_detection.threshold for p in probs) * WINDOW_MS
        else:  # no VAD model: loud enough counts as speech
            speech_ms = len(audio) * 1000 // INPUT_RATE if rms(audio) >= self.config.overlap.silence_rms else 0
        decision = self.overlap.decide(audio, speech_ms, onset, heard.hint)
        if self.ext.events and ((decision.action, decision.reason) != self.reported or decision.action == "barge_in"):
            self.reported = (decision.action, decision.reason)
            out.events.append(oe.OverlapDecision(self.config.overlap.policy, decision.action, decision.reason,
                                                 decision.speech_ms, r.id, s.epoch))
        if decision.action == "barge_in":
            out.extend(s.interrupt("barge_in"))
            s.duplex.listen_next = True  # the second in which the caller barged in is listened to
        if decision.action == "drop":
            return np.zeros_like(audio)  # noise under a reply: the model hears silence
        return audio

    def commit(self, s: Host) -> Effects:
        # The model hears what is pending now. No user item is made in duplex (the caller's audio is the model's
        # context, not the conversation's items), so there is no `committed` to say.
        audio = committable(s.duplex.pending)
        s.duplex.take_pending()
        return Effects(steps=[s.duplex.step(audio, s.epoch)])

    def check_item(self, s: Host, item: Item) -> None:
        if item.audio is not None:
            raise ProtocolError(ClientCode.INVALID_VALUE, "in duplex, send caller audio with input_audio_buffer.append",
                                "item.content")
        if len(s.duplex.images) + len(item.images) > MAX_FRAMES:
            raise ProtocolError(ClientCode.INVALID_VALUE, f"at most {MAX_FRAMES} images wait for the next second",
                                "item")

    def item_added(self, s: Host, item: Item) -> list[Step]:
        s.duplex.images += item.images  # seen with the next second of audio
        if not item.text or item.role == "assistant":  # an assistant's words enter the context when said
            return []
        req = StepInput.of_context(Context(item.text, item.role, respond=False))
        return [PlannedStep("context", req, s.epoch)]

    def create_response(self, s: Host, msg: oe.ResponseCreate, budget: int) -> Effects:
        # second: a barge-in into a spoken turn replays the caller's seconds sent after it began; cause: the
        # response the model opens on it carries the request's metadata
        return Effects(steps=[PlannedStep(
            "context", self._response_request(s, msg.instructions, budget), s.epoch, second=s.duplex.seconds,
            cause=msg)])

    def _response_request(self, s: Host, instructions: str | None, budget: int) -> StepInput:
        """Instructions prompt the model (it decides whether to speak); without them the model speaks now: an
        assistant message waiting to be voiced is said as is, else it answers in voice."""
        if instructions is not None and instructions.strip():
            return StepInput.of_context(Context(instructions.strip(), "instructions", respond=True))
        if s.to_say is not None:
            item, s.to_say = s.to_say, None
            return StepInput(say=item.text)
        return StepInput(answer_tokens=budget)

    def room(self, s: Host, item: Item) -> None:
        s.limits.conversation(1, item.nbytes)  # only the item alone must fit: `trim` makes room once it is in

    def trim(self, s: Host, item: Item) -> list[ServerEvent]:
        """The oldest items forgotten; the new item and the open response's are kept."""
        active = s.active.item if s.active is not None else None
        gone = s.conversation.trim(s.limits.conversation_items, s.limits.conversation_bytes, (item, active))
        return [oe.ItemDeleted(item_id) for item_id in gone]

    def rollback(self, s: Host, r: Response, always: bool = False) -> None:
        """The next step takes the LLM back to the last heard step (or to before the reply)."""
        heard = r.item.heard_marks(r.item.truncated_ms if r.item.truncated_ms is not None else r.item.audio_ms)
        if not always and len(heard) == len(r.item.marks):
            return  # every step of the reply was (at least partly) heard: nothing to take back
        target = Mark(heard[-1].kv_after, heard[-1].second) if heard else r.before
        if target.kv >= 0:
            s.duplex.rollback = target

    def interrupted(self) -> None:
        self.overlap.reset()

    def opening(self, r: Response, epoch: int) -> list[ServerEvent]:
        return [oe.ResponseSpeak(r.id, epoch)] if self.ext.events else []  # the model decided to speak

    def closing(self, r: Response, epoch: int, status: str) -> list[ServerEvent]:
        return [oe.ResponseListen(r.id, epoch, status == "completed")] if self.ext.events else []


def committable(audio: np.ndarray) -> np.ndarray:
    """Caller audio a commit makes a step or an item of: at least MIN_COMMIT_MS, in whole tenths of a second."""
    if len(audio) < MIN_COMMIT_MS * INPUT_RATE // 1000:
        raise ProtocolError(ClientCode.INPUT_AUDIO_BUFFER_COMMIT_EMPTY,
                            f"the buffer holds under {MIN_COMMIT_MS} ms of audio")
    return whole_tenths(audio)


MODES: dict[str | None, type[TurnTaking]] = {DUPLEX: Duplex, "server_vad": ServerVad, "semantic_vad": ServerVad,
                                             None: Manual}


def turn_taking(config: RealtimeConfig, ext: Extensions, position_ms: int = 0) -> TurnTaking:
    """The mode the config names; `position_ms`: the caller's audio heard so far (VAD events count from the start)."""
    return MODES[config.turn_detection.type](config, ext, position_ms)

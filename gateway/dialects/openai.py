"""The OpenAI Realtime dialect as a state machine (pure code: read client events and step events in, effects out).

Turn detection decides who opens a response:
- `server_vad` (the default, as OpenAI's) and `semantic_vad` (the same VAD, its silence set by its eagerness):
  Silero VAD segments the caller's speech; its end commits the buffer as a user item and starts a response (a
  chat turn over the conversation); speech during a reply interrupts it.
- `null`: the client commits and asks for responses itself.
- duplex (where the URL opted in, `openai_extensions`): every second of caller audio is a duplex step and the
  model decides whether to speak; a spoken turn opens a response and its end closes it. While the assistant
  speaks, the overlap policy judges the caller's audio: noise is dropped, a backchannel is heard and the reply
  goes on, sustained speech barges in.

What a stock client sees is the spec alone; the extension events and fields go to a client that opted in
(`self.ext`, from the URL).

The response's states and what moves between them are written down in `openai_states`; a frame's CPU work
(decoding, resampling, VAD) is done before this code sees it, by `openai_input.CallerAudio`.

Where things go: a new client event is a class in `openai_events` (its fields decoded there), read in
`openai_input` if it carries CPU work, and handled by a method listed in `_HANDLERS` below; a new response
state or trigger goes into `openai_states.TRANSITIONS` (and `REFUSED` for what it refuses) before any code
moves to it; a new server event is a class in `openai_events`, built where the transition happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from minicpmo_triton.duplex_contract import ChatInput, ChatMessage, Context, StepEvent, StepInput
from minicpmo_triton.duplex_options import DuplexOptions

from ..audio import INPUT_RATE, StreamResampler
from ..codes import ClientCode
from ..inputs import MAX_FRAMES
from ..overlap import OverlapDecision, OverlapPolicy, rms
from ..vad import WINDOW_MS, SpeechSegmenter
from ..wire import ProtocolError, new_id
from . import openai_events as oe
from . import openai_response as responses
from .openai_config import RealtimeConfig, Update, apply_update, max_output_tokens
from .openai_conversation import Conversation, InputBuffer, Item
from .openai_duplex import DuplexInput, Mark
from .openai_extensions import STOCK, Extensions, status_details
from .openai_input import (
    CallerAudio,
    ClientInput,
    Heard,
    NewItem,
    ReadEvent,
    ReadPlan,
    Resampling,
    SpeechProbabilities,
    whole_tenths,
)
from .openai_response import Response
from .openai_states import Phase, Trigger, check_allowed, next_phase
from .realtime_events import answering, closed_event, error_event, name_refusals
from .state import DialectState, Effects, PlannedStep, ServerEvent

MIN_COMMIT_MS = 100
# Frames this long are read off the event loop. Per second of audio an append costs 5-9 ms of Silero VAD
# (12-17 ms with both cores busy), 0.2 ms of resampling, 0.1 ms of decoding; a thread hand-off 0.2 ms, but
# 5-8 ms at its p99 (`python -m bench.frame_cost`, docs/realtime.md). 64,000 characters is an append of 1 s
# at 24 kHz (1.5 s at 16 kHz): its VAD outweighs even a slow hand-off. Smaller frames (clients stream
# 20-100 ms; a barge-in is decided on one) stay inline, where a hand-off would only make them later.
OFFLOAD_FRAME_BYTES = 64_000
CAPABILITIES = {"duplex": True, "barge_in": True, "truncate": True, "playback_ack": True, "resume": True,
                "server_vad": True, "semantic_vad": True, "chunk_period_ms": 1000, "input_rates": [16_000, 24_000]}

__all__ = ["OFFLOAD_FRAME_BYTES", "OpenAIRealtimeState", "Resampling", "SpeechProbabilities"]


@dataclass
class OpenAIRealtimeState(DialectState):
    offload_frame_bytes: ClassVar[int | None] = OFFLOAD_FRAME_BYTES
    ext: Extensions = STOCK  # what the client opted into (the URL's ?extensions=)
    vad: SpeechProbabilities | None = None
    resampling: Resampling = StreamResampler
    clock: Callable[[], float] = time.monotonic
    phase: Phase = Phase.IDLE  # the response's state (openai_states)
    conversation: Conversation = field(default_factory=Conversation)
    response: Response | None = None  # the latest response, open (phase RESPONDING) or done
    past_responses: set[str] = field(default_factory=set)
    duplex: DuplexInput = field(default_factory=DuplexInput)  # the caller's audio in duplex
    buffer: InputBuffer = field(default_factory=InputBuffer)  # uncommitted caller audio (turn-based)
    speech_item: str | None = None  # server VAD: the user item the caller's speech will be
    to_say: Item | None = None  # an assistant message the next response.create voices
    said: set[str] = field(default_factory=set)  # messages voiced by a response (whose item now holds them)
    reported: tuple[str, str] | None = None  # the overlap decision last reported in this reply
    decided: PlannedStep | None = None  # the duplex step whose decision was last reported (`duplex.step`)
    config: RealtimeConfig = field(init=False)
    overlap: OverlapPolicy = field(init=False)
    segmenter: SpeechSegmenter = field(init=False)
    caller_audio: CallerAudio = field(init=False)

    def __post_init__(self) -> None:
        self.config = RealtimeConfig.first(self.ext, vad=self.vad is not None)
        self.caller_audio = CallerAudio(self.vad, self.resampling)
        self.buffer.most_s = self.limits.item_audio_s
        self._reset_detectors(position_ms=0)

    def options(self) -> DuplexOptions:
        return self.config.options()

    def voice_name(self) -> str:
        return self.config.voice  # an OpenAI name with no file in the voice folder keeps the default voice

    def _reset_detectors(self, position_ms: int) -> None:
        td = self.config.turn_detection
        self.overlap = OverlapPolicy(self.config.overlap)
        self.segmenter = SpeechSegmenter(td.threshold, td.prefix_padding_ms, td.silence_ms, position_ms=position_ms)

    @property
    def active(self) -> Response | None:
        """The open response, if any."""
        return self.response if self.phase is Phase.RESPONDING else None

    def _move(self, trigger: Trigger) -> None:
        self.phase = next_phase(self.phase, trigger)

    # ---- session ----
    def created(self) -> list[ServerEvent]:
        return [oe.SessionCreated(self._session_dict(), CAPABILITIES if self.ext.events else None)]

    def error_event(self, err: ProtocolError) -> ServerEvent:
        return error_event(err)

    def _session_dict(self) -> dict[str, Any]:
        session = self.config.to_dict(self.session_id, self.ext)
        return {**session, "epoch": self.epoch} if self.ext.events else session

    # ---- client events: read (openai_input), then decided here ----
    def frame_plan(self) -> ReadPlan:
        # The VAD runs where it is needed: server VAD, or judging speech under a reply (duplex).
        vad = self.config.turn_detection.vad or (self.config.duplex and self.active is not None)
        return ReadPlan(self.config.input_rate, vad, self.limits)

    def read_frame(self, text: str, plan: ReadPlan) -> ReadEvent:
        return self.caller_audio.read(text, plan)

    def on_frame(self, read: ReadEvent) -> Effects:
        if self.phase is Phase.CLOSED:
            return Effects()  # a frame that raced the close: nobody is told anything more
        with answering(read.event_id):
            check_allowed(self.phase, read.event, self.response.id if self.response else None)
            fx = _HANDLERS[type(read.event)](self, read.event)
        name_refusals(fx.events, read.event_id)  # a part refused (a field of session.update) names the event too
        return fx

    def on_client(self, msg: dict[str, Any]) -> Effects:
        """A client event as a JSON object, read and decided at once (tests)."""
        return self.on_frame(self.caller_audio.read_event(msg, self.frame_plan()))

    def _session_update(self, msg: oe.SessionUpdate) -> Effects:
        """Each field on its own: the ones the session cannot take are refused, the others apply."""
        self.config, refused = apply_update(self.config, Update(msg.session, self.started, self.ext,
                                                                self.vad is not None, self.limits))
        self._reset_detectors(self.segmenter.position_ms)
        return Effects([*(error_event(err) for err in refused), oe.SessionUpdated(self._session_dict())])

    def _heard(self, heard: Heard) -> Effects:
        """Caller audio (16 kHz float32, its speech probabilities beside it); a long append a second at a time."""
        if self.config.duplex:
            self.duplex.check_room()
        elif not self.config.turn_detection.vad and not self.buffer.room(len(heard.audio)):
            raise self.buffer.full()
        out = Effects()
        full = False
        for piece in heard.pieces():
            if self.config.turn_detection.vad and self.segmenter.in_speech and not self.buffer.room(len(piece.audio)):
                full = True  # speech longer than the buffer holds: what does not fit is dropped, and said once
                continue
            out.extend(self._hear(piece))
        if full:
            out.events.append(error_event(self.buffer.full()))
        return out

    def _hear(self, heard: Heard) -> Effects:
        out = Effects()
        vad_events = self.segmenter.feed(heard.probs)
        if self.config.duplex:
            onset = any(e.kind == "speech_started" for e in vad_events)
            audio = self._judge_overlap(heard.audio, heard.probs, onset, heard.hint, out)
            out.steps += self.duplex.add(audio, self.epoch)
            return out
        self.buffer.add(heard.audio)
        if not self.config.turn_detection.vad:
            return out
        for vad_ev in vad_events:
            if vad_ev.kind == "speech_started":
                self.speech_item = new_id("item")
                out.events.append(oe.SpeechStarted(vad_ev.audio_ms, self.speech_item))
                if self.active is not None and self.config.turn_detection.interrupt_response:
                    out.extend(self._interrupt("barge_in"))
            else:
                out.events.append(oe.SpeechStopped(vad_ev.audio_ms, self.speech_item))
                out.extend(self._commit_buffer(self.speech_item))
                if self.config.turn_detection.create_response and self.active is None:
                    out.extend(self._respond())
        if not self.segmenter.in_speech:  # before speech starts only its prefix padding is worth keeping
            self.buffer.keep_last(self.config.turn_detection.prefix_padding_ms * INPUT_RATE // 1000)
        return out

    def _judge_overlap(self, audio: np.ndarray, probs: list[float], onset: bool, hint: str | None,
                       out: Effects) -> np.ndarray:
        if self.active is None:
            self.overlap.reset()
            self.reported = None
            return audio
        if probs:
            speech_ms = sum(p >= self.config.turn_detection.threshold for p in probs) * WINDOW_MS
        else:  # no VAD model: loud enough counts as speech
            speech_ms = len(audio) * 1000 // INPUT_RATE if rms(audio) >= self.config.overlap.silence_rms else 0
        decision = self.overlap.decide(audio, speech_ms, onset, hint)
        if self.ext.events and ((decision.action, decision.reason) != self.reported or decision.action == "barge_in"):
            self.reported = (decision.action, decision.reason)
            out.events.append(self._decision_event(decision))
        if decision.action == "barge_in":
            out.extend(self._interrupt("barge_in"))
            self.duplex.listen_next = True  # the second in which the caller barged in is listened to
        if decision.action == "drop":
            return np.zeros_like(audio)  # noise under a reply: the model hears silence
        return audio

    def _decision_event(self, d: OverlapDecision) -> oe.OverlapDecision:
        return oe.OverlapDecision(self.config.overlap.policy, d.action, d.reason, d.speech_ms,
                                  self.response.id if self.response else None, self.epoch)

    def prepare(self, step: PlannedStep) -> StepInput | ChatInput:
        req = super().prepare(step)
        if isinstance(req, StepInput) and step.kind == "duplex":
            self.duplex.amend(step, req)
        return req

    def _commit(self, msg: oe.ClientEvent) -> Effects:
        if self.config.duplex:
            # The model hears what is pending now. No user item is made in duplex (the caller's audio is the
            # model's context, not the conversation's items), so there is no `committed` to say.
            audio = _committable(self.duplex.pending)
            self.duplex.take_pending()
            return Effects(steps=self.duplex.queue(self.duplex.step(audio, self.epoch)))
        return self._commit_buffer(None)

    def _commit_buffer(self, item_id: str | None) -> Effects:
        audio = _committable(self.buffer.take())
        item = Item(item_id or new_id("item"), "user", audio=audio)
        self._room(item)
        previous = self.conversation.add(item)
        return Effects([
            *self._trim(item),
            oe.BufferCommitted(item.id, previous),
            oe.ItemAdded(previous, item.to_dict()),
            oe.ItemDone(item.to_dict()),
        ])

    def _clear(self, msg: oe.ClientEvent) -> Effects:
        self.buffer.take()
        self.duplex.take_pending()
        return Effects([oe.BufferCleared()])

    def _item_create(self, new: NewItem) -> Effects:
        item = Item(new.id or new_id("item"), new.role, new.text, new.audio, list(new.images), spoken=False)
        self._room(item)
        if self.config.duplex:
            if item.audio is not None:
                raise ProtocolError(ClientCode.INVALID_VALUE,
                                    "in duplex, send caller audio with input_audio_buffer.append",
                                    "item.content")
            if len(self.duplex.images) + len(item.images) > MAX_FRAMES:
                raise ProtocolError(ClientCode.INVALID_VALUE,
                                    f"at most {MAX_FRAMES} images wait for the next second", "item")
        previous = self.conversation.add(item, new.after)  # a duplicate id or an unknown place refuses it
        out = Effects(self._trim(item))
        if self.config.duplex:
            self.duplex.images += item.images  # seen with the next second of audio
            if item.text and item.role != "assistant":
                req = StepInput.of_context(Context(item.text, item.role, respond=False))
                out.steps += self.duplex.queue(PlannedStep("context", req, self.epoch))
        if item.role == "assistant" and item.text:
            self.to_say = item  # said by the next response.create; in duplex it enters the context only then
        out.events += [oe.ItemAdded(previous, item.to_dict()),
                       oe.ItemDone(item.to_dict())]
        return out

    def _item_retrieve(self, msg: oe.ItemRetrieve) -> Effects:
        return Effects([oe.ItemRetrieved(self.conversation.get(msg.item_id).to_dict())])

    def _item_delete(self, msg: oe.ItemRetrieve) -> Effects:
        item_id = msg.item_id
        if self.active is not None and self.active.item.id == item_id:
            raise ProtocolError(ClientCode.INVALID_VALUE, "cancel the response before deleting its item", "item_id")
        item = self.conversation.get(item_id)
        self.conversation.delete(item.id)
        if self.to_say is not None and self.to_say.id == item.id:
            self.to_say = None
        return Effects([oe.ItemDeleted(item.id)])

    def _item_truncate(self, msg: oe.ItemTruncate) -> Effects:
        item = self.conversation.get(msg.item_id)
        if item.role != "assistant":
            raise ProtocolError(ClientCode.INVALID_VALUE, "only an assistant item's audio can be truncated", "item_id")
        end = msg.audio_end_ms
        response = self.response if self.response is not None and self.response.item is item else None
        if response is not None and self.active is response:
            return self._interrupt("client_cancelled", heard_ms=end)
        cut = item.truncate(end)
        if response is not None:
            self._plan_rollback(response)
        return Effects([oe.ItemTruncated(item.id, msg.content_index, round(cut))])

    def _response_create(self, msg: oe.ResponseCreate) -> Effects:
        budget = self.config.max_output_tokens if msg.max_output_tokens is None \
            else max_output_tokens(msg.max_output_tokens, "response.max_output_tokens")
        if isinstance(msg.instructions, str):  # prefilled with the turn: a text within the caller's bounds
            self.limits.text(msg.instructions, "response.instructions")
        if self.config.duplex:
            # second: a barge-in into a spoken turn replays the caller's seconds sent after it began; cause: the
            # response the model opens on it carries the request's metadata
            return Effects(steps=self.duplex.queue(PlannedStep(
                "context", self._duplex_response(msg.instructions, budget), self.epoch, second=self.duplex.seconds,
                cause=msg)))
        return self._respond(budget, msg.instructions, msg.metadata)

    def _duplex_response(self, instructions: Any, budget: int) -> StepInput:
        """Duplex: instructions prompt the model (it decides whether to speak); without them the model
        speaks now: an assistant message waiting to be voiced is said as is, else it answers in voice."""
        if isinstance(instructions, str) and instructions.strip():
            return StepInput.of_context(Context(instructions.strip(), "instructions", respond=True))
        if self.to_say is not None:
            item, self.to_say = self.to_say, None
            return StepInput(say=item.text)
        return StepInput(answer_tokens=budget)

    def _respond(self, budget: int | None = None, instructions: str | None = None,
                 metadata: dict[str, str] | None = None) -> Effects:
        """A turn-based response: a chat turn over the conversation so far, whatever it ends with (as OpenAI's).
        Its instructions, or when the conversation gives the model nothing to answer (it is empty: a greeting; it
        ends with the assistant) the session's, come last, as a system message of this turn only."""
        items = [i for i in self.conversation.items if (i.text or i.audio is not None or i.images)
                 and i.id not in self.said]
        say = self.to_say is not None and bool(items) and items[-1] is self.to_say
        self._room(Item("", "assistant"))  # the reply's item
        if say and self.to_say is not None:  # the response's item holds the words from now on
            self.said.add(self.to_say.id)
            self.to_say = None
        messages = [_chat_message(i) for i in items]
        if not say and (instructions or not items or items[-1].role == "assistant"):
            messages.append(ChatMessage("system", instructions or self.config.instructions))
        out, r = self._open_response(metadata)
        chat = ChatInput(messages, budget or self.config.max_output_tokens, self.config.audio_out, say=say)
        out.steps.append(PlannedStep("chat", chat, self.epoch, response_id=r.id))
        return out

    def _response_cancel(self, msg: oe.ClientEvent) -> Effects:
        return self._interrupt("client_cancelled")  # IDLE refuses it (openai_states.REFUSED)

    def _output_clear(self, msg: oe.ClientEvent) -> Effects:
        out = self._interrupt("output_cleared") if self.active is not None else Effects()
        if self.response is not None:  # none yet: there was no audio to clear
            out.events.append(oe.OutputBufferCleared(self.response.id))
        return out

    def _playback_ack(self, msg: oe.PlaybackAck) -> Effects:
        response_id, played = msg.response_id, msg.played_ms
        r = self.response
        if r is None or response_id != r.id:
            if response_id in self.past_responses:
                raise ProtocolError(ClientCode.PLAYBACK_ACK_TOO_LATE,
                                    f"response {response_id} was followed by a newer one",
                                    "response_id")
            raise ProtocolError(ClientCode.UNKNOWN_RESPONSE, f"no response {response_id!r}", "response_id")
        r.ack_ms = max(r.ack_ms, min(played, r.item.audio_ms))  # acks only move forward
        r.ack_at = self.clock()
        committed = r.done
        out = Effects()
        if r.done and self.config.playback_commit_policy == "ack_only" and r.ack_ms < r.item.audio_ms:
            cut = r.item.truncate(r.ack_ms)
            self._plan_rollback(r)
            out.events.append(oe.ItemTruncated(r.item.id, 0, round(cut)))
        out.events.insert(0, oe.PlaybackAcknowledged(r.id, round(r.ack_ms), committed))
        return out

    def _close(self, msg: oe.ClientEvent) -> Effects:
        return Effects(close="client_closed")

    def _heartbeat(self, msg: oe.ClientEvent) -> Effects:
        return Effects()

    def _room(self, item: Item) -> None:
        """Whether `item` may join the conversation (limits.conversation), checked before anything changes. A
        turn-based conversation is what each response sends: past its bounds the caller deletes items, else
        `conversation_full`. A duplex one is only a record (the model's context is its KV cache): `_trim` makes
        room once the item is in; only the item alone must fit."""
        limits, conversation = self.limits, self.conversation
        if self.config.duplex:
            limits.conversation(1, item.nbytes)
        else:
            limits.conversation(len(conversation.items) + 1, conversation.nbytes() + item.nbytes)

    def _trim(self, item: Item) -> list[ServerEvent]:
        """Duplex, after `item` joined: the oldest items forgotten (`conversation.item.deleted`) to keep within the
        bounds; the new item and the open response's are kept."""
        if not self.config.duplex:
            return []
        active = self.active.item if self.active is not None else None
        gone = self.conversation.trim(self.limits.conversation_items, self.limits.conversation_bytes, (item, active))
        return [oe.ItemDeleted(item_id) for item_id in gone]

    # ---- the response's transitions (openai_states.TRANSITIONS) ----
    def _open_response(self, metadata: dict[str, str] | None = None) -> tuple[Effects, Response]:
        """IDLE -> RESPONDING."""
        self._move(Trigger.OPEN)
        item = self.conversation.new_item("assistant", status="in_progress", spoken=self.config.audio_out)
        if self.response is not None:
            self.past_responses.add(self.response.id)
        r = self.response = Response(new_id("resp"), item, self.epoch, before=self.duplex.last_listen,
                                     metadata=metadata)
        previous = self.conversation.add(item)  # its room: checked by _respond (turn-based), made by _trim (duplex)
        return Effects([*self._trim(item), *responses.opened(r, previous, self.config, self.ext, self.epoch)]), r

    def _finish_response(self, trigger: Trigger, status: str, details: dict[str, Any] | None = None) -> Effects:
        """RESPONDING -> IDLE (COMPLETE, INTERRUPT, FAIL) or CLOSED (CLOSE)."""
        r = self.active
        assert r is not None, "only an open response finishes"
        self._move(trigger)
        r.done = True
        r.item.status = "completed" if status == "completed" else "incomplete"
        return Effects(responses.finished(r, self.config, self.ext, self.epoch, status, details))

    def heard_ms(self, r: Response) -> float:
        """How much of a reply the listener has heard: acked, else as if played in real time from its first audio."""
        now = self.clock()
        if self.config.playback_commit_policy == "ack_only":
            return r.ack_ms
        if r.ack_at is not None:
            return min(r.item.audio_ms, r.ack_ms + (now - r.ack_at) * 1000)
        if r.first_audio_at is None:
            return 0.0
        return min(r.item.audio_ms, (now - r.first_audio_at) * 1000)

    def _interrupt(self, reason: str, heard_ms: float | None = None) -> Effects:
        """RESPONDING -> IDLE by barge-in, cancel, clear: the reply stops where the listener stopped hearing it,
        and the epoch moves on (nothing of the old one reaches the client)."""
        r = self.active
        if r is None:
            return Effects()
        heard = self.heard_ms(r) if heard_ms is None else heard_ms
        cut = r.item.truncate(heard)
        self._plan_rollback(r, always=True)  # the step in flight may have said more than was sent
        self.epoch += 1
        out = Effects(cancel=True)
        out.extend(self._finish_response(Trigger.INTERRUPT, "cancelled", status_details("cancelled", reason, self.ext)))
        out.events.append(oe.ItemTruncated(r.item.id, 0, round(cut)))
        self.overlap.reset()
        return out

    def _plan_rollback(self, r: Response, always: bool = False) -> None:
        """Duplex: the next step takes the LLM back to the last heard step (or to before the reply)."""
        if not self.config.duplex:
            return  # turn-based: the next turn's messages carry the cut transcript; the LLM stage rebuilds
        heard = r.item.heard_marks(r.item.truncated_ms if r.item.truncated_ms is not None else r.item.audio_ms)
        if not always and len(heard) == len(r.item.marks):
            return  # every step of the reply was (at least partly) heard: nothing to take back
        target = Mark(heard[-1].kv_after, heard[-1].second) if heard else r.before
        if target.kv >= 0:
            self.duplex.rollback = target

    # ---- step events ----
    def on_step_event(self, step: PlannedStep, ev: StepEvent) -> Effects:
        if self.is_stale(step, ev) or self.phase is Phase.CLOSED:
            return Effects()
        if step.kind == "chat":
            return self._chat_event(step, ev)
        out = Effects()
        kv = int(ev.metrics.kv_cache_length) if ev.metrics.kv_cache_length is not None else -1
        # a rollback point: counted from the call's start, so it stays valid when the window slides
        point = int(ev.metrics.kv_tokens_total) if ev.metrics.kv_tokens_total is not None else -1
        if step.kind == "duplex" and self.ext.events and self.decided is not step:  # its first event decides
            self.decided = step
            out.events.append(oe.DuplexStep(step.second, "listen" if ev.kind == "listen" else "speak", self.epoch, kv))
        if ev.kind == "listen":
            if step.kind == "duplex" and point >= 0:
                self.duplex.last_listen = Mark(point, step.second)
            if self.active is not None:
                self.active.count(ev)
                out.extend(self._finish_response(Trigger.COMPLETE, "completed"))
            return out
        r = self.active
        if r is None:  # the model speaks: a response opens (for a response.create's step, with its metadata)
            opened, r = self._open_response(step.cause.metadata if isinstance(step.cause, oe.ResponseCreate) else None)
            out.extend(opened)
        r.count(ev)
        if kv >= 0:
            r.kv_length = kv
        out.events += responses.deltas(r, ev, self.config, self.ext, self.epoch, self.clock(), point, step.second)
        return out

    def _chat_event(self, step: PlannedStep, ev: StepEvent) -> Effects:
        r = self.active
        if r is None or r.id != step.response_id:
            return Effects()
        r.count(ev)
        if ev.kind == "done":
            r.kv_length = int(ev.metrics.kv_cache_length or 0)
            if ev.reason == "length":
                return self._finish_response(Trigger.COMPLETE, "incomplete",
                                             status_details("incomplete", "max_output_tokens", self.ext))
            return self._finish_response(Trigger.COMPLETE, "completed")
        return Effects(responses.deltas(r, ev, self.config, self.ext, self.epoch, self.clock()))

    def on_step_end(self, step: PlannedStep) -> Effects:
        """A duplex session's step was answered: the next ones waiting (a long append's seconds) go out."""
        return Effects(steps=self.duplex.answered()) if step.kind != "chat" else Effects()

    def on_step_error(self, step: PlannedStep, code: ClientCode, message: str) -> Effects:
        """A step the stages refused for the client's input: say so; its response (if any) failed."""
        out = Effects([error_event(ProtocolError(code, message))])
        if step.epoch == self.epoch and self.active is not None and step.kind == "chat":
            out.extend(self._finish_response(Trigger.FAIL, "failed", {"type": "failed", "error": {
                "type": "invalid_request_error", "code": code, "message": message}}))
        return out.extend(self.on_step_end(step))

    def on_close(self, reason: str, message: str | None) -> list[ServerEvent]:
        if self.phase is Phase.CLOSED:
            return []
        out: list[ServerEvent] = []
        if self.active is not None:  # a reply still open ends first (the spec has no reason for a session's end)
            details = status_details("cancelled", reason, self.ext)
            out = self._finish_response(Trigger.CLOSE, "cancelled", details).events
        else:
            self._move(Trigger.CLOSE)
        if not self.ext.events:
            return out
        return [*out, closed_event(self.session_id, reason, self.usage.snapshot(), message)]

    def wanted(self, step: PlannedStep) -> bool:
        """A chat step whose response was cancelled while it waited need not run."""
        return step.kind != "chat" or (self.active is not None and self.active.id == step.response_id)


def _committable(audio: np.ndarray) -> np.ndarray:
    if len(audio) < MIN_COMMIT_MS * INPUT_RATE // 1000:
        raise ProtocolError(ClientCode.INPUT_AUDIO_BUFFER_COMMIT_EMPTY,
                            f"the buffer holds under {MIN_COMMIT_MS} ms of audio")
    return whole_tenths(audio)


def _chat_message(item: Item) -> ChatMessage:
    return ChatMessage(item.role, item.text, item.audio, tuple(item.images))


_HANDLERS: dict[type[ClientInput], Callable[[OpenAIRealtimeState, Any], Effects]] = {
    oe.SessionUpdate: OpenAIRealtimeState._session_update,
    Heard: OpenAIRealtimeState._heard,
    oe.BufferCommit: OpenAIRealtimeState._commit,
    oe.BufferClear: OpenAIRealtimeState._clear,
    NewItem: OpenAIRealtimeState._item_create,
    oe.ItemRetrieve: OpenAIRealtimeState._item_retrieve,
    oe.ItemDelete: OpenAIRealtimeState._item_delete,
    oe.ItemTruncate: OpenAIRealtimeState._item_truncate,
    oe.ResponseCreate: OpenAIRealtimeState._response_create,
    oe.ResponseCancel: OpenAIRealtimeState._response_cancel,
    oe.OutputClear: OpenAIRealtimeState._output_clear,
    oe.PlaybackAck: OpenAIRealtimeState._playback_ack,
    oe.SessionClose: OpenAIRealtimeState._close,
    oe.Heartbeat: OpenAIRealtimeState._heartbeat,
}

"""The OpenAI Realtime dialect as a state machine (pure code: read client events and step events in, effects out).

Who takes turns (duplex, server VAD, or the client's commits) is the session's mode, an object chosen from its
config (`openai_turns`): this class asks the mode wherever turn-taking matters and never which mode it is.

What a stock client sees is the spec alone; the extension events and fields go to a client that opted in
(`self.ext`, from the URL).

The response's states, what moves between them and what each client event may do in each are written down in
`openai_states`; a frame's CPU work (decoding, resampling, VAD) is done before this code sees it, by
`openai_input.CallerAudio`.

Where things go: a new client event is a class in `openai_events` (its fields decoded there), read in
`openai_input` if it carries CPU work, given its row in `openai_states.CLIENT_EVENTS` and handled by a method
listed in `_HANDLERS` below (by the mode's, where turn-taking decides); a new response state or trigger goes into
`openai_states.TRANSITIONS` before any code moves to it; a new server event is a class in `openai_events`, built
where the transition happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from minicpmo_triton.duplex_contract import ChatInput, ChatMessage, StepEvent, StepInput
from minicpmo_triton.rules.duplex_options import DuplexOptions

from ..audio import StreamResampler
from ..codes import ClientCode
from ..wire import ProtocolError, new_id
from . import openai_events as oe
from . import openai_response as responses
from .openai_config import RealtimeConfig, Update, apply_update, max_output_tokens
from .openai_conversation import Conversation, InputBuffer, Item
from .openai_duplex import DuplexInput, Mark
from .openai_extensions import STOCK, Extensions, status_details
from .openai_input import CallerAudio, ClientInput, Heard, NewItem, ReadEvent, ReadPlan, Resampling, SpeechProbabilities
from .openai_objects import Capabilities, RealtimeSession, StatusDetails
from .openai_response import Response
from .openai_states import Allowed, Phase, Trigger, allowed, next_phase
from .openai_turns import Step, TurnTaking, turn_taking
from .realtime_events import answering, closed_event, error_event, name_refusals
from .state import DialectState, Effects, PlannedStep, ServerEvent

# Frames this long are read off the event loop. Per second of audio an append costs 5-9 ms of Silero VAD
# (12-17 ms with both cores busy), 0.2 ms of resampling, 0.1 ms of decoding; a thread hand-off 0.2 ms, but
# 5-8 ms at its p99 (`python -m bench.frame_cost`, docs/realtime.md). 64,000 characters is an append of 1 s
# at 24 kHz (1.5 s at 16 kHz): its VAD outweighs even a slow hand-off. Smaller frames (clients stream
# 20-100 ms; a barge-in is decided on one) stay inline, where a hand-off would only make them later.
OFFLOAD_FRAME_BYTES = 64_000
CAPABILITIES: Capabilities = {"duplex": True, "barge_in": True, "truncate": True, "playback_ack": True, "resume": True,
                "server_vad": True, "semantic_vad": True, "chunk_period_ms": 1000, "input_rates": [16_000, 24_000]}

__all__ = ["OFFLOAD_FRAME_BYTES", "OpenAIRealtimeState", "Resampling", "SpeechProbabilities"]


@dataclass
class OpenAIRealtimeState(DialectState[oe.ResponseCreate]):
    dialect = "openai"
    offload_frame_bytes: ClassVar[int | None] = OFFLOAD_FRAME_BYTES
    ext: Extensions = STOCK  # what the client opted into (the URL's ?extensions=)
    vad: SpeechProbabilities | None = None
    resampling: Resampling = StreamResampler
    clock: Callable[[], float] = time.monotonic
    phase: Phase = Phase.IDLE  # the response's state (openai_states)
    conversation: Conversation = field(default_factory=Conversation)
    response: Response | None = None  # the latest response, open (phase RESPONDING) or done
    past_responses: set[str] = field(default_factory=set)
    duplex: DuplexInput[oe.ResponseCreate] = field(default_factory=DuplexInput)  # the caller's audio in duplex
    buffer: InputBuffer = field(default_factory=InputBuffer)  # uncommitted caller audio (turn-based)
    to_say: Item | None = None  # an assistant message the next response.create voices
    said: set[str] = field(default_factory=set)  # messages voiced by a response (whose item now holds them)
    decided: Step | None = None  # the duplex step whose decision was last reported (`duplex.step`)
    config: RealtimeConfig = field(init=False)
    turns: TurnTaking = field(init=False)  # who takes turns: the mode the config names (openai_turns)
    caller_audio: CallerAudio = field(init=False)
    _may: Allowed | None = field(default=None, init=False)  # the triggers the client event being handled may fire

    def __post_init__(self) -> None:
        self.config = RealtimeConfig.first(self.ext, vad=self.vad is not None)
        self.turns = turn_taking(self.config, self.ext)
        self.caller_audio = CallerAudio(self.vad, self.resampling)
        self.buffer.most_s = self.limits.item_audio_s

    def options(self) -> DuplexOptions:
        return self.config.options()

    def voice_name(self) -> str:
        return self.config.voice  # an OpenAI name with no file in the voice folder keeps the default voice

    @property
    def active(self) -> Response | None:
        """The open response, if any."""
        return self.response if self.phase is Phase.RESPONDING else None

    def _move(self, trigger: Trigger) -> None:
        self.phase = next_phase(self.phase, trigger, self._may)

    # ---- session ----
    def created(self) -> list[ServerEvent]:
        return [oe.SessionCreated(self._session_dict(), self.config.shown_options(self.ext),
                                  CAPABILITIES if self.ext.events else None)]

    def error_event(self, err: ProtocolError) -> ServerEvent:
        return error_event(err)

    def _session_dict(self) -> RealtimeSession:
        session = self.config.to_dict(self.session_id, self.ext)
        if self.ext.events:
            session["epoch"] = self.epoch
        return session

    # ---- client events: read (openai_input), then decided here ----
    def frame_plan(self) -> ReadPlan:
        return ReadPlan(self.config.input_rate, self.turns.reads_speech(self.active is not None), self.limits)

    def read_frame(self, text: str, plan: ReadPlan) -> ReadEvent:
        return self.caller_audio.read(text, plan)

    def on_frame(self, read: ReadEvent) -> Effects:
        if self.phase is Phase.CLOSED:
            return Effects()  # a frame that raced the close: nobody is told anything more
        with answering(read.event_id):
            self._may = allowed(self.phase, read.event, self.response.id if self.response else None)
            try:
                fx = _HANDLERS[type(read.event)](self, read.event)
            finally:
                self._may = None
        name_refusals(fx.events, read.event_id)  # a part refused (a field of session.update) names the event too
        return fx

    def on_client(self, msg: dict[str, Any]) -> Effects:
        """A client event as a JSON object, read and decided at once (tests)."""
        return self.on_frame(self.caller_audio.read_event(msg, self.frame_plan()))

    def _session_update(self, msg: oe.SessionUpdate) -> Effects:
        """Each field on its own: the ones the session cannot take are refused, the others apply."""
        self.config, refused = apply_update(self.config, Update(msg.session, self.started, self.ext,
                                                                self.vad is not None, self.limits))
        self.turns = turn_taking(self.config, self.ext, self.turns.segmenter.position_ms)
        return Effects([*(error_event(err) for err in refused),
                        oe.SessionUpdated(self._session_dict(), self.config.shown_options(self.ext))])

    def _heard(self, heard: Heard) -> Effects:
        return self.turns.hear(self, heard)

    def prepare(self, step: Step) -> StepInput | ChatInput:
        req = super().prepare(step)
        if isinstance(req, StepInput) and step.kind == "duplex":
            self.duplex.amend(step, req)
        return req

    def _commit(self, msg: oe.ClientEvent) -> Effects:
        return self.turns.commit(self)

    def _clear(self, msg: oe.ClientEvent) -> Effects:
        self.buffer.take()
        self.duplex.take_pending()
        return Effects([oe.BufferCleared()])

    def _item_create(self, new: NewItem) -> Effects:
        item = Item(new.id or new_id("item"), new.role, new.text, new.audio, list(new.images), spoken=False)
        self.turns.room(self, item)
        self.turns.check_item(self, item)
        previous = self.conversation.add(item, new.after)  # a duplicate id or an unknown place refuses it
        out = Effects(self.turns.trim(self, item), self.turns.item_added(self, item))
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
            return self.interrupt("client_cancelled", heard_ms=end)
        cut = item.truncate(end)
        if response is not None:
            self.turns.rollback(self, response)
        return Effects([oe.ItemTruncated(item.id, msg.content_index, round(cut))])

    def _response_create(self, msg: oe.ResponseCreate) -> Effects:
        budget = self.config.max_output_tokens if msg.max_output_tokens is None \
            else max_output_tokens(msg.max_output_tokens, "response.max_output_tokens")
        if isinstance(msg.instructions, str):  # prefilled with the turn: a text within the caller's bounds
            self.limits.text(msg.instructions, "response.instructions")
        return self.turns.create_response(self, msg, budget)

    def respond(self, budget: int | None = None, instructions: str | None = None,
                metadata: dict[str, str] | None = None) -> Effects:
        """A turn-based response: a chat turn over the conversation so far, whatever it ends with (as OpenAI's).
        Its instructions, or when the conversation gives the model nothing to answer (it is empty: a greeting; it
        ends with the assistant) the session's, come last, as a system message of this turn only."""
        items = [i for i in self.conversation.items if (i.text or i.audio is not None or i.images)
                 and i.id not in self.said]
        say = self.to_say is not None and bool(items) and items[-1] is self.to_say
        self.turns.room(self, Item("", "assistant"))  # the reply's item
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
        return self.interrupt("client_cancelled")  # IDLE refuses it (openai_states.CLIENT_EVENTS)

    def _output_clear(self, msg: oe.ClientEvent) -> Effects:
        out = self.interrupt("output_cleared") if self.active is not None else Effects()
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
            self.turns.rollback(self, r)
            out.events.append(oe.ItemTruncated(r.item.id, 0, round(cut)))
        out.events.insert(0, oe.PlaybackAcknowledged(r.id, round(r.ack_ms), committed))
        return out

    def _close(self, msg: oe.ClientEvent) -> Effects:
        return Effects(close="client_closed")

    def _heartbeat(self, msg: oe.ClientEvent) -> Effects:
        return Effects()

    # ---- the response's transitions (openai_states.TRANSITIONS) ----
    def _open_response(self, metadata: dict[str, str] | None = None) -> tuple[Effects, Response]:
        """IDLE -> RESPONDING."""
        self._move(Trigger.OPEN)
        item = self.conversation.new_item("assistant", status="in_progress", spoken=self.config.audio_out)
        if self.response is not None:
            self.past_responses.add(self.response.id)
        r = self.response = Response(new_id("resp"), item, self.epoch, before=self.duplex.last_listen,
                                     metadata=metadata)
        previous = self.conversation.add(item)  # its room: checked by `respond` (turn-based), made by `trim` (duplex)
        return Effects([*self.turns.trim(self, item), *self.turns.opening(r, self.epoch),
                        *responses.opened(r, previous, self.config, self.ext)]), r

    def _finish_response(self, trigger: Trigger, status: str, details: StatusDetails | None = None) -> Effects:
        """RESPONDING -> IDLE (COMPLETE, INTERRUPT, FAIL) or CLOSED (CLOSE)."""
        r = self.active
        assert r is not None, "only an open response finishes"
        self._move(trigger)
        r.done = True
        r.item.status = "completed" if status == "completed" else "incomplete"
        return Effects([*responses.finished(r, self.config, self.ext, status, details),
                        *self.turns.closing(r, self.epoch, status)])

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

    def interrupt(self, reason: str, heard_ms: float | None = None) -> Effects:
        """RESPONDING -> IDLE by barge-in, cancel, clear: the reply stops where the listener stopped hearing it,
        and the epoch moves on (nothing of the old one reaches the client)."""
        r = self.active
        if r is None:
            return Effects()
        heard = self.heard_ms(r) if heard_ms is None else heard_ms
        cut = r.item.truncate(heard)
        self.turns.rollback(self, r, always=True)  # the step in flight may have said more than was sent
        self.epoch += 1
        out = Effects(cancel=True)
        out.extend(self._finish_response(Trigger.INTERRUPT, "cancelled", status_details("cancelled", reason, self.ext)))
        out.events.append(oe.ItemTruncated(r.item.id, 0, round(cut)))
        self.turns.interrupted()
        return out

    # ---- step events ----
    def on_step_event(self, step: Step, ev: StepEvent) -> Effects:
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

    def _chat_event(self, step: Step, ev: StepEvent) -> Effects:
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

    def on_step_error(self, step: Step, code: ClientCode, message: str) -> Effects:
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

    def wanted(self, step: Step) -> bool:
        """A chat step whose response was cancelled while it waited need not run."""
        return step.kind != "chat" or (self.active is not None and self.active.id == step.response_id)


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

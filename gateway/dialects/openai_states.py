"""The OpenAI Realtime dialect's states and the transitions between them, written down in one place (the
shape of the h11 HTTP library's `_state.py`): what may happen in each state is a table, not a reading of flags.

The session's response, the one machine with named states:

    IDLE ------ OPEN -------> RESPONDING     OPEN: response.create (turn-based), the end of the caller's turn
      ^                           |                (server VAD, create_response), or the model speaking (duplex)
      +-- COMPLETE / INTERRUPT ---+          COMPLETE: the model listens again (duplex) / the chat turn is done
      |          / FAIL                      INTERRUPT: barge-in, response.cancel, output_audio_buffer.clear,
      |                                                 conversation.item.truncate of the open reply
    CLOSE (from either) --> CLOSED           FAIL: the stages refused the chat turn; CLOSE: the session ends

An INTERRUPT also moves the epoch on (nothing of the old one reaches the client) and cuts the reply to what was
heard; in duplex the next step then takes the LLM back to that point (`DuplexInput.rollback`). What each client
event may fire in each phase, or its refusal (the session goes on), is `CLIENT_EVENTS`; a trigger that neither
table allows is our bug (`IllegalTransition`). CLOSED hears nothing more.

The rest of the session's state is data, each part with one owner:
- who takes turns: the mode (`openai_turns`: duplex, server VAD, manual), with its speech segmenter (silent /
  speaking) and, in duplex, the overlap policy;
- the caller's duplex audio (`openai_duplex.DuplexInput`): the second being filled, what the next step carries;
- the turn-based input buffer and the conversation's items (`openai_conversation`);
- an assistant message waiting for `response.create` to voice it (`to_say`) and those voiced (`said`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..codes import ClientCode
from ..wire import ProtocolError
from . import openai_events as oe
from .openai_input import ClientInput, Heard, NewItem


class Phase(Enum):
    IDLE = "idle"  # no response open: the caller's turn (in duplex, the model listens)
    RESPONDING = "responding"  # a response is open: its deltas go to the client
    CLOSED = "closed"  # the session ended


class Trigger(Enum):
    OPEN = "open"
    COMPLETE = "complete"
    INTERRUPT = "interrupt"
    FAIL = "fail"
    CLOSE = "close"


TRANSITIONS: dict[Phase, dict[Trigger, Phase]] = {
    Phase.IDLE: {Trigger.OPEN: Phase.RESPONDING, Trigger.CLOSE: Phase.CLOSED},
    Phase.RESPONDING: {Trigger.COMPLETE: Phase.IDLE, Trigger.INTERRUPT: Phase.IDLE, Trigger.FAIL: Phase.IDLE,
                       Trigger.CLOSE: Phase.CLOSED},
    Phase.CLOSED: {},
}


@dataclass(frozen=True)
class Refused:
    """A client event its phase does not take: the code and message the client gets (`{response}`: the open
    response's id); the session goes on, its state untouched."""

    code: ClientCode
    message: str


Allowed = frozenset[Trigger]  # the triggers handling the event may fire (none: the phase stays)
STAYS: Allowed = frozenset()
OPENS: Allowed = frozenset({Trigger.OPEN})
INTERRUPTS: Allowed = frozenset({Trigger.INTERRUPT})

# What each client event does in each phase (h11's EVENT_TRIGGERED_TRANSITIONS): the triggers its handling may
# fire, each then moving the phase by TRANSITIONS, or its refusal. An event the turn-taking mode routes (an
# append, a commit, response.create) lists what it may fire in any mode. CLOSED hears nothing more.
CLIENT_EVENTS: dict[Phase, dict[type[ClientInput], Allowed | Refused]] = {
    Phase.IDLE: {
        oe.SessionUpdate: STAYS,
        Heard: OPENS,  # server VAD: the caller's speech ended, a response opens (with create_response)
        oe.BufferCommit: STAYS, oe.BufferClear: STAYS,
        NewItem: STAYS, oe.ItemRetrieve: STAYS, oe.ItemDelete: STAYS, oe.ItemTruncate: STAYS,
        oe.ResponseCreate: OPENS,  # turn-based: at once; duplex: a context step, opened when the model speaks
        oe.ResponseCancel: Refused(ClientCode.RESPONSE_CANCEL_NOT_ACTIVE, "there is no response in progress to cancel"),
        oe.OutputClear: STAYS, oe.PlaybackAck: STAYS, oe.SessionClose: STAYS, oe.Heartbeat: STAYS,
    },
    Phase.RESPONDING: {
        oe.SessionUpdate: STAYS,
        # a barge-in (server VAD's speech onset, duplex's overlap policy); under server VAD the speech may also end
        # within the same long append, and the next response open
        Heard: frozenset({Trigger.INTERRUPT, Trigger.OPEN}),
        oe.BufferCommit: STAYS, oe.BufferClear: STAYS,
        NewItem: STAYS, oe.ItemRetrieve: STAYS, oe.ItemDelete: STAYS,
        oe.ItemTruncate: INTERRUPTS,  # the open reply's item: cut where the listener stopped hearing it
        oe.ResponseCreate: Refused(ClientCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE,
                                   "response {response} is still in progress"),
        oe.ResponseCancel: INTERRUPTS, oe.OutputClear: INTERRUPTS,
        oe.PlaybackAck: STAYS, oe.SessionClose: STAYS, oe.Heartbeat: STAYS,
    },
    Phase.CLOSED: {},
}


class IllegalTransition(RuntimeError):
    """A trigger the tables do not allow in the current phase: a bug in the dialect, never the client's."""


def next_phase(phase: Phase, trigger: Trigger, allowed: Allowed | None = None) -> Phase:
    """The phase `trigger` moves to; `allowed`: the triggers of the client event being handled (None: a step
    event's, which TRANSITIONS alone bounds)."""
    if allowed is not None and trigger not in allowed:
        raise IllegalTransition(f"{trigger.name} on this client event")
    try:
        return TRANSITIONS[phase][trigger]
    except KeyError:
        raise IllegalTransition(f"{trigger.name} in {phase.name}") from None


def allowed(phase: Phase, event: ClientInput, response_id: str | None) -> Allowed:
    """What a client event may do in its phase; refused (a ProtocolError; the state is untouched) if nothing."""
    rule = CLIENT_EVENTS[phase][type(event)]
    if isinstance(rule, Refused):
        raise ProtocolError(rule.code, rule.message.format(response=response_id))
    return rule

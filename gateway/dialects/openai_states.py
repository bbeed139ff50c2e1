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
heard; in duplex the next step then takes the LLM back to that point (`DuplexInput.rollback`). A client event
that its state does not allow is refused (`REFUSED`, the session goes on); a transition not in `TRANSITIONS`
is our bug (`IllegalTransition`). CLOSED hears nothing more.

The rest of the session's state is data, each part with one owner:
- the caller's duplex audio (`openai_duplex.DuplexInput`): the second being filled, what the next step carries;
- the caller's speech under server VAD: `vad.SpeechSegmenter.in_speech` (silent / speaking);
- the turn-based input buffer and the conversation's items (`openai_conversation`);
- an assistant message waiting for `response.create` to voice it (`to_say`) and those voiced (`said`).
"""

from __future__ import annotations

from enum import Enum

from ..codes import ClientCode
from ..wire import ProtocolError
from . import openai_events as oe


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

# Client events a phase refuses: the code and message the client gets (`{response}`: the open response's id).
REFUSED: dict[tuple[Phase, type], tuple[ClientCode, str]] = {
    (Phase.IDLE, oe.ResponseCancel): (ClientCode.RESPONSE_CANCEL_NOT_ACTIVE,
                                      "there is no response in progress to cancel"),
    (Phase.RESPONDING, oe.ResponseCreate): (ClientCode.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE,
                                            "response {response} is still in progress"),
}


class IllegalTransition(RuntimeError):
    """A trigger the table does not allow in the current phase: a bug in the dialect, never the client's."""


def next_phase(phase: Phase, trigger: Trigger) -> Phase:
    try:
        return TRANSITIONS[phase][trigger]
    except KeyError:
        raise IllegalTransition(f"{trigger.name} in {phase.name}") from None


def check_allowed(phase: Phase, event: object, response_id: str | None) -> None:
    """Refuse a client event its phase does not allow (a ProtocolError; the state is untouched)."""
    refusal = REFUSED.get((phase, type(event)))
    if refusal is not None:
        code, message = refusal
        raise ProtocolError(code, message.format(response=response_id))

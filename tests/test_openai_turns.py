"""Turn-taking as mode objects in the OpenAI dialect (gateway/dialects/openai_turns.py), and the client events in
its transition table (openai_states.CLIENT_EVENTS): the dialect asks its mode, never which mode it is; each client
event has a row in each phase, and a handler can fire only what its row lists. The behaviour of each mode is
tests/test_realtime_protocol.py's, test_fuzz_dialects.py's, test_openai_spec.py's and test_realtime_e2e.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.dialects import openai, openai_states, openai_turns
from gateway.dialects.openai import _HANDLERS, OpenAIRealtimeState
from gateway.dialects.openai_extensions import ALL
from gateway.dialects.openai_states import CLIENT_EVENTS, TRANSITIONS, IllegalTransition, Phase, Refused

from .test_realtime_protocol import LoudnessVad

DIALECTS = Path(openai.__file__).parent
MODE_CLASSES = {name for name, value in vars(openai_turns).items()
                if isinstance(value, type) and issubclass(value, openai_turns.TurnTaking)}


def _mode_reads(tree: ast.AST) -> list[str]:
    """Where code asks which mode it is in: `config.duplex`, `ext.duplex`, `turn_detection.vad | .type`, or an
    isinstance of a mode class."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if (node.attr == "duplex" and owner in ("config", "ext")) or \
                    (node.attr in ("vad", "type") and owner == "turn_detection"):
                found.append(f"line {node.lineno}: {owner}.{node.attr}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance" and len(node.args) == 2:
            names = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[1])}
            if names & MODE_CLASSES:
                found.append(f"line {node.lineno}: isinstance of a mode")
    return found


@pytest.mark.parametrize("module", ["openai.py", "openai_response.py", "openai_turns.py"])
def test_the_dialect_never_asks_which_mode_it_is(module: str) -> None:
    tree = ast.parse((DIALECTS / module).read_text())
    # the one place the config's turn detection names the mode: choosing it
    body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "turn_taking")]
    assert _mode_reads(ast.Module(body=body, type_ignores=[])) == []


def test_every_client_event_has_a_row_in_each_phase_and_each_trigger_a_transition() -> None:
    for phase in (Phase.IDLE, Phase.RESPONDING):
        assert set(CLIENT_EVENTS[phase]) == set(_HANDLERS), phase
        for rule in CLIENT_EVENTS[phase].values():
            if isinstance(rule, Refused):
                continue
            # each trigger listed moves from the phase, or from where another one listed leads (an append that
            # barges in, then ends the caller's turn)
            reached = {phase} | {TRANSITIONS[phase][t] for t in rule if t in TRANSITIONS[phase]}
            assert all(any(t in TRANSITIONS[p] for p in reached) for t in rule), (phase, rule)
    assert CLIENT_EVENTS[Phase.CLOSED] == {}


def test_a_trigger_its_row_does_not_list_is_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table has teeth: a handler that moves the phase where its client event's row says it stays fails."""
    st = OpenAIRealtimeState("s", ext=ALL)
    st._open_response()
    rows = {**CLIENT_EVENTS, Phase.RESPONDING: {**CLIENT_EVENTS[Phase.RESPONDING],
                                                openai.oe.ResponseCancel: openai_states.STAYS}}
    monkeypatch.setattr(openai_states, "CLIENT_EVENTS", rows)
    with pytest.raises(IllegalTransition):
        st.on_client({"type": "response.cancel"})


@pytest.mark.parametrize(("update", "mode"), [
    ({"audio": {"input": {"turn_detection": None}}}, openai_turns.Manual),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, openai_turns.ServerVad),
    ({"duplex": True}, openai_turns.Duplex),
])
def test_the_mode_is_the_one_the_session_config_names(update: dict, mode: type) -> None:
    st = OpenAIRealtimeState("s", ext=ALL, vad=LoudnessVad().probabilities)
    assert isinstance(st.turns, openai_turns.Duplex)  # the URL opted into duplex: its first mode
    st.on_client({"type": "session.update", "session": {"duplex": False}})
    assert isinstance(st.turns, openai_turns.ServerVad)
    st.on_client({"type": "session.update", "session": update})
    assert type(st.turns) is mode

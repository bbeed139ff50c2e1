"""Error codes are enums (a stage's `minicpmo_triton.errors.Code`, the gateway's refusals `gateway.codes.ClientCode`,
which keeps the stages' client codes): a misspelt code fails where it is written, never reaches the client as
`backend_error`; and an uncoded failure in a stage tells the operator its type and place."""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gateway.codes import ClientCode
from gateway.wire import ProtocolError
from minicpmo_triton.duplex_contract import StepEvent, decode_event, encode_event
from minicpmo_triton.errors import (
    ADMISSION_REFUSALS,
    CLIENT_ERRORS,
    CLOSE_REASONS,
    RETRYABLE,
    Code,
    StepError,
    from_wire,
    to_wire,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("minicpmo_triton", "gateway", "export")


def _step_error_codes() -> list[tuple[str, ast.expr]]:
    """The code argument of every `StepError(...)` (and `super().__init__(...)` in a StepError subclass)."""
    out = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            subclasses = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                          and any(isinstance(b, ast.Name) and b.id == "StepError" for b in c.bases)]
            calls = [(n, "StepError") for n in ast.walk(tree)] + [(n, "__init__") for c in subclasses
                                                                   for n in ast.walk(c)]
            for node, name in calls:
                if isinstance(node, ast.Call) and node.args and name in (getattr(node.func, "id", None),
                                                                         getattr(node.func, "attr", None)):
                    out.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.args[0]))
    return out


def test_every_step_error_names_a_code_member() -> None:
    sites = _step_error_codes()
    assert len(sites) >= 15, sites  # the stages', the contract's, the pipeline's, the entry model's
    for where, arg in sites:
        if isinstance(arg, ast.Name) and arg.id in ("code", "STAGE_ERROR"):
            continue  # errors.py passing a code through
        assert isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "Code", \
            f"{where}: StepError's code must be a Code member, not {ast.unparse(arg)}"
        assert arg.attr in Code.__members__, f"{where}: Code.{arg.attr} is no member"


def _first_args(callee: str) -> list[tuple[str, ast.expr]]:
    """The first argument of every call to `callee` in the packages."""
    out = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and node.args and callee in (getattr(node.func, "id", None),
                                                                           getattr(node.func, "attr", None)):
                    out.append((f"{path.relative_to(ROOT)}:{node.lineno}", node.args[0]))
    return out


def test_every_protocol_error_names_a_client_code_member() -> None:
    """The gateway's refusals: no code written as a string (a variable passing a member through is fine)."""
    sites = [*_first_args("ProtocolError"), *_first_args("NoEndpoint")]
    assert len(sites) >= 100, len(sites)
    for where, arg in sites:
        assert not isinstance(arg, ast.Constant), f"{where}: the code must be a ClientCode member, not {arg.value!r}"
        if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "ClientCode":
            assert arg.attr in ClientCode.__members__, f"{where}: ClientCode.{arg.attr} is no member"
    with pytest.raises(ValueError, match="invalid_valeu"):
        ProtocolError("invalid_valeu", "a typo")  # type: ignore[arg-type]
    # a stage's client error, or its retryable refusal, becomes the client's refusal with its code kept
    assert all(ProtocolError(code, "why").code == code for code in CLIENT_ERRORS)
    assert all(ProtocolError(CLOSE_REASONS[code], "why").code == code for code in ADMISSION_REFUSALS)
    # a stage Triton could not run: the client is told the backend is unavailable (and may retry)
    assert ProtocolError(CLOSE_REASONS[Code.STAGE_UNAVAILABLE], "why").code == ClientCode.BACKEND_UNAVAILABLE
    assert all(ClientCode(CLOSE_REASONS[code]) for code in RETRYABLE)


def test_a_code_that_is_no_member_is_refused_where_it_is_raised() -> None:
    with pytest.raises(ValueError, match="invalid_voce"):
        StepError("invalid_voce", "a typo")  # a string: what a type checker refuses too
    assert StepError("invalid_voice", "from the wire").code is Code.INVALID_VOICE


def test_codes_keep_their_meaning_on_the_way_to_the_gateway() -> None:
    for code in Code:
        err = from_wire(to_wire(StepError(code, "why")), "token2wav")
        back = decode_event(*encode_event(StepEvent.error(err)).values())
        assert back.code is code and isinstance(back.code, Code)
    assert from_wire("[made_up] why", "llm").code is Code.STAGE_ERROR  # a newer stage's code: the server's fault
    assert from_wire(to_wire(IndexError("list index out of range")), "llm").code is Code.STAGE_ERROR  # a stage's bug
    # no stage's answer but Triton's own (the stub died, the model reloads): the stage did not run, the client may
    # retry (it used to end sessions in flight during a stage death with 1011 backend_error)
    unavailable = from_wire("Stub process 'llm_0_0' is not healthy.", "llm")
    assert unavailable.code is Code.STAGE_UNAVAILABLE and unavailable.code in RETRYABLE
    assert CLOSE_REASONS[Code.STAGE_UNAVAILABLE] == "backend_unavailable"
    # what the gateway does with them: the voice stage's refusal ends the session as invalid_voice
    assert CLOSE_REASONS[Code.INVALID_VOICE] == "invalid_voice" and Code.BAD_AUDIO in CLIENT_ERRORS


class _Logger:
    lines: list[tuple[str, str]] = []

    @classmethod
    def log_error(cls, text: str) -> None:
        cls.lines.append(("error", text))

    @classmethod
    def log_warn(cls, text: str) -> None:
        cls.lines.append(("warn", text))


def _fake_pb_utils() -> Any:
    """What triton_models reads of the Python backend's module, outside Triton (Triton is outside the code here)."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Logger = _Logger
    pb.TritonError = lambda message: message
    pb.InferenceResponse = lambda *args, error=None: ("response", args, error)
    return pb


def test_an_uncoded_failure_in_a_stage_is_logged_with_its_type_and_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    monkeypatch.delitem(sys.modules, "minicpmo_triton.serving.triton_models", raising=False)
    triton_models = importlib.import_module("minicpmo_triton.serving.triton_models")
    try:
        def compute() -> None:
            secret = ["the caller's words"]
            secret[3]  # the bug under test

        try:
            compute()
        except IndexError as exc:
            bug = exc
        _Logger.lines.clear()
        _, _, error = triton_models._response(bug, "llm")
        assert error.startswith("[stage_error] IndexError")  # the row's error still goes back to the caller
        [(level, line)] = _Logger.lines
        assert level == "error" and line.startswith("llm: ") and "IndexError" in line
        assert "test_errors.py" in line and "compute" in line  # where it was raised
        assert "caller" not in line  # never the message: it may quote the caller's input
        _Logger.lines.clear()
        triton_models._response(StepError(Code.BAD_AUDIO, "the caller's audio is bad"), "llm")
        assert _Logger.lines == []  # a coded refusal is the client's business, not the operator's
    finally:
        sys.modules.pop("minicpmo_triton.serving.triton_models", None)

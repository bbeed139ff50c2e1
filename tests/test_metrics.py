"""The gateway's metrics as the shell records them (gateway/metrics.py): one session driven through a spoken step, a
barge-in, a refusal and its close, against a stand-in Triton (`test_shell_offload`'s), then the exposition read:
every series named in docs/deploy.md with its HELP and TYPE, the labels from fixed sets, and nothing of the
caller's (words, a close reason of its own) in a name or a label."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from gateway.dialects.openai import OpenAIRealtimeState
from gateway.dialects.openai_extensions import ALL
from gateway.metrics import CLOSE_REASONS, STEP_PERIOD_S, EndpointView, Metrics
from gateway.settings import Settings
from gateway.shell import Session
from minicpmo_triton.duplex_contract import StepEvent
from tests.test_shell_offload import FakeTriton, append, until

DOCS = Path(__file__).resolve().parent.parent / "docs" / "deploy.md"
SECRET = "zanzibar marmalade"  # the caller's words


def samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def test_a_session_is_counted_where_things_happen_and_its_words_are_not() -> None:
    metrics = Metrics()
    triton = FakeTriton()
    state = OpenAIRealtimeState("sess_metrics", ext=ALL, vad=None)  # duplex: a step per second
    session = Session(state, triton, Settings(), resumable=True, metrics=metrics)
    metrics.session_opened(state.dialect)
    await session.handle(json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}, "instructions": SECRET}}))
    await session.handle(append(1.0, loud=False))  # a step goes to "Triton"
    triton.events.put_nowait(StepEvent("text", text=SECRET, metrics={"kv_cache_length": 100}))
    triton.events.put_nowait(StepEvent("audio", audio=np.zeros(24_000, np.float32), metrics={"kv_cache_length": 100}))
    await until(lambda: state.active is not None and metrics.first_audio.labels("openai")._sum.get() > 0,
                "the reply's first audio went out")
    await session.handle(json.dumps({"type": "response.cancel"}))  # the caller cuts the reply
    await session.handle("{" + SECRET)  # not JSON: refused, the session goes on
    await session.close(f"{SECRET} (a reason a client gave)")

    text, content_type = metrics.exposition()
    exposed = text.decode()
    got = samples(exposed)
    assert content_type.startswith("text/plain")
    assert got['minicpmo_gateway_step_latency_seconds_count{dialect="openai"}'] == 1
    assert got['minicpmo_gateway_step_queue_seconds_count{dialect="openai"}'] == 1
    assert got['minicpmo_gateway_first_audio_seconds_count{dialect="openai"}'] == 1
    assert got['minicpmo_gateway_barge_in_seconds_count{dialect="openai"}'] == 1
    assert got['minicpmo_gateway_refusals_total{code="invalid_json",dialect="openai"}'] == 1
    assert got['minicpmo_gateway_sessions_opened_total{dialect="openai"}'] == 1
    assert got['minicpmo_gateway_sessions_closed_total{dialect="openai",reason="other"}'] == 1
    assert got['minicpmo_gateway_late_chunks_total{dialect="openai"}'] == 0  # answered within its second
    assert SECRET.split()[0] not in exposed and SECRET.split()[1] not in exposed


def test_late_chunks_are_the_steps_past_the_period_and_labels_come_from_fixed_sets() -> None:
    metrics = Metrics()
    for seconds in (0.2, STEP_PERIOD_S, STEP_PERIOD_S + 0.01, 3.0):
        metrics.step_answered("backend", seconds)
    metrics.session_closed("backend", "client_disconnected")
    metrics.session_closed("backend", "whatever a caller wrote")
    metrics.healed("reload")
    metrics.refresh(2, 64, 1, True, [EndpointView("triton-0:8001", 2, 46, True, False, 12.34, 5, 1)])
    metrics.refresh(2, 64, 1, True, [EndpointView("triton-0:8001", 2, None, True, False, 0.0, 7, 1)])
    metrics.refresh(0, 64, 0, False, [])  # the endpoint left the list: shown empty, not frozen
    got = samples(metrics.exposition()[0].decode())
    assert got['minicpmo_gateway_late_chunks_total{dialect="backend"}'] == 2
    assert got['minicpmo_gateway_step_latency_seconds_bucket{dialect="backend",le="1.0"}'] == 2
    assert got['minicpmo_gateway_sessions_closed_total{dialect="backend",reason="client_disconnected"}'] == 1
    assert got['minicpmo_gateway_sessions_closed_total{dialect="backend",reason="other"}'] == 1
    assert got['minicpmo_gateway_heals_total{action="reload"}'] == 1
    assert got['minicpmo_gateway_placements_total{endpoint="triton-0:8001"}'] == 7  # counted once each
    assert got['minicpmo_gateway_sessions{endpoint="triton-0:8001"}'] == 0
    assert got["minicpmo_gateway_ready"] == 0 and got["minicpmo_gateway_max_sessions"] == 64
    assert "client_disconnected" in CLOSE_REASONS


def test_docs_name_every_series_with_its_type() -> None:
    exposed = Metrics().exposition()[0].decode()
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposed, re.M))
    helps = dict(re.findall(r"^# HELP (\S+) (.+)$", exposed, re.M))
    docs = DOCS.read_text()
    assert len(families) >= 20
    for name, kind in families.items():
        assert helps.get(name), name
        base = name.removesuffix("_total")
        [row] = [line for line in docs.splitlines() if re.match(rf"\| `{base}(_total)?[`{{]", line)]
        assert f"| {kind} |" in row, f"docs/deploy.md does not name {name} as a {kind}"


def test_the_dashboard_plots_documented_series() -> None:
    dashboard = json.loads((DOCS.parent.parent / "deploy" / "grafana" / "minicpmo.json").read_text())
    docs = DOCS.read_text()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    for name in {n for e in exprs for n in re.findall(r"\b(minicpmo_\w+|nv_inference_\w+)", e)}:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        base = re.sub(r"^minicpmo_(duplex|llm|tts|token2wav)_live_sequences$", "minicpmo_<model>_live_sequences", base)
        assert f"`{base.removesuffix('_total')}" in docs or name.startswith("nv_inference_"), name

"""The fleet view, end to end (docs/deploy.md, "Metrics"): a real Prometheus (Debian's `prometheus`, set up by
scripts/setup.sh) on deploy/prometheus.yml, its targets pointed at a gateway of two workers (`--workers 2`: one
exposition for both) and a tritonserver, while real sessions run; then its HTTP API is asked what it saw.

- the step histograms count exactly the steps the callers had answered (clients on both workers' own ports);
- refusals are counted by code, as the callers were told them;
- late chunks: the entry model's batch window, set to hold a step 1.5 s once 3 sessions are live, makes the loaded
  phase's steps late; the count lies between the steps the callers saw surely late (over 1 s + slack) and those
  they saw late at all (their latency includes what the gateway's does not: the network, the frame's reading);
- Triton's port is scraped too, its stage series with their HELP and TYPE.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
import yaml

from gateway.triton import free_port
from minicpmo_client.backend import ConversationResult, converse

from .conftest import REPO, RunningTriton, triton_with

pytestmark = [pytest.mark.ops, pytest.mark.asyncio(loop_scope="function")]

KEY = "ops-test-key"
SLACK_S = 0.3  # what a caller's latency holds beyond the gateway's: the network, the frame's reading, its own loop
# The door before the LLM holds 1.5 s from 3 live sessions on (minicpmo_triton/serving/rendezvous.py): the load's
# steps late.
HELD_DOOR = {"MINICPMO_LLM_BATCH_WINDOW_MS": "1500", "MINICPMO_LLM_BATCH_MIN_SESSIONS": "3",
             "MINICPMO_LLM_BATCH_MAX_SESSIONS": "1000", "MINICPMO_LLM_BATCH_TARGET": "1000",
             "MINICPMO_LLM_BATCH_BUDGET_MS": "100000"}


@pytest.fixture(scope="module")
def held_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningTriton]:
    yield from triton_with(HELD_DOOR, tmp_path_factory.mktemp("held"))


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def workers(held_triton: RunningTriton, tmp_path: Path) -> Iterator[int]:
    """`gateway.serve --workers 2` with an API key; its public port (each worker also on port + 1 + i)."""
    port = free_port()
    env = {**os.environ, "MINICPMO_API_KEYS": KEY}
    with open(tmp_path / "workers.log", "ab") as log:
        parent = subprocess.Popen([sys.executable, "-m", "gateway.serve", "--workers", "2", "--port", str(port),
                                   "--triton-url", held_triton.endpoint], cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not all(_ready(p) for p in (port + 1, port + 2)):
            assert parent.poll() is None and time.monotonic() < deadline, (tmp_path / "workers.log").read_text()
            time.sleep(0.2)
        yield port
    finally:
        parent.terminate()
        try:
            parent.wait(timeout=40)
        except subprocess.TimeoutExpired:
            parent.kill()


class Prometheus:
    """A real Prometheus on deploy/prometheus.yml, its targets and key file replaced by the test's."""

    def __init__(self, gateway_port: int, triton_metrics_port: int, folder: Path) -> None:
        binary = shutil.which("prometheus")
        assert binary, "Debian's prometheus package is not installed (bash scripts/setup.sh installs it)"
        config = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
        config["global"]["scrape_interval"] = "1s"
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        (folder / "key").write_text(KEY)
        jobs["gateway"]["authorization"]["credentials_file"] = str(folder / "key")
        jobs["gateway"]["static_configs"] = [{"targets": [f"127.0.0.1:{gateway_port}"]}]
        jobs["triton"]["static_configs"] = [{"targets": [f"127.0.0.1:{triton_metrics_port}"]}]
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(folder / "prometheus.log", "ab")
        self.process = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self._answers():
            assert self.process.poll() is None and time.monotonic() < deadline, (folder / "prometheus.log").read_text()
            time.sleep(0.2)

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, promql: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, promql: str) -> float:
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else 0.0

    def by(self, promql: str, label: str) -> dict[str, float]:
        return {r["metric"][label]: float(r["value"][1]) for r in self.query(promql)}

    def wait(self, promql: str, expected: float, timeout_s: float = 30.0) -> float:
        """Until Prometheus has scraped what the gateway has counted (a scrape a second)."""
        deadline = time.monotonic() + timeout_s
        while (got := self.value(promql)) != expected and time.monotonic() < deadline:
            time.sleep(0.5)
        return got

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


async def refused(url: str, first: str | None = None, headers: dict[str, str] | None = None) -> list[str]:
    """The codes of the errors a caller is sent, until the socket closes or goes quiet."""
    codes = []
    async with websockets.connect(url, additional_headers=headers or {}) as ws:
        if first is not None:
            with contextlib.suppress(websockets.ConnectionClosed):  # refused already: what it said is still read
                await ws.send(first)
        try:
            async with asyncio.timeout(3):
                async for raw in ws:
                    ev = json.loads(raw)
                    if ev.get("type") == "error":
                        codes.append(ev["error"]["code"])
        except (TimeoutError, websockets.ConnectionClosed):
            pass
    return codes


def steps_answered(results: list[ConversationResult]) -> list[float]:
    """Each step's latency as its caller saw it: the append sent, to its first event."""
    return [t.first_event_at - t.sent_at for r in results for t in r.timings if t.first_event_at is not None]


async def test_prometheus_sees_what_the_callers_saw(workers: int, held_triton: RunningTriton, speech,
                                                    tmp_path: Path) -> None:
    prom = Prometheus(workers, held_triton.server.ports.metrics, tmp_path)
    try:
        audio = speech("Could you tell me the way to the railway station, and how long the walk takes from here?")
        audio = audio[:5 * 16_000]
        own = [f"ws://127.0.0.1:{workers + 1 + i}/backend?key={KEY}" for i in range(2)]  # each worker for sure

        # Refusals: no key (/backend, /v1/realtime), a mode that does not exist, a frame that is not JSON.
        public = f"ws://127.0.0.1:{workers}"
        told = []
        told += await refused(f"{public}/backend", json.dumps({"type": "session.init", "payload": {}}))
        told += await refused(f"{public}/v1/realtime")
        told += await refused(f"{public}/v1/realtime?mode=telepathy&key={KEY}")
        told += await refused(f"{public}/v1/realtime?key={KEY}", "{not json")
        assert set(told) >= {"unauthorized", "invalid_mode", "invalid_json"}, told

        # Quiet: two sessions (the door is not held), one on each worker.
        quiet = await asyncio.gather(*(converse(url, audio, close=False) for url in own))
        # Load: four at once, their seconds aligned: the door holds each second's steps 1.5 s.
        loaded = await asyncio.gather(*(converse(own[i % 2], audio, close=False) for i in range(4)))

        seen = steps_answered(quiet + loaded)
        assert len(seen) == 6 * 5
        steps = prom.wait('sum(minicpmo_gateway_step_latency_seconds_count{dialect="backend"})', len(seen))
        assert steps == len(seen)
        assert prom.value('sum(minicpmo_gateway_step_queue_seconds_count{dialect="backend"})') == len(seen)
        assert prom.value('sum(minicpmo_gateway_sessions_opened_total{dialect="backend"})') == 6

        late = prom.value("sum(minicpmo_gateway_late_chunks_total)")
        surely, at_all = sum(s > 1.0 + SLACK_S for s in seen), sum(s > 1.0 for s in seen)
        assert 0 < surely <= late <= at_all, (surely, late, at_all, sorted(seen))
        # the SLO query the dashboard plots: p95 of the loaded steps over 1 s, the quiet ones under
        p95 = prom.value("histogram_quantile(0.95, sum by (le) (rate(minicpmo_gateway_step_latency_seconds_bucket"
                         "[5m])))")
        assert p95 > 1.0

        counted = prom.by("sum by (code) (minicpmo_gateway_refusals_total)", "code")
        assert {code: int(n) for code, n in counted.items() if n} == dict(Counter(told)), (counted, told)
        by_dialect = prom.by("sum by (dialect) (minicpmo_gateway_refusals_total)", "dialect")
        assert by_dialect.get("minicpm") == told.count("invalid_mode")

        # the gauges: both workers' sessions ended; the endpoint's room known; Triton's own port scraped
        assert prom.wait("sum(minicpmo_gateway_active_sessions)", 0) == 0
        assert prom.value(f'minicpmo_gateway_endpoint_room{{endpoint="{held_triton.grpc_url}"}}') > 0
        assert prom.value('up{job="triton"}') == 1 and prom.value('up{job="gateway"}') == 1
        assert prom.value("minicpmo_duplex_live_sequences") == 0
        assert prom.query("minicpmo_llm_window_slides_total")  # there, at 0: short calls never slide the window
        metadata = httpx.get(f"{prom.url}/api/v1/metadata", timeout=10).json()["data"]
        for name, kind in (("minicpmo_duplex_live_sequences", "gauge"), ("minicpmo_llm_evicted_sequences_total",
                                                                         "counter"),
                           ("minicpmo_llm_window_slides_total", "counter"),
                           ("minicpmo_gateway_step_latency_seconds", "histogram"),
                           ("minicpmo_gateway_refusals_total", "counter")):
            assert name in metadata and metadata[name][0]["type"] == kind, (name, metadata.get(name))
            assert metadata[name][0]["help"] not in ("", "Multiprocess metric"), metadata[name]  # its own words
        # every panel of the dashboard asks Prometheus something it answers; the SLO row's have data
        dashboard = json.loads((REPO / "deploy/grafana/minicpmo.json").read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                result = prom.query(target["expr"].replace("$__rate_interval", "1m"))
                if panel["gridPos"]["y"] < 16:  # the SLO rows: steps, first audio, late chunks
                    assert result, (panel["title"], target["expr"])
        # no caller content in any series or label
        series = httpx.get(f"{prom.url}/api/v1/series", params={"match[]": '{__name__=~"minicpmo_.+"}'},
                           timeout=10).json()["data"]
        text = json.dumps(series).lower()
        assert not any(word in text for word in ("railway", "station", "walk", "telepathy", "not json", KEY))
        assert np.isfinite(prom.value("sum(minicpmo_gateway_first_audio_seconds_count)"))
    finally:
        prom.close()

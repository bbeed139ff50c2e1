"""Placement, the endpoint list, correlation IDs and resume redirects as pure code (no server): each rule of
docs/deploy.md on small inputs."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from gateway import peers
from gateway.triton import endpoints, placement
from gateway.triton.placement import Candidate, NoEndpoint
from gateway.triton.pool import DOWN, LOADING, READY, EndpointPool
from gateway.triton.stream import next_correlation_id
from minicpmo_client import wire as client_wire

METRICS = """# HELP minicpmo_duplex_live_sequences Live per-session state entries
# TYPE minicpmo_duplex_live_sequences gauge
minicpmo_duplex_live_sequences 3
minicpmo_llm_live_sequences 3
minicpmo_tts_live_sequences 1
nv_inference_queue_duration_us{model="llm",version="1"} 40000
nv_inference_request_success{model="llm",version="1"} 20
nv_inference_queue_duration_us{model="tts",version="1"} 1000
nv_inference_request_success{model="tts",version="1"} 10
nv_inference_count{model="llm",version="1"} 99
"""


def test_the_list_grammar() -> None:
    specs = endpoints.parse("a:8001, b:9001 metrics=7002 sessions=48\n# a comment\nc:8001 metrics=m:1 drain")
    assert [(s.url, s.metrics_url, s.drain, s.max_sessions) for s in specs] == [
        ("a:8001", "http://a:8002/metrics", False, None),
        ("b:9001", "http://b:7002/metrics", False, 48),
        ("c:8001", "http://m:1/metrics", True, None)]
    for bad in ("a", "a:x", "a:8001 sessions=0", "a:8001 fast", "a:8001, a:8001", "a:8001 metrics=b"):
        with pytest.raises(ValueError):
            endpoints.parse(bad)


def test_metrics_are_read_per_model_and_queue_time_is_per_request_between_reads() -> None:
    first = placement.parse_metrics(METRICS)
    assert first.live == {"duplex": 3, "llm": 3, "tts": 1}
    later = placement.parse_metrics(METRICS.replace("} 40000", "} 340000").replace("} 20", "} 30"))
    assert placement.queue_ms(None, later) == 0.0  # one read says nothing about a period
    assert placement.queue_ms(first, later) == pytest.approx(30.0)  # 300 ms over 10 llm requests


def test_room_is_the_tightest_stage_less_what_was_placed_since_the_read() -> None:
    slots = {"duplex": 1024, "llm": 256, "tts": 256, "token2wav": 256}
    assert placement.room(slots, {"duplex": 10, "llm": 10, "tts": 250}, 0, 2, None) == 4  # tts: 256 - 250 - 2
    assert placement.room(slots, {"duplex": 10, "llm": 10}, 0, 0, 12) == 2  # the operator's bound is tighter
    assert placement.room(slots, None, 5, 0, None) == 251  # no read: our own sessions stand for the server's
    assert placement.room({}, None, 5, 0, None) is None  # nothing known bounds it


def test_the_most_room_wins_among_those_keeping_up() -> None:
    a = Candidate("a", True, 10, 20.0, 0)
    b = Candidate("b", True, 30, 20.0, 0)
    assert placement.choose([a, b]).url == "b"
    slow_b = Candidate("b", True, 30, placement.QUEUE_LIMIT_MS + 1, 0)
    assert placement.choose([a, slow_b]).url == "a"  # b falls behind: only when none keeps up
    assert placement.choose([slow_b]).url == "b"
    even = [Candidate("a", True, 10, 0.0, 3), Candidate("b", True, 10, 0.0, 1)]
    assert placement.choose(even).url == "b"  # a tie: where this gateway has fewer
    assert placement.choose([Candidate("a", True, None, 0.0, 5), Candidate("b", True, 1, 0.0, 0)]).url == "a"


def test_no_endpoint_is_a_coded_refusal() -> None:
    with pytest.raises(NoEndpoint) as info:
        placement.choose([Candidate("a", False, 10, 0.0, 0)])
    assert info.value.code == "not_ready"
    with pytest.raises(NoEndpoint) as info:
        placement.choose([Candidate("a", True, 0, 0.0, 0), Candidate("b", False, 9, 0.0, 0)])
    assert info.value.code == "too_many_sessions"


def test_a_pool_spreads_its_own_sessions_and_follows_its_file(tmp_path: Path) -> None:
    """Between two reads of the servers' metrics, what this gateway placed counts; the file is re-read: a drain
    flag takes effect, an endpoint that left the list drains, a malformed file keeps the last good list."""
    listing = tmp_path / "endpoints"
    listing.write_text("a:1 metrics=2\nb:3 metrics=4\n")
    on: Counter[str] = Counter()
    pool = EndpointPool("", str(listing), 5.0, lambda: on, lambda url: None)
    for e in pool.endpoints.values():
        e.state, e.stages, e.slots, e.scrape = READY, READY, {"llm": 4}, placement.parse_metrics("")
    placed = [pool.place().url for _ in range(8)]
    assert Counter(placed) == {"a:1": 4, "b:3": 4}
    with pytest.raises(NoEndpoint):
        pool.place()  # every slot taken

    listing.write_text("a:1 metrics=2 drain\n")
    pool.reload()
    assert pool.endpoints["a:1"].draining and pool.endpoints["b:3"].draining  # b left the list
    assert pool.status == "draining" and not pool.ready
    listing.write_text("a:1 metrics=2\nnot an endpoint at all\n")
    pool.reload()
    assert pool.endpoints["a:1"].draining  # the bad list was not taken
    asyncio.run(pool.close())


async def test_a_silent_endpoint_ends_its_sessions_once_after_the_bound() -> None:
    ended: list[str] = []
    pool = EndpointPool("a:1 metrics=2, b:3", None, failover_s=0.2, sessions=lambda: Counter({"a:1": 2}),
                        on_down=ended.append)
    a, b = pool.endpoints["a:1"], pool.endpoints["b:3"]
    assert a.state == LOADING
    pool._silent(a, time.monotonic(), "test")
    pool._silent(a, time.monotonic(), "test")  # still silent: one deadline, from the first unanswered probe
    assert a.state == DOWN and ended == []  # no new sessions at once; its sessions not yet ended
    pool._silent(b, time.monotonic(), "test")
    pool._answered(b)  # it answered before the bound: nothing ends
    await asyncio.sleep(0.3)
    assert ended == ["a:1"] and a.failovers == 1 and b.failovers == 0
    pool.suspect("a:1")  # a broken stream on a down endpoint: nothing more
    await asyncio.sleep(0.3)
    assert ended == ["a:1"]
    await pool.close()


def test_correlation_ids_are_63_bit_random_and_avoid_live_ones() -> None:
    ids = {next_correlation_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(0 < i < 2**63 for i in ids)
    assert max(ids) > 2**60  # the high bits are random too, not a counter's
    taken = set(range(1, 10))
    assert next_correlation_id(taken) not in taken


def test_a_token_names_its_gateway_and_another_gateway_redirects_there() -> None:
    here, there = "ws://10.0.0.1:8006", "wss://gw-2.example.com"
    token = peers.new_token(there)
    assert peers.holder(token) == there
    err = peers.redirect(token, here, "/v1/realtime")
    assert err is not None and err.code == "session_elsewhere" and err.retryable
    assert err.redirect_url == "wss://gw-2.example.com/v1/realtime"
    assert peers.redirect(token, there, "/v1/realtime") is None  # it names this gateway: the session is over
    assert peers.redirect(peers.new_token(""), here, "/v1/realtime") is None  # a lone gateway's token
    for forged in (None, 5, "x.y", "aHR0cDovL2V2aWw.s"):  # the last names http://evil: not a gateway URL
        assert peers.redirect(forged, here, "/v1/realtime") is None
    with pytest.raises(ValueError):
        peers.check_url("http://gw:8006")


def test_the_client_follows_a_redirect_keeping_its_query_and_never_dropping_tls() -> None:
    assert client_wire.redirected("ws://lb:80/v1/realtime?mode=audio&key=k", "ws://gw-2:8006/v1/realtime") == \
        "ws://gw-2:8006/v1/realtime?mode=audio&key=k"
    with pytest.raises(ValueError):
        client_wire.redirected("wss://lb/v1/realtime", "ws://gw-2:8006/v1/realtime")
    with pytest.raises(ValueError):
        client_wire.redirected("ws://lb/v1/realtime", "http://gw-2/v1/realtime")


def test_operator_routes_need_a_key_or_loopback() -> None:
    from starlette.testclient import TestClient

    from gateway.routes import create_app
    from gateway.settings import Settings

    client, operator = {"Authorization": f"Bearer {'k' * 32}"}, {"Authorization": f"Bearer {'o' * 32}"}
    keyed = TestClient(create_app(Settings(triton_url="127.0.0.1:9", api_keys=("k" * 32,),
                                           operator_keys=("o" * 32,))))
    assert keyed.get("/ready").status_code == 503  # nothing listens there: no endpoint takes sessions
    assert keyed.get("/metrics").status_code == 401
    metrics = keyed.get("/metrics", headers=client)
    assert metrics.status_code == 200 and 'minicpmo_gateway_sessions{endpoint="127.0.0.1:9"} 0' in metrics.text
    assert keyed.post("/admin/endpoints/drain", json={"endpoint": "127.0.0.1:9"}).status_code == 401
    # a client's key opens no admin call: any caller of the service could drain it
    for route in ("/admin/endpoints", "/admin/endpoints/drain"):
        refused = keyed.post(route, json={"endpoint": "127.0.0.1:9"}, headers=client) if route.endswith("drain") \
            else keyed.get(route, headers=client)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", route
    assert keyed.get("/admin/endpoints", headers=operator).status_code == 200
    drained = keyed.post("/admin/endpoints/drain", json={"endpoint": "127.0.0.1:9"}, headers=operator).json()
    assert drained["ok"] and drained["draining"]
    unknown = keyed.post("/admin/endpoints/drain", json={"endpoint": "elsewhere:1" + "x" * 1000}, headers=operator)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_endpoint"
    assert len(unknown.text) < 400  # the name is not echoed whole
    # bodies: bounded before they are read, parsed with the JSON limits: a coded 4xx, never a 500
    huge = keyed.post("/admin/endpoints/drain", content=json.dumps({"endpoint": "e" * (1 << 20)}), headers=operator)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "input_too_large" and len(huge.text) < 400
    nested = keyed.post("/admin/endpoints/drain", content="[" * 2000 + "]" * 2000, headers=operator)
    assert nested.status_code == 400 and nested.json()["error"]["code"] == "invalid_json"
    shape = keyed.post("/admin/endpoints/drain", json={"endpoint": ["127.0.0.1:9"]}, headers=operator)
    assert shape.status_code == 400 and shape.json()["error"]["code"] == "invalid_payload"
    unkeyed = TestClient(create_app(Settings(triton_url="127.0.0.1:9", api_keys=("k" * 32,))))
    assert unkeyed.get("/admin/endpoints", headers=client).status_code == 401  # no operator keys: loopback only
    open_server = TestClient(create_app(Settings(triton_url="127.0.0.1:9")))  # its client is not on loopback
    assert open_server.get("/metrics").status_code == 200
    assert open_server.get("/admin/endpoints").status_code == 401

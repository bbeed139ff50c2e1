"""Each endpoint is a module-level function that reads `app.state.edge`: it can be mounted and tried alone."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.endpoints import Edge, health, voices_check
from gateway.settings import Settings


def alone(route: Route, settings: Settings) -> TestClient:
    app = Starlette(routes=[route])
    app.state.edge = Edge.of(settings)
    return TestClient(app)


def test_health_alone() -> None:
    client = alone(Route("/health", health), Settings(api_keys=("k1",), max_sessions=3))
    body = client.get("/health").json()
    assert (body["status"], body["max_sessions"], body["active_sessions"]) == ("loading", 3, 0)
    assert "active_session_ids" not in body  # no key: counts only
    assert client.get("/health", headers={"Authorization": "Bearer k1"}).json()["active_session_ids"] == []


def test_voices_check_alone_refuses_by_status() -> None:
    settings = Settings(api_keys=("k1",), allowed_origins=("https://ok.example",))
    client = alone(Route("/v1/voices/check", voices_check, methods=["POST"]), settings)
    assert client.post("/v1/voices/check", json={"voice": "default"}).status_code == 401
    refused = client.post("/v1/voices/check", json={"voice": "default"},
                          headers={"Authorization": "Bearer k1", "Origin": "https://evil.example"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "origin_not_allowed")
    ok = client.post("/v1/voices/check", json={"voice": "default"}, headers={"Authorization": "Bearer k1"})
    assert ok.status_code == 200 and ok.json()["ok"]
    bad = client.post("/v1/voices/check", json={"voice": "nobody"}, headers={"Authorization": "Bearer k1"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_voice")

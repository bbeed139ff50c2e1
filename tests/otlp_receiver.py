"""A small OTLP/HTTP receiver for the tests: the JSON encoding (what Triton's exporter and the gateway's send), each
span kept with its trace, parent, name and attributes."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int


def _value(v: dict[str, Any]) -> Any:
    return next(iter(v.values())) if v else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.bodies: list[bytes] = []  # as sent, for the no-caller-content check
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.take(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, body: bytes) -> None:
        request = json.loads(body)
        spans = []
        for resource_spans in request.get("resourceSpans", []):
            resource = {a["key"]: _value(a["value"]) for a in resource_spans.get("resource", {}).get("attributes", [])}
            for scope_spans in resource_spans.get("scopeSpans", []):
                for s in scope_spans.get("spans", []):
                    spans.append(ReceivedSpan(
                        s["traceId"].lower(), s["spanId"].lower(), (s.get("parentSpanId") or "").lower(), s["name"],
                        str(resource.get("service.name", "")),
                        {a["key"]: _value(a["value"]) for a in s.get("attributes", [])},
                        int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"])))
        with self.lock:
            self.bodies.append(body)
            self.spans.extend(spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

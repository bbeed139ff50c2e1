"""The Triton servers a gateway places sessions on (pure parsing): `MINICPMO_TRITON_URL` as a list, or the file
`MINICPMO_TRITON_ENDPOINTS_FILE` that the gateway re-reads; one grammar for both.

    triton-0:8001                          gRPC address; its metrics page at triton-0:8002 (Triton's own port layout)
    triton-1:8001 metrics=triton-1:9002    the metrics page elsewhere (a port alone: on the same host)
    triton-2:8001 drain                    takes no new sessions; its live ones finish (a rolling update)
    triton-3:8001 sessions=48              at most this many live sessions there (the GPU's own bound),
                                           besides the sequence slots its models declare

Entries are separated by commas or new lines; `#` starts a comment.
"""

from __future__ import annotations

from dataclasses import dataclass

METRICS_PORT_OFFSET = 1  # tritonserver's defaults: HTTP 8000, gRPC 8001, metrics 8002


@dataclass(frozen=True)
class EndpointSpec:
    url: str  # host:port of its gRPC service (what tritonclient dials)
    metrics_url: str  # http://host:port/metrics
    drain: bool = False
    max_sessions: int | None = None  # None: only its models' sequence slots bound it


def _host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be host:port, not {text!r}")
    return host, int(port)


def parse_entry(entry: str) -> EndpointSpec:
    words = entry.split()
    host, port = _host_port(words[0], "a Triton endpoint")
    metrics = f"{host}:{port + METRICS_PORT_OFFSET}"
    drain, max_sessions = False, None
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key == "drain" and not value:
            drain = True
        elif key == "metrics" and value:
            metrics = f"{host}:{value}" if value.isdigit() else "{}:{}".format(*_host_port(value, "metrics="))
        elif key == "sessions" and value.isdigit() and int(value) > 0:
            max_sessions = int(value)
        else:
            raise ValueError(f"{words[0]}: unknown option {word!r} (metrics=HOST:PORT, sessions=N, drain)")
    return EndpointSpec(f"{host}:{port}", f"http://{metrics}/metrics", drain, max_sessions)


def parse(text: str) -> list[EndpointSpec]:
    """Every endpoint the text lists, in order; ValueError for a malformed entry or one listed twice."""
    specs: list[EndpointSpec] = []
    for line in text.splitlines():
        for entry in line.split("#", 1)[0].split(","):
            if entry.strip():
                specs.append(parse_entry(entry))
    urls = [s.url for s in specs]
    if len(set(urls)) != len(urls):
        raise ValueError(f"an endpoint is listed twice: {sorted(u for u in urls if urls.count(u) > 1)[0]}")
    return specs

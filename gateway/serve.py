"""`python -m gateway.serve`: start tritonserver on the model repository, then the gateway in front of it.

Secure by default: with no API keys configured the gateway is open to anyone who reaches it, so it listens on
loopback only unless told otherwise, explicitly (`--insecure`, or MINICPMO_INSECURE=1).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

import uvicorn

from . import workers
from .auth import RedactKeys
from .registry import Gateway
from .routes import create_app
from .settings import Settings, env_name
from .triton import DEFAULT_MODEL_REPOSITORY, TritonPorts, TritonServer
from .triton.launcher import CONTROL_KEY_ENV, LOOPBACK, is_loopback
from .triton.supervisor import Supervisor

WS_MAX_QUEUE = 1  # frames the WebSocket library reads ahead of a session (each up to ws_max_size)


class GatewayServer(uvicorn.Server):
    """Tells every session `server_shutdown` (and ends its Triton sequence) before uvicorn drops sockets."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.gateway.shutdown()
        await super().shutdown(sockets)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def open_refusal(host: str, settings: Settings) -> str | None:
    """Why the gateway will not listen on `host` as configured, or None when it may."""
    if is_loopback(host) or settings.api_keys or settings.insecure:
        return None
    return (f"refusing to listen on {host} with no API keys: anyone who reaches it could use the model. "
            "Set MINICPMO_API_KEYS (or MINICPMO_API_KEYS_FILE; docs/security.md), listen on 127.0.0.1, or, to "
            "serve an open gateway on purpose, pass --insecure (or set MINICPMO_INSECURE=1).")


def main(argv: list[str] | None = None) -> int:
    try:
        return _serve(argv)
    except KeyboardInterrupt:  # Ctrl-C (uvicorn re-raises the one it stopped on): every cleanup ran; no traceback
        return 128 + signal.SIGINT


def _serve(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8006)
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--triton-url", help="use running Tritons instead of starting one: host:grpc_port, or a comma "
                        "list of them (options: metrics=HOST:PORT, sessions=N, drain; docs/deploy.md)")
    parser.add_argument("--triton-ports", default="8000,8001,8002", help="http,grpc,metrics for the started Triton")
    parser.add_argument("--triton-log", type=Path, default=Path(".triton_work/tritonserver.log"))
    parser.add_argument("--triton-address", default=LOOPBACK,
                        help="interface the started Triton binds to (default loopback: only the gateway reaches it)")
    parser.add_argument("--max-sessions", type=int)
    parser.add_argument("--insecure", action="store_true",
                        help="listen on a non-loopback address with no API keys (an open server)")
    parser.add_argument("--workers", type=int, default=1,
                        help="gateway processes sharing --port (each also on its own port: docs/deploy.md)")
    parser.add_argument("--worker-port", type=int, help=argparse.SUPPRESS)  # one worker's own port (gateway.workers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    # uvicorn re-raises the signal it stopped on; make SIGTERM unwind like Ctrl-C so Triton is stopped too.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    settings = Settings.from_env()
    if args.max_sessions is not None:
        settings = replace(settings, max_sessions=args.max_sessions)
    if args.insecure:
        settings = replace(settings, insecure=True)
    refusal = open_refusal(args.host, settings)
    if refusal is not None:
        print(refusal, file=sys.stderr, flush=True)
        return 2
    if not settings.api_keys and not is_loopback(args.host):
        logging.getLogger("gateway").warning("insecure: no API keys, and listening on %s: anyone who reaches it "
                                             "is served", args.host)
    supervisor = None
    if args.triton_url:
        settings = replace(settings, triton_url=args.triton_url)
    # Given endpoints, it is a gateway in front of running Tritons (docs/deploy.md): none is started here.
    if not (args.triton_url or env_name("triton_url") in os.environ or settings.triton_endpoints_file):
        http, grpc, metrics = (int(p) for p in args.triton_ports.split(","))
        args.triton_log.parent.mkdir(parents=True, exist_ok=True)
        # Its model control calls (the healing reloads) only with a key: this gateway's (and its workers', through
        # the environment), not whoever reaches its ports
        key = settings.triton_control_key or secrets.token_urlsafe(24)
        os.environ[CONTROL_KEY_ENV] = key
        settings = replace(settings, triton_control_key=key)
        server = TritonServer(args.model_repository, TritonPorts(http, grpc, metrics), log_path=args.triton_log,
                              address=args.triton_address, control_key=key)
        print(f"starting tritonserver (log: {args.triton_log}) ...", flush=True)
        supervisor = Supervisor(server)
        try:
            server.start()
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
        supervisor.start()  # from here on, a Triton that dies is reaped and started again
        settings = replace(settings, triton_url=server.ports.endpoint)
        print(f"tritonserver ready (pid {server.pid}): grpc {server.ports.grpc_url}, "
              f"metrics {server.ports.metrics_url}", flush=True)
    try:
        if args.workers > 1:
            return workers.run(sys.argv[1:] if argv is None else argv, args.host, args.port, args.workers,
                               settings.triton_url, settings.gateway_url)
        print(f"gateway on ws://{args.host}:{args.port}/backend and /v1/realtime "
              f"(health: http://{args.host}:{args.port}/health)",
              flush=True)
        app = create_app(settings)
        if supervisor is not None:  # a stage Triton will not reload is healed by a fresh Triton (stage_health)
            app.state.gateway.owned[server.ports.grpc_url] = supervisor.server
        # ws_max_queue: the frames read ahead of the app per connection (the library holds up to 4 x max_size x
        # max_queue bytes: 2 GiB at its default of 32); past it, TCP holds the sender back
        config = uvicorn.Config(app, host=args.host, port=args.port, ws_max_size=settings.ws_max_size,
                                ws_max_queue=WS_MAX_QUEUE, ws_per_message_deflate=settings.ws_deflate,
                                log_level="info")
        for name in ("uvicorn.error", "uvicorn.access"):  # their lines carry query strings: ?key= is redacted
            logging.getLogger(name).addFilter(RedactKeys())
        own = None if args.worker_port is None else workers.sockets(args.host, args.port, args.worker_port)
        GatewayServer(config, app.state.gateway).run(sockets=own)
    finally:
        if supervisor is not None:
            supervisor.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

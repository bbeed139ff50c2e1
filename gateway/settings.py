"""Gateway settings, from the environment (MINICPMO_*) or given directly."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TEST_FAULTS_PHRASE = "raise-on-fault-frames-in-tests"


@dataclass(frozen=True)
class Settings:
    # The Triton servers sessions are placed on: a comma list (gateway.triton.endpoints' grammar), or the file
    # named here, re-read when it changes (docs/deploy.md).
    triton_url: str = "127.0.0.1:8001"
    triton_endpoints_file: str = ""
    failover_s: float = 5.0  # an endpoint silent this long: its sessions are told backend_unavailable
    # Where clients reach this very gateway (ws://host:port): resume tokens name it, and another gateway
    # sends a resume there (docs/deploy.md). Empty: one gateway, tokens name none.
    gateway_url: str = ""
    max_sessions: int = 64  # the reference demo allows 1 per worker
    max_pending_steps: int = 8  # appends waiting behind the one in flight, per session
    idle_timeout_s: float = 300.0  # no message for this long closes the session
    init_timeout_s: float = 30.0  # time to send session.init after connecting
    step_timeout_s: float = 60.0  # one duplex step on Triton
    ws_max_size: int = 16 * 1024 * 1024
    send_timeout_s: float = 10.0  # a client that reads nothing this long is closed: slow_consumer
    # permessage-deflate costs a few ms per 1 s append (base64 audio hardly compresses): off unless asked
    ws_deflate: bool = False
    disconnect_grace_s: float = 30.0  # /v1/realtime: a dropped session waits this long for session.resume
    journal_s: float = 60.0  # ... and replays what it sent in this window
    journal_bytes: int = 8 * 1024 * 1024  # ... up to this many bytes
    queue_max: int = 1000  # MiniCPM-o's dialect: callers waiting for a session slot
    # Tests only: a frame of exactly shell.FAULT_FRAME raises where it is read. On only when
    # MINICPMO_TEST_FAULTS is this very phrase, so no operator turns it on by accident.
    test_faults: bool = False
    # Access (docs/security.md): no keys means an open server (every caller is one anonymous principal).
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # browsers' Origin; empty: any (requests without Origin always pass)
    max_sessions_per_key: int = 0  # 0: only max_sessions bounds a key
    resume_attempts: int = 10  # session.resume attempts per caller (principal and address) ...
    resume_window_s: float = 60.0  # ... per this window

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        d = cls()
        return cls(
            triton_url=env.get("MINICPMO_TRITON_URL", d.triton_url),
            triton_endpoints_file=env.get("MINICPMO_TRITON_ENDPOINTS_FILE", d.triton_endpoints_file),
            failover_s=float(env.get("MINICPMO_FAILOVER_S", d.failover_s)),
            gateway_url=env.get("MINICPMO_GATEWAY_URL", d.gateway_url),
            max_sessions=int(env.get("MINICPMO_MAX_SESSIONS", d.max_sessions)),
            max_pending_steps=int(env.get("MINICPMO_MAX_PENDING_STEPS", d.max_pending_steps)),
            idle_timeout_s=float(env.get("MINICPMO_IDLE_TIMEOUT_S", d.idle_timeout_s)),
            init_timeout_s=float(env.get("MINICPMO_INIT_TIMEOUT_S", d.init_timeout_s)),
            step_timeout_s=float(env.get("MINICPMO_STEP_TIMEOUT_S", d.step_timeout_s)),
            ws_max_size=int(env.get("MINICPMO_WS_MAX_SIZE", d.ws_max_size)),
            send_timeout_s=float(env.get("MINICPMO_SEND_TIMEOUT_S", d.send_timeout_s)),
            ws_deflate=env.get("MINICPMO_WS_DEFLATE", "1" if d.ws_deflate else "0").lower() in ("1", "true", "yes"),
            disconnect_grace_s=float(env.get("MINICPMO_DISCONNECT_GRACE_S", d.disconnect_grace_s)),
            journal_s=float(env.get("MINICPMO_JOURNAL_S", d.journal_s)),
            journal_bytes=int(env.get("MINICPMO_JOURNAL_BYTES", d.journal_bytes)),
            queue_max=int(env.get("MINICPMO_QUEUE_MAX", d.queue_max)),
            test_faults=env.get("MINICPMO_TEST_FAULTS") == TEST_FAULTS_PHRASE,
            api_keys=api_keys(env),
            allowed_origins=_listed(env.get("MINICPMO_ALLOWED_ORIGINS", "")),
            max_sessions_per_key=int(env.get("MINICPMO_MAX_SESSIONS_PER_KEY", d.max_sessions_per_key)),
            resume_attempts=int(env.get("MINICPMO_RESUME_ATTEMPTS", d.resume_attempts)),
            resume_window_s=float(env.get("MINICPMO_RESUME_WINDOW_S", d.resume_window_s)),
        )


def _listed(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.replace("\n", ",").split(",") if part.strip())


def api_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    """MINICPMO_API_KEYS (comma-separated) and the keys in MINICPMO_API_KEYS_FILE (one a line, # comments)."""
    keys = list(_listed(env.get("MINICPMO_API_KEYS", "")))
    path = env.get("MINICPMO_API_KEYS_FILE")
    if path:
        lines = Path(path).read_text().splitlines()
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return tuple(keys)

"""Gateway settings: each a field here, with its default and what it does; `MINICPMO_<FIELD>` in the environment
overrides any of them (`Settings.from_env`), or they are given directly (tests). The table in docs/settings.md
is printed from here (`python -m gateway.settings`); `tests/test_settings.py` keeps the two equal.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "MINICPMO_"
TEST_FAULTS_PHRASE = "raise-on-fault-frames-in-tests"
_TRUE = ("1", "true", "yes")


def setting(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Settings:
    # The Triton servers sessions are placed on (docs/deploy.md): a comma list in gateway.triton.endpoints'
    # grammar, or the file named by triton_endpoints_file, re-read when it changes.
    triton_url: str = setting("127.0.0.1:8001", "Triton gRPC endpoints (host:port), comma-separated")
    triton_endpoints_file: str = setting("", "a file of Triton endpoints, one a line, re-read when it changes")
    failover_s: float = setting(5.0, "an endpoint silent this long: its sessions are told backend_unavailable")
    gateway_url: str = setting("", "where clients reach this very gateway (ws://host:port); resume tokens name it")
    max_sessions: int = setting(64, "live sessions, every dialect together (the reference demo allows 1 per worker)")
    max_pending_steps: int = setting(8, "steps waiting behind the one in flight, per session (more are refused)")
    idle_timeout_s: float = setting(300.0, "no message but heartbeats for this long closes the session")
    init_timeout_s: float = setting(30.0, "time to send the first message after connecting, every dialect")
    step_timeout_s: float = setting(60.0, "a step on Triton with no event for this long ends the session")
    ws_max_size: int = setting(16 * 1024 * 1024, "bytes of one WebSocket message (and of an HTTP body)")
    send_timeout_s: float = setting(10.0, "a client that reads nothing this long is closed: slow_consumer")
    # permessage-deflate costs a few ms per 1 s append (base64 audio hardly compresses): off unless asked
    ws_deflate: bool = setting(False, "offer permessage-deflate on WebSockets")
    disconnect_grace_s: float = setting(30.0, "/v1/realtime: a dropped session waits this long for session.resume")
    journal_s: float = setting(60.0, "... and replays what it sent in this window")
    journal_bytes: int = setting(8 * 1024 * 1024, "... up to this many bytes")
    queue_max: int = setting(1000, "MiniCPM-o's dialect: callers waiting for a session slot")
    # Tests only: a frame of exactly shell.FAULT_FRAME raises where it is read. On only when
    # MINICPMO_TEST_FAULTS is this very phrase, so no operator turns it on by accident.
    test_faults: bool = setting(False, f"tests only: on when set to `{TEST_FAULTS_PHRASE}`")
    # Access (docs/security.md): no keys means an open server (every caller is one anonymous principal).
    api_keys: tuple[str, ...] = setting((), "API keys, comma-separated (and MINICPMO_API_KEYS_FILE: one a line)")
    operator_keys: tuple[str, ...] = setting(
        (), "operator keys for /admin (drain), comma-separated, apart from the API keys; empty: /admin answers "
            "loopback callers only")
    allowed_origins: tuple[str, ...] = setting(
        (), "browsers' Origins, comma-separated; empty: any (requests without Origin always pass)")
    max_sessions_per_key: int = setting(16, "live sessions per key, with keys configured (0: only max_sessions)")
    max_sessions_per_address: int = setting(16, "live sessions per client address, loopback not counted (0: none)")
    resume_attempts: int = setting(10, "failed session.resume attempts per caller (principal and address) ...")
    resume_window_s: float = setting(60.0, "... per this window")
    resume_failure_delay_s: float = setting(1.0, "a failed session.resume is answered after this long")
    max_events_per_s: float = setting(100.0, "client events per connection per second, on average (0: no limit) ...")
    max_event_burst: int = setting(200, "... and at once; past either, an event is refused rate_limited")
    max_bytes_per_s: int = setting(8 << 20, "client bytes per caller (key and address; loopback per connection) "
                                            "per second, on average, bursts of two frames (ws_max_size); past it the "
                                            "next frame is read later (0: no limit)")
    # The cost model per caller (gateway/limits.py: Limits.of(settings); docs/security.md)
    # 4 KiB: voice-agent frameworks' instructions run to a few KB (a prompt is prefilled once per session); at
    # the bound a prompt still fits the context with `tiny`'s byte tokenizer (a token a byte)
    max_prompt_bytes: int = setting(4096, "UTF-8 bytes of a system prompt / instructions (a bound on its tokens)")
    max_text_bytes: int = setting(2048, "UTF-8 bytes of one text: a context, a typed message, a text to say")
    max_conversation_items: int = setting(256, "items an OpenAI-dialect conversation / a turn_based turn holds")
    max_conversation_bytes: int = setting(16 << 20, "... their text, audio and images together")
    max_images_per_message: int = setting(8, "images in one chat message / conversation item")
    max_request_pixels: int = setting(64 << 20, "pixels of all images of one message or step together")
    max_item_audio_s: float = setting(60.0, "audio of one message / conversation item / input buffer")
    voice_budget_s: float = setting(120.0, "seconds of new voice references per caller (principal and address) ...")
    voice_window_s: float = setting(600.0, "... per this window")
    voices_dir: str = setting("", "the model server's named voices (<name>.wav), for /v1/voices/check")
    # Health (gateway/stage_health.py)
    health_period_s: float = setting(1.0, "how often every stage is probed")
    health_timeout_s: float = setting(5.0, "Triton answering nothing this long: /health not ready (failover_s "
                                                "ends its sessions)")
    triton_control_key: str = setting("", "the key Triton's model control calls need (its "
                                           "--grpc-restricted-protocol); gateway.serve makes one for its own Triton")
    reloads_before_restart: int = setting(3, "broken-stage reloads before a Triton the gateway owns is restarted "
                                             "whole instead (each reload leaves the dead stub's memory mapped)")
    heal_deadline_s: float = setting(180.0, "a reload (or restart) that has not healed a broken endpoint in this long: "
                                            "the next attempt (a reload stuck loading: Triton restarted); above your "
                                            "models' load time")
    insecure: bool = setting(False, "`gateway.serve` may listen on a non-loopback address with no API keys")
    # Operators (docs/deploy.md, "Metrics" and "Traces")
    metrics: bool = setting(True, "record the latency histograms and counters on /metrics (off: only to measure "
                                  "their cost, bench/load.py --metrics)")
    otlp_endpoint: str = setting("", "an OTLP/HTTP collector (http://host:4318): a trace per duplex step, the "
                                     "gateway's spans and Triton's (empty: no tracing)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        """Every field from MINICPMO_<FIELD> when set, else its default."""
        types = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(env_name(f.name))
            if raw is not None:
                values[f.name] = _parse(f.name, types[f.name], raw)
        values["api_keys"] = api_keys(env)
        return cls(**values)


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def env_setting(name: str, env: Mapping[str, str] = os.environ) -> Any:
    """One field from MINICPMO_<FIELD> when set, else its default: for code that needs that one setting and not
    a whole `Settings` (the Triton launcher's control key)."""
    raw = env.get(env_name(name))
    if raw is None:
        return next(f.default for f in fields(Settings) if f.name == name)
    return _parse(name, typing.get_type_hints(Settings)[name], raw)


def _parse(name: str, kind: Any, raw: str) -> Any:
    if name == "test_faults":
        return raw == TEST_FAULTS_PHRASE
    if kind is bool:
        return raw.lower() in _TRUE
    if kind in (int, float, str):
        return kind(raw)
    return _listed(raw)  # tuple[str, ...]


def _listed(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.replace("\n", ",").split(",") if part.strip())


def api_keys(env: Mapping[str, str]) -> tuple[str, ...]:
    """MINICPMO_API_KEYS (comma-separated) and the keys in MINICPMO_API_KEYS_FILE (one a line, # comments)."""
    keys = list(_listed(env.get("MINICPMO_API_KEYS", "")))
    path = env.get("MINICPMO_API_KEYS_FILE")
    if path:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return tuple(keys)


def markdown_table() -> str:
    rows = ["| environment | default | what it does |", "|---|---|---|"]
    for f in fields(Settings):
        default = ", ".join(f.default) if isinstance(f.default, tuple) else f.default
        rows.append(f"| `{env_name(f.name)}` | {'(empty)' if default in ('', ()) else default} | {f.metadata['doc']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())

"""A Realtime session's configuration and `session.update` (pure code).

Accepts OpenAI's GA shape (`audio.input.format`, `audio.input.turn_detection`, `output_modalities`)
and the beta one (`input_audio_format: "pcm16"`, top-level `turn_detection`, `modalities`), plus our
extensions: `turn_detection.type: "duplex"` (the default: the model decides each second whether to
speak), the overlap policy keys, `playback_commit_policy`, and the model's sampling keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from minicpmo_triton.duplex_options import DEFAULT_SYSTEM_PROMPT, DuplexOptions, InvalidOptions

from ..limits import Limits, identifier
from ..overlap import POLICIES, OverlapSettings
from ..wire import ProtocolError

TURN_DETECTION = ("duplex", "server_vad", None)
RATES = (16_000, 24_000)
COMMIT_POLICIES = ("commit_all_on_done", "ack_only")
MAX_OUTPUT_TOKENS = 4096
MODEL_KEYS = {f.name for f in dataclasses.fields(DuplexOptions)} - {"system_prompt"} | {"do_sample"}


@dataclass(frozen=True)
class TurnDetection:
    type: str | None = "duplex"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def to_dict(self) -> dict[str, Any] | None:
        return None if self.type is None else dataclasses.asdict(self)


@dataclass(frozen=True)
class RealtimeConfig:
    instructions: str = DEFAULT_SYSTEM_PROMPT
    output_modalities: tuple[str, ...] = ("audio",)
    input_rate: int = 24_000
    output_rate: int = 24_000
    voice: str = "default"
    turn_detection: TurnDetection = field(default_factory=TurnDetection)
    overlap: OverlapSettings = field(default_factory=OverlapSettings)
    playback_commit_policy: str = "commit_all_on_done"
    max_output_tokens: int = 256  # a turn-based reply's token budget ("inf" means MAX_OUTPUT_TOKENS)
    model: dict[str, Any] = field(default_factory=dict)  # DuplexOptions keys

    @property
    def duplex(self) -> bool:
        return self.turn_detection.type == "duplex"

    @property
    def audio_out(self) -> bool:
        return "audio" in self.output_modalities

    def options(self) -> DuplexOptions:
        return DuplexOptions.from_config({**self.model, "system_prompt": self.instructions})

    def to_dict(self, session_id: str) -> dict[str, Any]:
        fmt = lambda rate: {"type": "audio/pcm", "rate": rate}  # noqa: E731 (a one-line helper, used twice)
        return {
            "id": session_id, "object": "realtime.session", "type": "realtime", "model": "minicpm-o-4.5",
            "instructions": self.instructions, "output_modalities": list(self.output_modalities),
            "audio": {
                "input": {"format": fmt(self.input_rate), "turn_detection": self.turn_detection.to_dict()},
                "output": {"format": fmt(self.output_rate), "voice": self.voice},
            },
            "overlap_policy": self.overlap.policy, "overlap_short_ack_ms": self.overlap.short_ack_ms,
            "overlap_barge_in_ms": self.overlap.barge_in_ms, "overlap_silence_rms": self.overlap.silence_rms,
            "playback_commit_policy": self.playback_commit_policy, "max_output_tokens": self.max_output_tokens,
            **self.model,
        }


def _rate(fmt: Any, param: str) -> int | None:
    if fmt is None:
        return None
    if fmt in ("pcm16", "audio/pcm"):
        return 24_000
    if isinstance(fmt, dict) and fmt.get("type", "audio/pcm") in ("audio/pcm", "pcm16"):
        rate = fmt.get("rate", 24_000)
        if rate in RATES:
            return int(rate)
        raise ProtocolError("unsupported_audio_format", f"audio/pcm at {rate} Hz: use 16000 or 24000", param)
    raise ProtocolError("unsupported_audio_format", f"only audio/pcm (16-bit little-endian) is served, got {fmt!r}",
                        param)


def _number(value: Any, kind: type, param: str, low: float, high: float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ProtocolError("invalid_value", f"{param} must be a number in [{low}, {high}]", param)
    return kind(value)


def _turn_detection(raw: Any, current: TurnDetection, param: str) -> TurnDetection:
    if raw is None:
        return TurnDetection(type=None)
    if not isinstance(raw, dict):
        raise ProtocolError("invalid_value", "turn_detection must be an object or null", param)
    kind = raw.get("type", current.type or "server_vad")
    if kind not in TURN_DETECTION:
        raise ProtocolError("invalid_value", "turn_detection.type must be duplex, server_vad or null", f"{param}.type")
    out = dataclasses.replace(current, type=kind)
    for key, kind_, low, high in (("threshold", float, 0.0, 1.0), ("prefix_padding_ms", int, 0, 5000),
                                  ("silence_duration_ms", int, 0, 10_000)):
        if raw.get(key) is not None:
            out = dataclasses.replace(out, **{key: _number(raw[key], kind_, f"{param}.{key}", low, high)})
    for key in ("create_response", "interrupt_response"):
        if raw.get(key) is not None:
            out = dataclasses.replace(out, **{key: bool(raw[key])})
    return out


def max_output_tokens(value: Any, param: str) -> int:
    if value == "inf":
        return MAX_OUTPUT_TOKENS
    return _number(value, int, param, 1, MAX_OUTPUT_TOKENS)


def apply_update(config: RealtimeConfig, session: Any, started: bool, limits: Limits | None = None) -> RealtimeConfig:
    """`session.update`'s `session` over the current config. `started`: audio has reached the model,
    so what is fixed at the Triton sequence's start (model options, instructions, duplex or not) stays."""
    if not isinstance(session, dict):
        raise ProtocolError("invalid_value", "session.update needs a `session` object", "session")
    audio = session.get("audio") if isinstance(session.get("audio"), dict) else {}
    audio_in = audio.get("input") if isinstance(audio.get("input"), dict) else {}
    audio_out = audio.get("output") if isinstance(audio.get("output"), dict) else {}
    changes: dict[str, Any] = {}

    rate_in = _rate(audio_in.get("format", session.get("input_audio_format")), "session.audio.input.format")
    rate_out = _rate(audio_out.get("format", session.get("output_audio_format")), "session.audio.output.format")
    if rate_in:
        changes["input_rate"] = rate_in
    if rate_out:
        changes["output_rate"] = rate_out
    modalities = session.get("output_modalities", session.get("modalities"))
    if modalities is not None:
        if not isinstance(modalities, list) or not set(modalities) <= {"audio", "text"} or not modalities:
            raise ProtocolError("invalid_value", "output_modalities must be [\"audio\"] or [\"text\"]",
                                "session.output_modalities")
        changes["output_modalities"] = ("audio",) if "audio" in modalities else ("text",)
    limits = limits or Limits.default()
    voice = audio_out.get("voice", session.get("voice"))
    if voice is not None:  # echoed in every response: a name, not a payload
        changes["voice"] = identifier(voice, "session.audio.output.voice", "invalid_value")
    if "turn_detection" in audio_in or "turn_detection" in session:
        raw = audio_in["turn_detection"] if "turn_detection" in audio_in else session["turn_detection"]
        td = _turn_detection(raw, config.turn_detection, "session.audio.input.turn_detection")
        if started and (td.type == "duplex") != config.duplex:
            raise ProtocolError("session_update_not_allowed",
                                "turn_detection cannot switch between duplex and turn-based once audio was sent",
                                "session.audio.input.turn_detection.type")
        changes["turn_detection"] = td
    overlap = config.overlap
    if session.get("overlap_policy") is not None:
        if session["overlap_policy"] not in POLICIES:
            raise ProtocolError("invalid_value", f"overlap_policy must be one of {', '.join(POLICIES)}",
                                "session.overlap_policy")
        overlap = dataclasses.replace(overlap, policy=session["overlap_policy"])
    for key, attr, kind, low, high in (("overlap_short_ack_ms", "short_ack_ms", int, 0, 60_000),
                                       ("overlap_barge_in_ms", "barge_in_ms", int, 0, 60_000),
                                       ("overlap_silence_rms", "silence_rms", float, 0.0, 1.0)):
        if session.get(key) is not None:
            overlap = dataclasses.replace(overlap, **{attr: _number(session[key], kind, f"session.{key}", low, high)})
    changes["overlap"] = overlap
    if session.get("playback_commit_policy") is not None:
        if session["playback_commit_policy"] not in COMMIT_POLICIES:
            raise ProtocolError("invalid_value", f"playback_commit_policy must be one of {', '.join(COMMIT_POLICIES)}",
                                "session.playback_commit_policy")
        changes["playback_commit_policy"] = session["playback_commit_policy"]

    if session.get("max_output_tokens") is not None:
        changes["max_output_tokens"] = max_output_tokens(session["max_output_tokens"], "session.max_output_tokens")

    fixed: dict[str, Any] = {}
    if session.get("instructions") is not None:
        fixed["instructions"] = limits.prompt(session["instructions"], "session.instructions")
    extra = session.get("extra_body") if isinstance(session.get("extra_body"), dict) else {}
    model = {k: v for k, v in {**session, **extra}.items() if k in MODEL_KEYS and v is not None}
    if model:
        fixed["model"] = {**config.model, **model}
    if fixed and started:
        changed = [k for k, v in fixed.items() if getattr(config, k) != v]
        if changed:
            raise ProtocolError("session_update_not_allowed",
                                f"{', '.join(changed)} can only change before the first audio", f"session.{changed[0]}")
    out = dataclasses.replace(config, **changes, **fixed)
    try:
        out.options()
    except InvalidOptions as exc:  # the init's ranges: the update is refused, the session keeps its settings
        raise ProtocolError("invalid_config", str(exc), "session") from exc
    return out

"""A Realtime session's configuration and `session.update` (pure code).

Accepts OpenAI's GA shape (`audio.input.format`, `audio.input.turn_detection`, `output_modalities`)
and the beta one (`input_audio_format: "pcm16"`, top-level `turn_detection`, `modalities`), plus our
vendor keys: `duplex` (the model's own turns, where the URL opted in: `openai_extensions`), the overlap
policy keys, `playback_commit_policy`, and the model's sampling keys.

Each field of an update is applied on its own: one the session cannot take is refused (a `ProtocolError`
for it) and the others still apply, as OpenAI's server does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minicpmo_triton.rules.duplex_options import DEFAULT_SYSTEM_PROMPT, DuplexOptions, InvalidOptions

from ..codes import ClientCode
from ..limits import Limits, identifier
from ..overlap import POLICIES, OverlapSettings
from ..wire import ProtocolError, json_object
from .openai_extensions import Extensions
from .openai_objects import AudioFormat, RealtimeSession, SemanticVadObject, ServerVadObject

VAD_TYPES = ("server_vad", "semantic_vad")  # the spec's turn detection; null: none, the client commits
DUPLEX = "duplex"  # our own: the model's turns (reported as turn_detection null, `duplex: true`)
# semantic_vad is served by the same VAD; its eagerness sets how long a silence ends the caller's turn
# (OpenAI: "low" waits longer for the caller to go on, "high" answers sooner, "auto" is "medium").
EAGERNESS_SILENCE_MS = {"low": 1000, "medium": 500, "auto": 500, "high": 250}
RATES = (16_000, 24_000)
COMMIT_POLICIES = ("commit_all_on_done", "ack_only")
MAX_OUTPUT_TOKENS = 4096
MODEL_KEYS = {f.name for f in dataclasses.fields(DuplexOptions)} - {"system_prompt"} | {"do_sample"}
TD_PARAM = "session.audio.input.turn_detection"


@dataclass(frozen=True)
class TurnDetection:
    type: str | None = "server_vad"  # server_vad | semantic_vad | duplex | None
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500  # server_vad's; semantic_vad's follows its eagerness
    eagerness: str = "auto"  # semantic_vad
    create_response: bool = True
    interrupt_response: bool = True

    @property
    def vad(self) -> bool:
        """The caller's turns are cut by the VAD."""
        return self.type in VAD_TYPES

    @property
    def silence_ms(self) -> int:
        return EAGERNESS_SILENCE_MS[self.eagerness] if self.type == "semantic_vad" else self.silence_duration_ms

    def to_dict(self) -> ServerVadObject | SemanticVadObject | None:
        """As the spec shows it: each type with its own fields; duplex has no VAD turns (null)."""
        if self.type == "server_vad":
            return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                    "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response}
        if self.type == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": self.eagerness, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response}
        return None


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
    model: dict[str, object] = field(default_factory=dict)  # DuplexOptions keys, as the client set them

    @classmethod
    def first(cls, ext: Extensions, vad: bool = True) -> RealtimeConfig:
        """A new session's: duplex where the URL opted into it, else server VAD (as OpenAI's default; with no VAD
        model installed, none: the client commits)."""
        if ext.duplex:
            return cls(turn_detection=TurnDetection(type=DUPLEX))
        return cls() if vad else cls(turn_detection=TurnDetection(type=None))

    @property
    def duplex(self) -> bool:
        return self.turn_detection.type == DUPLEX

    @property
    def audio_out(self) -> bool:
        return "audio" in self.output_modalities

    def options(self) -> DuplexOptions:
        return DuplexOptions.from_config({**self.model, "system_prompt": self.instructions})

    def to_dict(self, session_id: str, ext: Extensions) -> RealtimeSession:
        """The session as `session.created | updated` show it: the spec's fields, and ours where opted in."""
        def fmt(rate: int) -> AudioFormat:
            return {"type": "audio/pcm", "rate": rate}

        out: RealtimeSession = {
            "id": session_id, "object": "realtime.session", "type": "realtime", "model": "minicpm-o-4.5",
            "instructions": self.instructions, "output_modalities": list(self.output_modalities),
            "audio": {
                "input": {"format": fmt(self.input_rate), "turn_detection": self.turn_detection.to_dict()},
                "output": {"format": fmt(self.output_rate), "voice": self.voice},
            },
            "max_output_tokens": self.max_output_tokens,
        }
        if ext.duplex:
            out["duplex"] = self.duplex
        if ext.events:
            out.update({
                "overlap_policy": self.overlap.policy, "overlap_short_ack_ms": self.overlap.short_ack_ms,
                "overlap_barge_in_ms": self.overlap.barge_in_ms, "overlap_silence_rms": self.overlap.silence_rms,
                "playback_commit_policy": self.playback_commit_policy})
        return out

    def shown_options(self, ext: Extensions) -> dict[str, object] | None:
        """The model's options the client set, shown among the session's keys where it opted into `events`."""
        return dict(self.model) if ext.events else None


@dataclass(frozen=True)
class Update:
    """One `session.update`'s `session` object (JSON as parsed: its fields are read one by one below), and what the
    session it updates allows."""

    session: dict[str, Any]
    started: bool  # audio has reached the model: what the Triton sequence started with stays
    ext: Extensions
    vad: bool  # a VAD model is there (server_vad / semantic_vad need it)
    limits: Limits = field(default_factory=Limits.default)  # the session's cost model

    def audio(self, direction: str) -> dict[str, Any]:
        audio = self.session.get("audio")
        part = audio.get(direction) if isinstance(audio, dict) else None
        return part if isinstance(part, dict) else {}

    def fixed(self, config: RealtimeConfig, changed: RealtimeConfig, what: str) -> RealtimeConfig:
        """A change to what is fixed once the sequence started: refused then, unless it changes nothing."""
        if self.started and changed != config:
            raise ProtocolError(ClientCode.SESSION_UPDATE_NOT_ALLOWED, f"{what} can only change before the first audio",
                                f"session.{what}")
        return changed


Field = Callable[[RealtimeConfig, Update], RealtimeConfig]  # a field of the update read into the config


def _rate(fmt: Any, param: str) -> int | None:
    if fmt is None:
        return None
    if fmt in ("pcm16", "audio/pcm"):
        return 24_000
    if isinstance(fmt, dict) and fmt.get("type", "audio/pcm") in ("audio/pcm", "pcm16"):
        rate = fmt.get("rate", 24_000)
        if rate in RATES:
            return int(rate)
        raise ProtocolError(ClientCode.UNSUPPORTED_AUDIO_FORMAT, f"audio/pcm at {rate} Hz: use 16000 or 24000", param)
    raise ProtocolError(ClientCode.UNSUPPORTED_AUDIO_FORMAT,
                        f"only audio/pcm (16-bit little-endian) is served, got {fmt!r}",
                        param)


def _number(value: Any, kind: type, param: str, low: float, high: float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ProtocolError(ClientCode.INVALID_VALUE, f"{param} must be a number in [{low}, {high}]", param)
    return kind(value)


def max_output_tokens(value: Any, param: str) -> int:
    if value == "inf":
        return MAX_OUTPUT_TOKENS
    return _number(value, int, param, 1, MAX_OUTPUT_TOKENS)


def _input_format(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    rate = _rate(u.audio("input").get("format", u.session.get("input_audio_format")), "session.audio.input.format")
    return dataclasses.replace(config, input_rate=rate) if rate else config


def _output_format(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    rate = _rate(u.audio("output").get("format", u.session.get("output_audio_format")),
                 "session.audio.output.format")
    return dataclasses.replace(config, output_rate=rate) if rate else config


def _modalities(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    modalities = u.session.get("output_modalities", u.session.get("modalities"))
    if modalities is None:
        return config
    if not isinstance(modalities, list) or not modalities or not set(modalities) <= {"audio", "text"}:
        raise ProtocolError(ClientCode.INVALID_VALUE, "output_modalities must be [\"audio\"] or [\"text\"]",
                            "session.output_modalities")
    return dataclasses.replace(config, output_modalities=("audio",) if "audio" in modalities else ("text",))


def _voice(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    voice = u.audio("output").get("voice", u.session.get("voice"))
    if voice is None:
        return config
    # echoed in every response.created / done: a name, not a payload
    return dataclasses.replace(config, voice=identifier(voice, "session.audio.output.voice", ClientCode.INVALID_VALUE))


def _switch(config: RealtimeConfig, u: Update, td: TurnDetection) -> RealtimeConfig:
    """A new turn detection, if the session can take it."""
    if u.started and (td.type == DUPLEX) != config.duplex:
        raise ProtocolError(ClientCode.SESSION_UPDATE_NOT_ALLOWED,
                            "a session cannot switch between duplex and turn-based once audio was sent",
                            "session.duplex" if td.type == DUPLEX or config.duplex else f"{TD_PARAM}.type")
    if td.vad and not u.vad:
        raise ProtocolError(ClientCode.SERVER_VAD_UNAVAILABLE, "server VAD needs the silero-vad package installed",
                            f"{TD_PARAM}.type")
    return dataclasses.replace(config, turn_detection=td)


def _spec_turn_detection(raw: Any, current: TurnDetection) -> TurnDetection:
    """The spec's `turn_detection`: an object (server_vad, semantic_vad), or null / false (none)."""
    if raw is None or raw is False:  # false: Pipecat's "turn detection off"
        return TurnDetection(type=None)
    if not isinstance(raw, dict):
        raise ProtocolError(ClientCode.INVALID_VALUE, "turn_detection must be an object or null", TD_PARAM)
    kind = raw.get("type", current.type if current.vad else "server_vad")
    if kind not in VAD_TYPES:
        hint = " (the model's own turns: `session.duplex: true` on a URL with ?extensions=duplex)" \
            if kind == DUPLEX else ""
        raise ProtocolError(ClientCode.INVALID_VALUE,
                            f"turn_detection.type must be server_vad, semantic_vad or null{hint}",
                            f"{TD_PARAM}.type")
    out = dataclasses.replace(current if current.vad else TurnDetection(), type=kind)
    for key, kind_, low, high in (("threshold", float, 0.0, 1.0), ("prefix_padding_ms", int, 0, 5000),
                                  ("silence_duration_ms", int, 0, 10_000)):
        if raw.get(key) is not None:
            out = dataclasses.replace(out, **{key: _number(raw[key], kind_, f"{TD_PARAM}.{key}", low, high)})
    if raw.get("eagerness") is not None:
        if raw["eagerness"] not in EAGERNESS_SILENCE_MS:
            raise ProtocolError(ClientCode.INVALID_VALUE, f"eagerness must be one of {', '.join(EAGERNESS_SILENCE_MS)}",
                                f"{TD_PARAM}.eagerness")
        out = dataclasses.replace(out, eagerness=raw["eagerness"])
    if raw.get("create_response") is not None:
        out = dataclasses.replace(out, create_response=bool(raw["create_response"]))
    if raw.get("interrupt_response") is not None:
        out = dataclasses.replace(out, interrupt_response=bool(raw["interrupt_response"]))
    return out


def _raw_turn_detection(u: Update) -> tuple[bool, Any]:
    """Whether the update names a turn detection (GA or beta shape), and what it says."""
    audio_in = u.audio("input")
    if "turn_detection" in audio_in:
        return True, audio_in["turn_detection"]
    return "turn_detection" in u.session, u.session.get("turn_detection")


def _turn_detection(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    given, raw = _raw_turn_detection(u)
    if not given:
        return config
    td = _spec_turn_detection(raw, config.turn_detection)
    if td.type is None and config.duplex:
        return config  # what a duplex session reports (no VAD turns), sent back: it stays (`duplex: false` leaves)
    return _switch(config, u, td)


def _duplex(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    if "duplex" not in u.session:
        return config
    want = u.session["duplex"]
    if not u.ext.duplex:
        raise ProtocolError(ClientCode.INVALID_VALUE,
                            "the model's own turns are offered on /v1/realtime?extensions=duplex",
                            "session.duplex")
    if not isinstance(want, bool):
        raise ProtocolError(ClientCode.INVALID_VALUE, "duplex must be true or false", "session.duplex")
    if want == config.duplex:
        return config
    if want:
        return _switch(config, u, TurnDetection(type=DUPLEX))
    given, raw = _raw_turn_detection(u)  # leaving duplex: for the turn detection this update names, if any
    return _switch(config, u, _spec_turn_detection(raw, TurnDetection()) if given else TurnDetection())


def _one_of(u: Update, key: str, choices: tuple[str, ...]) -> str | None:
    value = u.session.get(key)
    if value is not None and value not in choices:
        raise ProtocolError(ClientCode.INVALID_VALUE, f"{key} must be one of {', '.join(choices)}", f"session.{key}")
    return value


def _overlap_policy(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    policy = _one_of(u, "overlap_policy", POLICIES)
    return config if policy is None else dataclasses.replace(config, overlap=dataclasses.replace(config.overlap,
                                                                                                 policy=policy))


def _overlap_number(key: str, attr: str, kind: type, high: float) -> Field:
    def read(config: RealtimeConfig, u: Update) -> RealtimeConfig:
        if u.session.get(key) is None:
            return config
        value = _number(u.session[key], kind, f"session.{key}", 0, high)
        return dataclasses.replace(config, overlap=dataclasses.replace(config.overlap, **{attr: value}))
    return read


def _commit_policy(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    policy = _one_of(u, "playback_commit_policy", COMMIT_POLICIES)
    return config if policy is None else dataclasses.replace(config, playback_commit_policy=policy)


def _max_output_tokens(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    value = u.session.get("max_output_tokens")
    if value is None:
        return config
    return dataclasses.replace(config, max_output_tokens=max_output_tokens(value, "session.max_output_tokens"))


def _instructions(config: RealtimeConfig, u: Update) -> RealtimeConfig:
    text = u.session.get("instructions")
    if text is None:
        return config
    return u.fixed(config, dataclasses.replace(config, instructions=u.limits.prompt(text, "session.instructions")),
                   "instructions")


def _model_key(key: str) -> Field:
    def read(config: RealtimeConfig, u: Update) -> RealtimeConfig:
        extra = json_object(u.session, "extra_body")
        value = extra.get(key, u.session.get(key))
        if value is None:
            return config
        changed = u.fixed(config, dataclasses.replace(config, model={**config.model, key: value}), key)
        try:  # the init's ranges: the key is refused, the session keeps its value
            changed.options()
        except InvalidOptions as exc:
            raise ProtocolError(ClientCode.INVALID_CONFIG, str(exc), f"session.{key}") from exc
        return changed
    return read


FIELDS: tuple[Field, ...] = (
    _input_format, _output_format, _modalities, _voice, _turn_detection, _duplex, _overlap_policy,
    _overlap_number("overlap_short_ack_ms", "short_ack_ms", int, 60_000),
    _overlap_number("overlap_barge_in_ms", "barge_in_ms", int, 60_000),
    _overlap_number("overlap_silence_rms", "silence_rms", float, 1.0),
    _commit_policy, _max_output_tokens, _instructions, *(_model_key(k) for k in sorted(MODEL_KEYS)),
)


def apply_update(config: RealtimeConfig, update: Update) -> tuple[RealtimeConfig, list[ProtocolError]]:
    """The update's fields over the config, each on its own: the new config and each field refused."""
    refused: list[ProtocolError] = []
    for read in FIELDS:
        try:
            config = read(config, update)
        except ProtocolError as err:
            refused.append(err)
    return config, refused

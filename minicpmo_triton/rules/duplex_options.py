"""A session's duplex settings, from `session.init`'s `system_prompt` and `config` (validated once)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..model_config import DuplexDefaults
from .duplex_window import WINDOW_MODES
from .sampling import sampling_problems, temperature_problem

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
_D = DuplexDefaults()
MAX_SPEAK_TOKENS = 256  # max_new_speak_tokens_per_chunk: 1..256
MAX_FORCE_LISTEN = 3600  # force_listen_count: 0..3600 (an hour of 1 s chunks)
MAX_SEED = 2**63 - 1  # seed: 0..2**63-1 (it travels as an int64)


class InvalidOptions(ValueError):
    pass


@dataclass(frozen=True)
class DuplexOptions:
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    temperature: float = _D.temperature
    top_k: int = _D.top_k
    top_p: float = _D.top_p
    repetition_penalty: float = _D.repetition_penalty
    length_penalty: float = _D.length_penalty
    max_new_speak_tokens_per_chunk: int = _D.max_new_speak_tokens_per_chunk
    force_listen_count: int = _D.force_listen_count
    tts_temperature: float = _D.tts_temperature
    seed: int = 0
    # MiniCPM-o's DuplexWindowConfig keys. `basic` by default: a call lasts as long as the caller stays (the
    # demo's service leaves it `off` and ends the call at the context's end; `off` does that here too).
    sliding_window_mode: str = "basic"
    basic_window_high_tokens: int = _D.window_high_tokens
    basic_window_low_tokens: int = _D.window_low_tokens
    context_max_units: int = _D.window_max_units
    context_previous_max_tokens: int = _D.window_previous_tokens

    @classmethod
    def from_config(cls, config: dict[str, Any], defaults: DuplexDefaults | None = None) -> DuplexOptions:
        """Accept the reference's DuplexConfig keys; `do_sample: false` means greedy decoding."""
        d = defaults or DuplexDefaults()
        base = cls(temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                   repetition_penalty=d.repetition_penalty, length_penalty=d.length_penalty,
                   max_new_speak_tokens_per_chunk=d.max_new_speak_tokens_per_chunk,
                   force_listen_count=d.force_listen_count, tts_temperature=d.tts_temperature)
        known = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in config.items():
            if key == "do_sample":
                if value is False:
                    values["temperature"] = 0.0
                    values["tts_temperature"] = 0.0
                continue
            f = known.get(key)
            if f is None or value is None:
                continue  # the reference's config is open-ended: ignore keys we do not use
            kind = {"str": str, "int": int, "float": float}[str(f.type)]
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
                raise InvalidOptions(f"config.{key} must be a {kind.__name__}, got {value!r}")
            try:
                values[key] = kind(value)
            except OverflowError as exc:  # an int too large for a float
                raise InvalidOptions(f"config.{key} is out of range") from exc
        out = dataclasses.replace(base, **values)
        out._check_ranges()
        return out

    def _check_ranges(self) -> None:
        problems = sampling_problems(self.temperature, self.top_k, self.top_p, self.repetition_penalty,
                                     self.length_penalty)
        if tts := temperature_problem(self.tts_temperature):
            problems["tts_temperature"] = tts
        if not 1 <= self.max_new_speak_tokens_per_chunk <= MAX_SPEAK_TOKENS:
            problems["max_new_speak_tokens_per_chunk"] = f"must be within [1, {MAX_SPEAK_TOKENS}]"
        if not 0 <= self.force_listen_count <= MAX_FORCE_LISTEN:
            problems["force_listen_count"] = f"must be within [0, {MAX_FORCE_LISTEN}]"
        if not 0 <= self.seed <= MAX_SEED:
            problems["seed"] = "must be within [0, 2**63-1]"
        if self.sliding_window_mode not in WINDOW_MODES:
            problems["sliding_window_mode"] = f"must be one of {', '.join(WINDOW_MODES)}"
        if not 0 < self.basic_window_low_tokens <= self.basic_window_high_tokens < _D.context_tokens:
            problems["basic_window_high_tokens"] = (f"and basic_window_low_tokens: 0 < low <= high < "
                                                    f"{_D.context_tokens} (the context)")
        if not 1 <= self.context_max_units <= MAX_FORCE_LISTEN:
            problems["context_max_units"] = f"must be within [1, {MAX_FORCE_LISTEN}]"
        if not 0 <= self.context_previous_max_tokens <= _D.context_tokens // 2:
            problems["context_previous_max_tokens"] = f"must be within [0, {_D.context_tokens // 2}]"
        if problems:
            raise InvalidOptions("; ".join(f"config.{name} {why}" for name, why in problems.items()))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

"""A session's duplex settings, from `session.init`'s `system_prompt` and `config` (validated once)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .model_config import DuplexDefaults

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
_D = DuplexDefaults()


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
            values[key] = kind(value)
        out = dataclasses.replace(base, **values)
        if out.temperature < 0 or out.tts_temperature < 0 or not 0 < out.top_p <= 1 or out.top_k < 0:
            raise InvalidOptions("sampling settings out of range (temperature >= 0, 0 < top_p <= 1, top_k >= 0)")
        if not 1 <= out.max_new_speak_tokens_per_chunk <= 256 or out.force_listen_count < 0:
            raise InvalidOptions("max_new_speak_tokens_per_chunk must be 1..256, force_listen_count >= 0")
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

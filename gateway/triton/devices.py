"""Where each stage model of a Triton server runs, for /health (pure parsing, and one read of Triton's index).

A model that loaded publishes `minicpmo_stage_device{model="token2wav",device="cuda:0 (device path)"} 1` on the
server's metrics page (minicpmo_triton/triton_models.py); one that refused to load (a GPU given and out of reach:
`device_unavailable`) has none, and Triton keeps its reason in the model repository index: its coded refusal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

DEVICE_METRIC = "minicpmo_stage_device"
STAGE_MODELS = ("audio_encoder", "vision_encoder", "llm", "tts", "token2wav")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_SAMPLE = re.compile(rf"^{DEVICE_METRIC}\{{([^}}]*)\}} 1(?:\.0*)?$")


def parse_devices(metrics: str) -> dict[str, str]:
    """model -> where it runs, from a metrics page."""
    out = {}
    for line in metrics.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = dict(_LABEL.findall(match[1]))
            if "model" in labels and "device" in labels:
                out[labels["model"]] = labels["device"]
    return out


def refused(index: Mapping[str, Any]) -> dict[str, str]:
    """model -> why it is not loaded, for the models of a repository index (`get_model_repository_index`) that
    Triton could not load."""
    return {m["name"]: f"not loaded: {m.get('reason') or 'no reason given'}"
            for m in index.get("models", []) if m.get("state") == "UNAVAILABLE"}


async def refusals(client: Any, timeout_s: float) -> dict[str, str]:
    """The refused models of a server (empty when the index cannot be read)."""
    try:
        return refused(await client.get_model_repository_index(as_json=True, client_timeout=timeout_s))
    except Exception:  # noqa: BLE001 (the listing is for the operator; the probe's verdict stands without it)
        return {}

"""Where each stage model of a Triton server runs, for /health (pure parsing, and one read of Triton's index).

A model that loaded publishes `minicpmo_<model>_device{device="cuda:0 (device path)"} 1` on the server's
metrics page (minicpmo_triton/serving/triton_models.py); one that refused to load (a GPU given and out of reach:
`device_unavailable`) is not ready in the model repository index, where Triton keeps its reason: its coded
refusal. The index says which models are loaded (a model's samples may outlive its unloading on the page).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_LABEL = re.compile(r'(\w+)="([^"]*)"')
_SAMPLE = re.compile(r"^minicpmo_(\w+)_device\{([^}]*)\} 1(?:\.0*)?$")  # minicpmo_<model>_device


def parse_devices(metrics: str) -> dict[str, str]:
    """model -> where it runs, from a metrics page."""
    out = {}
    for line in metrics.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = dict(_LABEL.findall(match[2]))
            if "device" in labels:
                out[match[1]] = labels["device"]
    return out


def listing(metrics: str, index: Mapping[str, Any]) -> dict[str, str]:
    """model -> where it runs (a loaded model, by its sample on the page), or why it is not loaded (its state, and
    Triton's reason when it failed), for every model of the repository index (`get_model_repository_index`)."""
    where = parse_devices(metrics)
    out = {}
    for model in index.get("models", []):
        name, state = model["name"], model.get("state", "")
        if state == "READY":
            out[name] = where.get(name, "loaded")
        elif state == "UNAVAILABLE":
            out[name] = f"not loaded: {model.get('reason') or 'no reason given'}"
        else:
            out[name] = state.lower() or "unknown"
    return out


async def read(client: Any, metrics: str, timeout_s: float) -> dict[str, str]:
    """A server's listing (empty when its index cannot be read: the probe's verdict stands without it)."""
    try:
        index = await client.get_model_repository_index(as_json=True, client_timeout=timeout_s)
    except Exception:  # noqa: BLE001 (the listing is for the operator)
        return {}
    return listing(metrics, index)

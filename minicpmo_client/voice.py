"""`check_voice`: ask the server whether a voice (a name, or reference audio) would be accepted, before any
session (`POST /v1/voices/check`, docs/realtime.md)."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np

from .events import ClientError
from .wire import http_base


@dataclass(frozen=True)
class VoiceCheck:
    duration_s: float | None
    sample_rate: int | None


def _request(voice: str | np.ndarray, sample_rate: int) -> dict[str, object]:
    if isinstance(voice, str):
        return {"voice": voice}
    audio = np.ascontiguousarray(voice, "<f4")
    return {"audio": base64.b64encode(audio.tobytes()).decode("ascii"), "format": "f32", "sample_rate": sample_rate}


def _post(url: str, body: dict[str, object], headers: dict[str, str], timeout_s: float) -> VoiceCheck:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            err = json.loads(exc.read()).get("error") or {}
        except (ValueError, AttributeError):
            err = {}
        if exc.code == 404 and not err:
            raise ClientError("voice_check_unavailable", f"{url}: this server has no voice check") from exc
        raise ClientError(err.get("code", f"http_{exc.code}"), err.get("message", str(exc))) from exc
    except OSError as exc:
        raise ClientError("connection_failed", f"{url}: {exc}", retryable=True) from exc
    return VoiceCheck(answer.get("duration_s"), answer.get("sample_rate"))


async def check_voice(url: str, voice: str | np.ndarray, *, sample_rate: int = 16_000, api_key: str | None = None,
                      timeout_s: float = 30.0) -> VoiceCheck:
    """`voice`: a voice name, or reference audio (float32 mono at `sample_rate`, 16 or 24 kHz).
    `url`: the server's address, `ws://` or `http://` (its path is ignored). Raises ClientError with the
    server's code (`invalid_voice`, ...) when it would refuse the voice."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = f"{http_base(url)}/v1/voices/check"
    return await asyncio.to_thread(_post, endpoint, _request(voice, sample_rate), headers, timeout_s)

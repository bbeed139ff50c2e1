"""Float PCM as the server takes it from clients: finite samples within +-MAX_SAMPLE_ABS.

Float PCM is nominally within +-1; a resampler's overshoot on a full-scale signal (24 -> 16 kHz, soxr)
stays well under 2, so 2.0 refuses nothing real while keeping the encoders' log-mel and the LLM's
logits finite (finite but enormous samples, 1e30, made NaN logits). The gateway answers `bad_audio`
for a chunk outside it; the stages check it again for whoever calls them directly.
"""

from __future__ import annotations

import numpy as np

MAX_SAMPLE_ABS = 2.0


def pcm_problem(audio: np.ndarray) -> str | None:
    """Why these samples are refused, or None when they are fine."""
    if not len(audio):
        return None
    peak = float(np.max(np.abs(audio)))
    if not np.isfinite(peak):
        return "audio holds NaN or infinite samples"
    if peak > MAX_SAMPLE_ABS:
        return f"audio samples must lie within +-{MAX_SAMPLE_ABS} (float PCM is nominally +-1); one is {peak:.3g}"
    return None

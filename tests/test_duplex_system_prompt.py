"""The duplex system prompt embeds a voice reference, as MiniCPM-o's demo always does: the session's own, else
the exported default (the checkpoint's assets/system_ref_audio.wav, else the demo's, export/assets/README.md)."""

from __future__ import annotations

import numpy as np
import pytest

from minicpmo_triton.duplex_contract import VoiceRefs
from minicpmo_triton.rules.duplex_options import DuplexOptions
from minicpmo_triton.serving.inprocess import InProcessStages
from minicpmo_triton.serving.pipeline import StepEvent, StepInput
from minicpmo_triton.stage_io import AudioEncoderRequest
from minicpmo_triton.stages.voice_prompt import default_ref_audio

from .conftest import MODEL_REPOSITORY, ensure_exported
from .helpers import GREEDY

pytestmark = pytest.mark.asyncio(loop_scope="function")


async def first_step_kv(stages: InProcessStages, voice: VoiceRefs | None, default: bool) -> int:
    pipeline = stages.pipeline()
    if not default:
        pipeline.default_ref_audio = None
    events: list[StepEvent] = []

    async def emit(ev: StepEvent) -> None:
        events.append(ev)

    inp = StepInput(audio=np.zeros(16_000, np.float32), options=DuplexOptions.from_config(GREEDY), voice=voice)
    await pipeline.step(1, True, True, inp, emit)
    return int(events[-1].metrics.kv_cache_length)


async def test_the_default_reference_is_embedded_unless_the_session_sends_one() -> None:
    ensure_exported()
    stages = InProcessStages(MODEL_REPOSITORY)
    ref = default_ref_audio(MODEL_REPOSITORY / "duplex" / "1")
    assert ref is not None and 5.5 < len(ref) / 16_000 < 6.5  # the demo's ref_minicpm_signature.wav, 6.0 s
    n_ref = len((await stages.audio_encoder(AudioEncoderRequest(ref))).embeds)
    bare = await first_step_kv(stages, None, default=False)
    assert await first_step_kv(stages, None, default=True) == bare + n_ref
    own = VoiceRefs(ref_audio=np.zeros(32_000, np.float32))  # a 2 s reference of the session's own
    n_own = len((await stages.audio_encoder(AudioEncoderRequest(own.ref_audio))).embeds)
    assert await first_step_kv(stages, own, default=True) == bare + n_own

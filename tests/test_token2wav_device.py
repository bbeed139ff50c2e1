"""token2wav's flow caches placed on a device (torch tensors there, updated in place: a GPU instance's placement,
`Token2WavStage.load(device=)`); the audio is unchanged by it (tests/test_token2wav_parity.py runs the official
streaming parity on both placements), and the voice prompt's frames stay held once, shared by reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import Token2WavRequest
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.token2wav import Token2WavStage
from minicpmo_triton.stages.token2wav_stream import _frames

from .conftest import MODEL_REPOSITORY, ensure_exported
from .helpers import placed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA"))])
def test_on_a_device_the_caches_are_tensors_there_and_the_prompt_is_shared(device: str) -> None:
    """With the flow caches in torch tensors (a GPU instance's placement; here also on the CPU): every session's
    caches are tensors on that device, updated there; two sessions with one voice hold the same prompt (`is`),
    their own frames in storage of their own, and what they feed the estimator for the prompt's frames is the
    prompt's own storage (data_ptr), not a copy."""
    ensure_exported()
    folder = MODEL_REPOSITORY / "token2wav" / "1"
    stage = Token2WavStage.load(folder, load_stage_config(folder), 600)
    stage.streamer = streamer = placed(stage.streamer, device)
    stage.prompts.streamer = streamer
    voice = 0.1 * np.random.default_rng(1).standard_normal(16_000).astype(np.float32)
    tokens = np.random.default_rng(0).integers(0, 6000, 100)
    for i, chunk in enumerate(np.split(tokens, 4)):
        out = stage.run([StageCall(Token2WavRequest(speech_tokens=chunk, turn_start=i == 0, voice=voice), c,
                                   start=i == 0) for c in (1, 2)])
        assert not any(isinstance(o, Exception) for o in out), out
    one, two = stage.store.get(1).stream, stage.store.get(2).stream
    assert one is not None and two is not None and one.prompt is two.prompt
    prompt = one.prompt.cache
    shared = {t.untyped_storage().data_ptr() for t in (prompt.token_att, prompt.mel_att, prompt.est_att)}
    for s in (one, two):
        own = (s.flow.cnn, s.flow.token_att, s.flow.mel_att, s.flow.est_cnn, s.flow.est_att)
        assert all(isinstance(a, torch.Tensor) and a.device.type == device for a in own)
        assert not {a.untyped_storage().data_ptr() for a in own[1:3] + own[4:]} & shared
    fed = [_frames(s.prompt.cache.est_att[0], 3, s.flow.est_prompt, streamer.xp) for s in (one, two)]
    assert fed[0].data_ptr() == fed[1].data_ptr() == prompt.est_att[0].data_ptr()

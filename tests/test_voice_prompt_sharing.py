"""A voice prompt's cached frames are held once, by the prompt, and read in place by every session with that
voice: a session's flow caches hold only its own frames. (That the audio is unchanged by it:
tests/test_token2wav_parity.py, against the official streaming.)"""

from __future__ import annotations

import numpy as np

from minicpmo_triton.model_config import load_stage_config
from minicpmo_triton.stage_io import Token2WavRequest
from minicpmo_triton.stages.base import StageCall
from minicpmo_triton.stages.token2wav import Token2WavStage
from minicpmo_triton.stages.token2wav_stream import _frames

from .conftest import MODEL_REPOSITORY, ensure_exported


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_two_sessions_with_one_voice_share_its_prompt_frames() -> None:
    ensure_exported()
    folder = MODEL_REPOSITORY / "token2wav" / "1"
    stage = Token2WavStage.load(folder, load_stage_config(folder), 600)
    voice = 0.1 * np.random.default_rng(1).standard_normal(16_000).astype(np.float32)  # 1 s: 50 prompt frames
    tokens = np.random.default_rng(0).integers(0, 6000, 100)
    for i, chunk in enumerate(np.split(tokens, 4)):  # past the prompt + 100 frames: the caches are trimmed
        stage.run([StageCall(Token2WavRequest(speech_tokens=chunk, turn_start=i == 0, voice=voice), c, start=i == 0)
                   for c in (1, 2)])
    one, two = stage.store.get(1).stream, stage.store.get(2).stream
    assert one is not None and two is not None and one.prompt is two.prompt
    prompt = one.prompt.cache
    tail = stage.streamer.d.cache_tail_frames
    for s in (one, two):
        own = (s.flow.token_att, s.flow.mel_att, s.flow.est_att)
        assert not any(np.shares_memory(a, p) for a in own for p in (prompt.token_att, prompt.mel_att, prompt.est_att))
        assert s.flow.mel_att.shape[2] == tail and s.flow.token_att.shape[2] == tail // 2  # its own frames only
        assert len(s.flow.est_prompt) == prompt.est_att.shape[4]  # the whole prompt still ends its estimator cache
    # what each session feeds the estimator for its prompt's frames is the prompt's own storage, not a copy
    fed = [_frames(s.prompt.cache.est_att[0], 3, s.flow.est_prompt) for s in (one, two)]
    assert _address(fed[0]) == _address(fed[1]) == _address(prompt.est_att[0])

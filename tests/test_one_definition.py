"""Each network is written once (issue 33): the modules the ONNX graphs are traced from (export/stages.py) are the
device engine's (minicpmo_triton/engine/), and the engine runs those modules, not a copy of their arithmetic. A
second definition of the decoder, the TTS or Whisper, in the export or in the engine, fails here. On `tiny`, on the
CPU, without an export (a second or two)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from export.modules.audio_encoder import AudioEncoderStream, LogMel, UtteranceEncoder
from export.presets import TINY_SEED, tiny
from export.stages import build_module
from minicpmo_triton.engine.build import llm_core, tts_core
from minicpmo_triton.engine.model import DuplexLLM
from minicpmo_triton.engine.tts_model import DuplexTTS
from minicpmo_triton.engine.whisper import PagedWhisper
from minicpmo_triton.engine.whisper_model import AudioEncoder
from minicpmo_triton.stages.tts import tts_rules

NETWORKS = {"llm": DuplexLLM, "tts": DuplexTTS, "audio_encoder": AudioEncoder}
# the export's own classes in those graphs: the dense-cache adapter and the utterance graph's log-mel front (the
# engine's mel is engine/mel.py); none holds a weight of its own
GRAPH_ADAPTERS = {AudioEncoderStream, UtteranceEncoder, LogMel}


def classes(module: nn.Module) -> set[type]:
    """The module classes of a network less torch's own (Linear, Embedding, ...)."""
    return {type(m) for m in module.modules() if not type(m).__module__.startswith("torch.")}


@pytest.fixture(scope="module")
def modules() -> dict[str, nn.Module]:
    return {name: build_module(tiny(), name, TINY_SEED) for name in NETWORKS}  # export/stages.py's, as exported


def test_the_graphs_are_traced_from_the_engines_modules(modules) -> None:
    graphs = [modules["llm"], modules["tts"], modules["audio_encoder"], AudioEncoderStream(modules["audio_encoder"])]
    for name, network in NETWORKS.items():
        assert isinstance(modules[name], network), name
    for graph in graphs:
        for m in graph.modules():
            if type(m) in GRAPH_ADAPTERS:
                assert not list(m.parameters(recurse=False)), type(m)
            elif not type(m).__module__.startswith("torch."):
                assert type(m).__module__.startswith("minicpmo_triton.engine."), type(m)


def test_the_engine_runs_the_same_modules(modules) -> None:
    preset = tiny()
    weights = {name: modules[name].state_dict() for name in NETWORKS}
    small = {"pool_tokens": 64, "attention": "gather", "rows": 2, "max_sessions": 2}
    llm = llm_core(weights["llm"], preset.llm, preset.tokens, np.zeros((2, preset.llm.vocab), bool), **small)
    tts = tts_core(weights["tts"], preset.tts, tts_rules(preset), **small)
    whisper = PagedWhisper.build(weights["audio_encoder"], preset.audio, pool_tokens=64, attention="gather")
    engines = {"llm": llm.runner.model.net, "tts": tts.runner.model.net, "audio_encoder": whisper.net}
    for name, net in engines.items():
        assert type(net) is NETWORKS[name], name
        assert classes(net) == classes(modules[name]) - GRAPH_ADAPTERS | {NETWORKS[name]}, name
        for key, value in net.state_dict().items():  # the engine's module holds the graph's weights, not a copy's
            assert torch.equal(value, weights[name][key]), (name, key)

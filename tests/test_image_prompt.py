"""An image's tokens in the LLM's input, token for token as the reference lays them out.

The reference is MiniCPM-o 4.5's own code (OpenBMB/MiniCPM-o-Demo @28b60cf, MiniCPMO45/, vendored unchanged
under tests/reference_code/), run as is where it is a function:
- processing_minicpmo.py `MiniCPMVImageProcessor`: `get_sliced_grid`, `get_slice_image_placeholder` (with
  `get_grid_placeholder` and `get_image_id_placeholder`), at preprocessor_config.json's `use_image_id` true,
  `slice_mode` true, `image_feature_size` 64;
- where it is a step inside a larger method, that step: `MiniCPMOProcessor._convert_omni_to_inputs` (each
  `<image>./</image>` of the prompt replaced by its placeholder, numbered from 0 over the prompt), reached from
  modeling_minicpmo_unified.py `MiniCPMO.non_streaming_prefill` (a chat turn: the message's content parts
  joined by "\\n", `use_image_id=None`, so the config's true), and `DuplexCapability.streaming_prefill` (a duplex
  step: `<unit>`, then per image `<image>`[64]`</image>` and `<slice>`[64]`</slice>` per HD slice, fed as
  tokens and embeddings, then audio).
The reference's prompt text is tokenized by the preset's tokenizer (transformers' AutoTokenizer over the real
special-token ids; tiny's byte tokenizer); the pipeline's LLM request is compared with it, the stages around the
pipeline faked (the vision stage's own code runs, over an engine that returns zeros).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from export.presets import minicpmo45, tiny
from minicpmo_triton.duplex_contract import ChatInput, ChatMessage, StepEvent, StepInput
from minicpmo_triton.media.tokenizer import TINY_SPECIALS, ByteTokenizer, HuggingFaceTokenizer, Tokenizer
from minicpmo_triton.model_config import PresetConfig
from minicpmo_triton.serving.pipeline import DuplexPipeline
from minicpmo_triton.stage_io import LlmRequest, LlmResult, VisionEncoderRequest, VisionEncoderResult
from minicpmo_triton.stages.vision_encoder import VisionEncoderStage

from .reference_checkpoint import write_tokenizer_set
from .reference_demo import demo_module
from .test_vision_reference import _png

# ---- the reference, run as published ----

IMAGE_FEATURE_SIZE = 64


def reference_processor(unk_token: str) -> Any:
    """`MiniCPMVImageProcessor` (processing_minicpmo.py:125) at preprocessor_config.json's values (`use_image_id`
    and `slice_mode` true, 64 query tokens an image); `unk` is the preset's embedding-row token."""
    return demo_module("processing_minicpmo").MiniCPMVImageProcessor(
        max_slice_nums=9, scale_resolution=448, patch_size=14, use_image_id=True, slice_mode=True,
        image_feature_size=IMAGE_FEATURE_SIZE, unk=unk_token)


def ref_chat_user_turn(processor: Any, image_sizes, text: str, first_idx: int, max_slice_nums: int):
    """`non_streaming_prefill`: content parts joined by "\\n" (`omni_mode` false), in the chat template's
    user turn; then `_convert_omni_to_inputs`' loop (processing_minicpmo.py:1566-1592): the processor's
    `get_slice_image_placeholder` per `<image>./</image>`, numbered over the prompt."""
    content = "\n".join(["<image>./</image>"] * len(image_sizes) + [text])
    prompt = "<|im_start|>user\n" + content + "<|im_end|>\n<|im_start|>assistant\n"
    chunks = re.split("(<image>./</image>)", prompt)
    image_id = 0
    for i, chunk in enumerate(chunks):
        if chunk == "<image>./</image>":
            chunks[i] = processor.get_slice_image_placeholder(image_sizes[image_id], first_idx + image_id,
                                                              max_slice_nums, None)
            image_id += 1
    return "".join(chunks)


def ref_duplex_vision_ids(tokens, image_sizes, max_slice_nums: int) -> list[int]:
    """`DuplexCapability.streaming_prefill`'s feed operations for the frames (an embedding row as `<unk>`)."""
    ids: list[int] = []
    for size in image_sizes:
        grid = reference_processor("<unk>").get_sliced_grid(size, max_slice_nums)
        num_slices = 1 if grid is None else 1 + grid[0] * grid[1]
        ids += [tokens.image, *[tokens.audio_placeholder] * IMAGE_FEATURE_SIZE, tokens.image_end]
        for _ in range(1, num_slices):
            ids += [tokens.slice, *[tokens.audio_placeholder] * IMAGE_FEATURE_SIZE, tokens.slice_end]
    return ids


# ---- the tokenizers: the reference's text -> ids ----

def tiny_reference_encode(text: str) -> list[int]:
    """tiny's byte tokenizer over a prompt, special tokens split out first (as a tokenizer's added tokens)."""
    ids = {s: 256 + i for i, s in enumerate(TINY_SPECIALS)}
    out: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, TINY_SPECIALS)) + ")", text):
        out += [ids[piece]] if piece in ids else list(piece.encode())
    return out


@pytest.fixture(scope="module")
def presets(tmp_path_factory: pytest.TempPathFactory):
    """(preset, our tokenizer, the reference's encode, the reference's `<unk>`) for tiny and the real ids."""
    from transformers import AutoTokenizer

    folder = Path(tmp_path_factory.mktemp("tokenizer"))
    write_tokenizer_set(folder)
    real = minicpmo45()
    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = HuggingFaceTokenizer(folder, set(vars(real.tokens).values()))
    return {"tiny": (tiny(), ByteTokenizer(), tiny_reference_encode, "<|audio|>"),
            "minicpm-o-4.5": (real, ours, lambda text: hf.encode(text, add_special_tokens=False), "<unk>")}


# ---- the pipeline, its stages faked around it ----

class ZeroEngine:
    name, input_names = "zeros", ["pixels", "position_ids", "tgt_sizes"]

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"embeds": np.zeros((len(feeds["pixels"]), IMAGE_FEATURE_SIZE, self.hidden), np.float32)}


class RecordingStages:
    """The real vision stage (slicing and grids) over a zero engine; the LLM records its requests."""

    def __init__(self, preset: PresetConfig) -> None:
        self.vision = VisionEncoderStage(ZeroEngine(preset.llm.hidden), preset.vision)
        self.llm_requests: list[LlmRequest] = []
        self.im_end = preset.tokens.im_end

    async def vision_encoder(self, request: VisionEncoderRequest) -> VisionEncoderResult:
        result = self.vision.run([request])[0]
        assert not isinstance(result, Exception)
        return result

    async def llm(self, call, ready=None) -> LlmResult:
        if ready is not None:
            await ready()
        self.llm_requests.append(call.request)
        if call.request.chat:
            return LlmResult(generated=np.array([self.im_end]), is_listen=False, end_of_turn=True)
        return LlmResult()  # a duplex step that listens


def run_pipeline(preset: PresetConfig, tokenizer: Tokenizer, inputs: list[StepInput | ChatInput]) -> list[LlmRequest]:
    stages = RecordingStages(preset)
    # one LLM call a step (0: prefill never split): the layout is the whole prefill's; chunking it is held to the
    # unchunked path elsewhere
    pipeline = DuplexPipeline(stages, preset, tokenizer, ttl_s=60, prefill_chunk_tokens=0)  # type: ignore[arg-type]

    async def emit(event: StepEvent) -> None:
        pass

    async def steps() -> None:
        for i, inp in enumerate(inputs):
            await pipeline.step(1, i == 0, False, inp, emit)

    asyncio.run(steps())
    return stages.llm_requests


SIZES = {  # (width, height) -> the reference's grid (cols, rows) at max_slice_nums 9
    "one slice": (300, 200),
    "2x3 grid": (1344, 896),  # 2 rows of 3
    "wide": (2000, 500),  # 1 row of 4
    "tall": (500, 2000),  # 4 rows of 1
}


def test_the_sizes_cover_the_layouts() -> None:
    processor = reference_processor("<unk>")
    assert [processor.get_sliced_grid(size, 9) for size in SIZES.values()] == [None, [3, 2], [4, 1], [1, 4]]


@pytest.mark.parametrize("preset_name", ["tiny", "minicpm-o-4.5"])
@pytest.mark.parametrize("size", list(SIZES))
def test_a_chat_image_is_laid_out_as_the_reference(presets, preset_name: str, size: str) -> None:
    preset, tokenizer, ref_encode, unk = presets[preset_name]
    width, height = SIZES[size]
    message = ChatMessage("user", "What is in the picture?", images=(_png(width, height, 1),), max_slice_nums=9)
    (request,) = run_pipeline(preset, tokenizer, [ChatInput([message], max_new_tokens=1)])
    expected = ref_encode(ref_chat_user_turn(reference_processor(unk), [(width, height)], message.text, 0, 9))
    got = request.input_ids.tolist()
    assert got[-len(expected):] == expected
    assert got[-len(expected) - 2:-len(expected)] == [preset.tokens.im_end, *ref_encode("\n")]  # the system turn
    assert len(request.embeds) == got.count(preset.tokens.audio_placeholder)


@pytest.mark.parametrize("preset_name", ["tiny", "minicpm-o-4.5"])
def test_chat_images_are_numbered_over_the_conversation(presets, preset_name: str) -> None:
    """Two images in one message, then a third in the next turn: ids 0, 1, then 2 (the prompt's third image),
    though only the new message is prefilled."""
    preset, tokenizer, ref_encode, unk = presets[preset_name]
    ref = reference_processor(unk)
    sizes = [SIZES["2x3 grid"], SIZES["one slice"], SIZES["tall"]]
    pngs = [_png(w, h, i) for i, (w, h) in enumerate(sizes)]
    first = [ChatMessage("user", "Compare them.", images=tuple(pngs[:2]), max_slice_nums=4)]
    # the reply the fake LLM gave was empty; the client sends it back as it was
    second = [*first, ChatMessage("assistant", ""), ChatMessage("user", "And this one?", images=(pngs[2],),
                                                                  max_slice_nums=4)]
    requests = run_pipeline(preset, tokenizer, [ChatInput(first, max_new_tokens=1),
                                                ChatInput(second, max_new_tokens=1)])
    turn1 = ref_encode(ref_chat_user_turn(ref, sizes[:2], "Compare them.", 0, 4))
    assert requests[0].input_ids.tolist()[-len(turn1):] == turn1
    turn2 = ref_encode(ref_chat_user_turn(ref, sizes[2:], "And this one?", 2, 4))
    assert requests[1].input_ids.tolist() == turn2  # only the new message (the reply is in the context already)


@pytest.mark.parametrize("preset_name", ["tiny", "minicpm-o-4.5"])
def test_a_duplex_step_lays_out_frames_as_the_reference(presets, preset_name: str) -> None:
    """No image ids and no line breaks in a duplex step: `<unit>`, the frames, then the second's audio."""
    preset, tokenizer, _, _ = presets[preset_name]
    sizes = list(SIZES.values())
    frames = [_png(w, h, i) for i, (w, h) in enumerate(sizes)]
    step = StepInput(audio=np.zeros(16_000, np.float32), frames=frames, max_slice_nums=[9] * len(frames))
    (request,) = run_pipeline(preset, tokenizer, [step])
    tk = preset.tokens
    expected = [tk.unit, *ref_duplex_vision_ids(tk, sizes, 9), *[tk.audio_placeholder] * preset.audio_tokens(16_000)]
    assert request.input_ids.tolist()[-len(expected):] == expected
    assert request.input_ids.tolist()[-len(expected) - 1] == tk.im_end  # the system prompt before it

"""Video frames and images through the vision stage, over the real server."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from minicpmo_triton.media.images import image_slices, slice_grid

from .helpers import append_message, deltas, open_session, recv_until
from .test_vision_reference import _png_header


def jpeg(width: int, height: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=70)
    return base64.b64encode(buf.getvalue()).decode()


def test_slicing_follows_the_image() -> None:
    assert slice_grid(448, 448, 9, 448) is None  # one slice's worth: the overview alone
    assert slice_grid(640, 480, 1, 448) is None  # max_slice_nums 1: overview only
    assert slice_grid(640, 480, 4, 448) == (1, 2)  # 1.5 slices' worth -> 2, side by side
    assert slice_grid(1344, 448, 9, 448) == (1, 3)
    # the overview and two slices, each resized keeping its aspect ratio to about 448x448 px, patch-aligned
    slices = image_slices(base64.b64decode(jpeg(640, 480)), 4).slices
    assert [(s.rows, s.cols) for s in slices] == [(28, 37), (39, 26), (39, 26)]
    assert all(s.pixels.shape == (3, 14, s.rows * s.cols * 14) for s in slices)


@pytest.mark.asyncio
async def test_frames_join_the_prefill_and_are_counted(gateway, triton, speech) -> None:
    audio = speech("Look at this picture, what do you see?")[:16_000]
    ws, _ = await open_session(gateway.ws)
    await ws.send(append_message(audio, "plain"))
    await ws.send(append_message(audio, "one", video_frames=[jpeg(640, 480)], max_slice_nums=1))
    await ws.send(append_message(audio, "hd", video_frames=[jpeg(640, 480, 1)], max_slice_nums=4))
    events = await recv_until(ws, lambda e: e.get("input_id") == "hd")
    by_id = {e["input_id"]: e for e in deltas(events) if "chunk_usage" in e}
    assert "vision_tokens" not in by_id["plain"]["metrics"]
    assert by_id["one"]["metrics"]["vision_slices"] == 1 and by_id["one"]["metrics"]["vision_tokens"] == 64
    assert by_id["hd"]["metrics"]["vision_slices"] == 3 and by_id["hd"]["metrics"]["vision_tokens"] == 192
    assert by_id["hd"]["chunk_usage"]["input_vision_tokens"] == 192
    assert by_id["hd"]["usage"]["input_vision_tokens"] == 256
    # the LLM saw them: the context grew by the vision tokens too
    growth = by_id["hd"]["metrics"]["kv_cache_length"] - by_id["one"]["metrics"]["kv_cache_length"]
    assert growth >= 192 + 10
    await ws.close()
    assert triton.wait_live(lambda lv: not any(lv.values())) == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}


@pytest.mark.asyncio
async def test_a_bad_image_gets_a_coded_error_and_the_session_goes_on(gateway, triton, speech) -> None:
    audio = speech("Here is another one.")[:16_000]
    ws, _ = await open_session(gateway.ws)
    not_an_image = base64.b64encode(b"this is not a jpeg at all").decode()
    bomb = base64.b64encode(_png_header(20_000, 20_000)).decode()  # a header claiming 400 M pixels
    for frame, code in [(not_an_image, "bad_image"), ("%%%", "bad_image"), (bomb, "bad_image")]:
        await ws.send(append_message(audio, "bad", video_frames=[frame]))
        err = await recv_until(ws, lambda e: e["type"] == "error")
        assert err[-1]["error"]["code"] == code
    await ws.send(append_message(audio, "ok", video_frames=[jpeg(320, 240)]))
    events = await recv_until(ws, lambda e: e.get("input_id") == "ok")
    assert deltas(events)[0]["chunk_usage"]["input_vision_tokens"] == 64
    assert deltas(events)[0]["chunk_index"] == 0  # the rejected steps left no trace
    await ws.close()
    assert triton.wait_live(lambda lv: not any(lv.values())) == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}


@pytest.mark.asyncio
async def test_turn_based_image_content(gateway, triton) -> None:
    ws, _ = await open_session(gateway.ws, mode="turn_based")
    await ws.send(json.dumps({"type": "input.append", "input": {"max_slice_nums": 4, "max_new_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "image": jpeg(640, 480)},
                                     {"type": "text", "text": "What is in the picture?"}]}]}}))
    done = (await recv_until(ws, lambda e: e["type"] in ("response.done", "error")))[-1]
    assert done["type"] == "response.done", done
    assert done["chunk_usage"]["input_vision_tokens"] == 192
    await ws.close()
    assert triton.wait_live(lambda lv: not any(lv.values())) == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}


@pytest.mark.asyncio
async def test_turn_based_images_carry_their_ids_and_row_breaks(gateway, triton) -> None:
    """Two images in one message, the first a 2x3 grid of HD slices: the prompt holds, beside the same text
    turn without images, the reference's `<image_id>N</image_id>`, `<image>`/`<slice>` markers, the line
    break between the grid's two rows and those joining the message's parts."""
    async def turn(images: list[str]) -> dict:
        ws, _ = await open_session(gateway.ws, mode="turn_based")
        parts = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "Compare."}]
        await ws.send(json.dumps({"type": "input.append", "input": {"max_slice_nums": 9, "max_new_tokens": 2,
                                                                    "messages": [{"role": "user", "content": parts}]}}))
        done = (await recv_until(ws, lambda e: e["type"] in ("response.done", "error")))[-1]
        await ws.close()
        assert done["type"] == "response.done", done
        return done["chunk_usage"]

    plain, pictured = await turn([]), await turn([jpeg(1344, 896, 2), jpeg(320, 240, 3)])
    assert pictured["input_vision_tokens"] == 64 * (1 + 6 + 1)
    ids = 2 * 3  # <image_id>, one digit (tiny's byte tokenizer), </image_id>
    markers = 2 * (1 + 6 + 1)  # <image></image>, <slice></slice> x 6, <image></image>
    breaks = 1 + 2  # between the grid's rows; image | image | text
    assert pictured["input_text_tokens"] - plain["input_text_tokens"] == ids + markers + breaks
    assert triton.wait_live(lambda lv: not any(lv.values())) == {"duplex": 0, "llm": 0, "tts": 0, "token2wav": 0}

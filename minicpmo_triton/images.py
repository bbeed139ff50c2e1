"""Images for the vision stage, decoded and sliced in this one place.

A frame becomes an overview (the whole image at 448x448) plus, when `max_slice_nums` > 1 and the
image is larger than one slice, a grid of HD slices chosen to match its aspect ratio (MiniCPM-V's
scheme). Pixels are RGB scaled to [-1, 1], [n, 3, 448, 448].
"""

from __future__ import annotations

import io
import math

import numpy as np

from .errors import StepError

MAX_PIXELS = 4096 * 4096


class ImageError(StepError, ValueError):
    """An image the client sent that cannot be used (`bad_image`)."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_image", message)


def slice_grid(width: int, height: int, max_slice_nums: int, size: int) -> tuple[int, int] | None:
    """(rows, cols) of HD slices, or None for the overview alone."""
    wanted = min(math.ceil(width * height / (size * size)), max_slice_nums)
    if wanted <= 1:
        return None
    candidates = [(r, n // r) for n in {wanted - 1, wanted, wanted + 1} if 1 < n <= max_slice_nums
                  for r in range(1, n + 1) if n % r == 0]
    log_ratio = math.log(width / height)
    return min(candidates, key=lambda rc: (abs(log_ratio - math.log(rc[1] / rc[0])), -rc[0] * rc[1]))


def _pixels(image: object, size: int) -> np.ndarray:
    from PIL import Image

    resized = image.resize((size, size), Image.Resampling.BICUBIC)  # type: ignore[attr-defined]
    arr = np.asarray(resized, dtype=np.float32) / 127.5 - 1.0
    return arr.transpose(2, 0, 1)


def image_slices(data: bytes, max_slice_nums: int = 1, size: int = 448) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_PIXELS:
                raise ImageError(f"image of {img.width}x{img.height} is over {MAX_PIXELS} pixels")
            image = img.convert("RGB")
    except Image.DecompressionBombError as exc:  # PIL's own guard, past 2x its MAX_IMAGE_PIXELS: not an OSError
        raise ImageError(f"image is a decompression bomb: {exc}") from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"not a decodable image: {exc}") from exc
    out = [_pixels(image, size)]
    grid = slice_grid(image.width, image.height, max_slice_nums, size)
    if grid is not None:
        rows, cols = grid
        w, h = image.width / cols, image.height / rows
        for r in range(rows):
            for c in range(cols):
                box = (round(c * w), round(r * h), round((c + 1) * w), round((r + 1) * h))
                out.append(_pixels(image.crop(box), size))
    return np.stack(out).astype(np.float32)

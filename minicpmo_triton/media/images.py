"""Images for the vision stage, decoded and sliced in this one place, as MiniCPM-V's image processor does.

An image becomes an overview (the whole image, resized keeping its aspect ratio to about 448x448 px,
patch-aligned) plus, when `max_slice_nums` > 1 and the image is larger than one slice, a grid of HD
slices chosen to match its aspect ratio. Each slice's pixels are RGB normalised with mean = std = 0.5
and laid out patch by patch, side by side ([3, 14, patches * 14], MiniCPM-V's `reshape_by_patch`), with
its patch grid (`tgt_sizes`: rows, cols). Followed: MiniCPMVImageProcessor in OpenBMB/MiniCPM-o-Demo
MiniCPMO45/processing_minicpmo.py (get_sliced_grid, find_best_resize, get_refine_size,
split_to_patches, get_sliced_images, reshape_by_patch, preprocess).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import Code, StepError

if TYPE_CHECKING:  # PIL is imported where an image is decoded (a stage that sees none never loads it)
    import PIL.Image

MAX_PIXELS = 4096 * 4096  # larger images are refused before they are decoded (decompression bombs)
# The only formats opened (the gateway refuses others at the edge): PIL would hand an EPS to Ghostscript.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")


class ImageError(StepError, ValueError):
    """An image the client sent that cannot be used (`bad_image`)."""

    def __init__(self, message: str) -> None:
        super().__init__(Code.BAD_IMAGE, message)


@dataclass(frozen=True)
class Slice:
    pixels: np.ndarray  # [3, patch, rows * cols * patch] float32: patches side by side, row-major
    rows: int  # tgt_sizes[0]: patch rows
    cols: int  # tgt_sizes[1]: patch columns


@dataclass(frozen=True)
class SlicedImage:
    slices: list[Slice]  # the overview, then the HD slices row by row
    grid: tuple[int, int] | None  # (rows, cols) of HD slices; None: the overview alone


def slice_grid(width: int, height: int, max_slice_nums: int, size: int) -> tuple[int, int] | None:
    """(rows, cols) of HD slices, or None for the overview alone (`get_sliced_grid`)."""
    multiple = min(math.ceil(width * height / (size * size)), max_slice_nums)
    if multiple <= 1:
        return None
    log_ratio = math.log(width / height)
    best, best_error = (1, 1), math.inf
    for n in (multiple - 1, multiple, multiple + 1):
        if n == 1 or n > max_slice_nums:
            continue
        for cols in (c for c in range(1, n + 1) if n % c == 0):
            error = abs(log_ratio - math.log(cols / (n // cols)))
            if error < best_error:  # the first of equals wins, as in the reference
                best, best_error = (n // cols, cols), error
    return best


def _patch_aligned(length: float, patch: int) -> int:
    return max(round(length / patch) * patch, patch)  # `ensure_divide`


def best_resize(width: float, height: float, size: int, patch: int, upscale: bool) -> tuple[int, int]:
    """(width, height) keeping the aspect ratio at about size x size px, patch-aligned (`find_best_resize`)."""
    if width * height > size * size or upscale:
        ratio = width / height
        height = int(size / math.sqrt(ratio))
        width = int(height * ratio)
    return _patch_aligned(width, patch), _patch_aligned(height, patch)


def refine_size(width: int, height: int, grid: tuple[int, int], size: int, patch: int) -> tuple[int, int]:
    """The size the whole image is resized to before it is cut into `grid` slices (`get_refine_size`)."""
    rows, cols = grid
    slice_w = _patch_aligned(width, cols) / cols
    slice_h = _patch_aligned(height, rows) / rows
    w, h = best_resize(slice_w, slice_h, size, patch, upscale=True)
    return w * cols, h * rows


def _most_patches(width: int, height: int, max_slice_nums: int, size: int, patch: int) -> int:
    """The most patches any slice of the image gets."""
    grid = slice_grid(width, height, max_slice_nums, size)
    w, h = best_resize(width, height, size, patch, upscale=grid is None)
    most = w * h
    if grid is not None:
        rw, rh = refine_size(width, height, grid, size, patch)
        most = max(most, rw // grid[1] * (rh // grid[0]))
    return most // (patch * patch)


def _by_patch(image: PIL.Image.Image, patch: int) -> Slice:
    arr = np.asarray(image, dtype=np.float32) / 255  # [H, W, 3]
    arr = (arr - np.float32(0.5)) / np.float32(0.5)
    h, w = arr.shape[0] // patch, arr.shape[1] // patch
    patches = arr.transpose(2, 0, 1).reshape(3, h, patch, w, patch).transpose(0, 2, 1, 3, 4)
    return Slice(np.ascontiguousarray(patches.reshape(3, patch, h * w * patch)), h, w)


def _decode(data: bytes) -> PIL.Image.Image:
    import PIL.Image
    from PIL import UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            with PIL.Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                if img.width * img.height > MAX_PIXELS:
                    raise ImageError(f"image of {img.width}x{img.height} is over {MAX_PIXELS} pixels")
                return img.convert("RGB")
    except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning) as exc:
        raise ImageError(f"image over the pixel limit: {exc}") from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"not a decodable image: {exc}") from exc


def image_slices(data: bytes, max_slice_nums: int = 1, size: int = 448, patch: int = 14,
                 max_patches: int = 2048) -> SlicedImage:
    """The overview, then the HD slices row by row (`get_sliced_images` + `preprocess`).

    An image so narrow that a slice would pass `max_patches` (aspect ratios past about 4000:1; the
    reference's slices grow without bound) is refused rather than given an engine shape it was not built for."""
    import PIL.Image

    image = _decode(data)
    too_many = _most_patches(image.width, image.height, max_slice_nums, size, patch)
    if too_many > max_patches:
        raise ImageError(f"image of {image.width}x{image.height} is too narrow: "
                         f"a slice of {too_many} patches is over {max_patches}")
    bicubic = PIL.Image.Resampling.BICUBIC
    grid = slice_grid(image.width, image.height, max_slice_nums, size)
    overview = best_resize(image.width, image.height, size, patch, upscale=grid is None)
    out = [_by_patch(image.resize(overview, resample=bicubic), patch)]
    if grid is not None:
        refined = image.resize(refine_size(image.width, image.height, grid, size, patch),
                               resample=bicubic)
        w, h = refined.width // grid[1], refined.height // grid[0]
        out += [_by_patch(refined.crop((c * w, r * h, (c + 1) * w, (r + 1) * h)), patch)
                for r in range(grid[0]) for c in range(grid[1])]
    return SlicedImage(out, grid)


def _torch_arange_f32(start: float, step: float, count: int) -> np.ndarray:
    """float32 values exactly as torch.arange makes them on an x86 CPU: in double, 8-wide vectors whose
    base is rounded to float32 first, 16 values a loop, the tail one by one. The rounding decides the
    ties of NaViT's bucketing (a patch at i/n == k/70 exactly)."""
    i = np.arange(count)
    lane = i % 8
    vector = ((start + step * (i - lane)).astype(np.float32).astype(np.float64) + lane * step).astype(np.float32)
    return np.where(i < count - count % 16, vector, (start + step * i).astype(np.float32))


def navit_position_ids(rows: int, cols: int, table_side: int) -> np.ndarray:
    """[rows * cols] indices into the table_side^2 position table: each patch's fractional coordinate
    bucketed into the table's cells (NaViT; `SiglipVisionEmbeddings.forward` in modeling_navit_siglip.py:
    torch.arange(0, 1 - 1e-6, 1 / n) bucketized, right=True, into torch.arange(1 / N, 1.0, 1 / N))."""
    step = 1 / table_side
    boundaries = _torch_arange_f32(step, step, math.ceil((1.0 - step) / step))

    def buckets(n: int) -> np.ndarray:
        n_step = float(np.float32(1) / np.float32(n))  # 1 / an int32 tensor: float32
        return np.searchsorted(boundaries, _torch_arange_f32(0.0, n_step, n), side="right")

    return (buckets(rows)[:, None] * table_side + buckets(cols)[None, :]).reshape(-1).astype(np.int64)

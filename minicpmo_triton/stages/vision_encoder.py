"""Vision encoder: stateless; decodes and slices each image once, then the slices of every request run
in batches of `batch_slices`, each padded to its longest slice (`get_vision_embedding`)."""

from __future__ import annotations

import numpy as np

from ..engine.exported import Engine
from ..media.images import Slice, SlicedImage, image_slices, navit_position_ids
from ..model_config import VisionDims
from ..stage_io import VisionEncoderRequest, VisionEncoderResult
from .base import isolated


def batch_inputs(slices: list[Slice], d: VisionDims) -> dict[str, np.ndarray]:
    """The engine's inputs for slices of any patch grids: pixels, position_ids, tgt_sizes (padding zero)."""
    length = max(s.rows * s.cols for s in slices)
    pixels = np.zeros((len(slices), 3, d.patch, length * d.patch), np.float32)
    position_ids = np.zeros((len(slices), length), np.int64)
    for i, s in enumerate(slices):
        pixels[i, :, :, : s.pixels.shape[-1]] = s.pixels
        position_ids[i, : s.rows * s.cols] = navit_position_ids(s.rows, s.cols, d.table_side)
    tgt_sizes = np.array([(s.rows, s.cols) for s in slices], np.int64)
    return {"pixels": pixels, "position_ids": position_ids, "tgt_sizes": tgt_sizes}


class VisionEncoderStage:
    def __init__(self, engine: Engine, dims: VisionDims) -> None:
        self.engine = engine
        self.dims = dims

    def _slices(self, request: VisionEncoderRequest) -> list[SlicedImage]:
        if len(request.max_slice_nums) not in (0, len(request.images)):
            raise ValueError("vision_encoder: one max_slice_nums per image")
        caps = request.max_slice_nums if len(request.max_slice_nums) else np.ones(len(request.images), np.int64)
        d = self.dims
        return [image_slices(bytes(img), int(n), d.scale_resolution, d.patch, d.max_patches)
                for img, n in zip(request.images, caps, strict=True)]

    def run(self, requests: list[VisionEncoderRequest]) -> list[VisionEncoderResult | Exception]:
        results: list[VisionEncoderResult | Exception] = [VisionEncoderResult() for _ in requests]
        work: list[tuple[int, list[SlicedImage]]] = []
        for i, request in enumerate(requests):
            try:
                images = self._slices(request)
            except Exception as exc:  # noqa: BLE001 (a bad image fails its own request only)
                results[i] = exc
                continue
            if images:
                work.append((i, images))
        if work:
            for (i, _), out in zip(work, isolated(self._encode, [images for _, images in work]), strict=True):
                results[i] = out
        return results

    def _encode(self, requests: list[list[SlicedImage]]) -> list[VisionEncoderResult]:
        """Every slice of every request's images, `batch_slices` at a time."""
        slices = [s for images in requests for image in images for s in image.slices]
        step = self.dims.batch_slices
        embeds = np.concatenate([self.engine.run(batch_inputs(slices[k:k + step], self.dims))["embeds"]
                                 for k in range(0, len(slices), step)])
        out, start = [], 0
        for images in requests:
            n = sum(len(image.slices) for image in images)
            grids = np.array([image.grid or (0, 0) for image in images], np.int64).reshape(-1, 2)
            out.append(VisionEncoderResult(embeds=embeds[start:start + n], grids=grids))
            start += n
        return out

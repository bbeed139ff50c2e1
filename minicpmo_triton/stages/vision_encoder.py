"""Vision encoder: stateless; decodes and slices each image once, then every slice of every request
runs in one batched forward."""

from __future__ import annotations

import numpy as np

from ..engines import Engine
from ..images import image_slices
from ..stage_io import VisionEncoderRequest, VisionEncoderResult
from .base import isolated


class VisionEncoderStage:
    def __init__(self, engine: Engine, image_size: int) -> None:
        self.engine = engine
        self.image_size = image_size

    def _pixels(self, request: VisionEncoderRequest) -> list[np.ndarray]:
        if len(request.max_slice_nums) not in (0, len(request.images)):
            raise ValueError("vision_encoder: one max_slice_nums per image")
        slices = request.max_slice_nums if len(request.max_slice_nums) else np.ones(len(request.images), np.int64)
        return [image_slices(bytes(img), int(n), self.image_size) for img, n in zip(request.images, slices,
                                                                                     strict=True)]

    def run(self, requests: list[VisionEncoderRequest]) -> list[VisionEncoderResult | Exception]:
        results: list[VisionEncoderResult | Exception] = [VisionEncoderResult() for _ in requests]
        work: list[tuple[int, list[np.ndarray]]] = []
        for i, request in enumerate(requests):
            try:
                pixels = self._pixels(request)
            except Exception as exc:  # noqa: BLE001 (a bad image fails its own request only)
                results[i] = exc
                continue
            if pixels:
                work.append((i, pixels))
        if work:
            for (i, _), out in zip(work, isolated(self._encode, [images for _, images in work]), strict=True):
                results[i] = out
        return results

    def _encode(self, requests: list[list[np.ndarray]]) -> list[VisionEncoderResult]:
        """Every slice of every request in one forward."""
        embeds = self.engine.run({"pixels": np.concatenate([p for images in requests for p in images])})["embeds"]
        out, start = [], 0
        for images in requests:
            counts = np.array([len(p) for p in images], np.int64)
            out.append(VisionEncoderResult(embeds=embeds[start:start + counts.sum()], slices=counts))
            start += int(counts.sum())
        return out

"""An image's place in the LLM's input: its tokens around the slices' embeddings, as MiniCPM-o 4.5 lays them out.

The reference has two layouts (OpenBMB/MiniCPM-o-Demo @28b60cf, MiniCPMO45/):
- a chat turn (`modeling_minicpmo_unified.py: MiniCPMO.non_streaming_prefill` and `chat`, through
  `processing_minicpmo.py: MiniCPMOProcessor._convert_omni_to_inputs` and
  `MiniCPMVImageProcessor.get_slice_image_placeholder` with `preprocessor_config.json`'s `use_image_id` and
  `slice_mode` both true): `<image_id>N</image_id><image>[64]</image>` then the HD slices
  `<slice>[64]</slice>` row by row, rows joined by `\\n` (`get_grid_placeholder`); N counts the prompt's
  images from 0;
- a duplex step (`DuplexCapability.streaming_prefill`, which feeds the tokens and embeddings itself):
  `<image>[64]</image>` then `<slice>[64]</slice>` per HD slice, no id and no line breaks.
`[64]` is one slice's embeddings; their ids here are the placeholder (`<unk>` in the real preset), as the
reference's `<unk>` * `image_feature_size`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..model_config import SpecialTokens

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class ImageLayout:
    image_id: bool  # `<image_id>N</image_id>` before the image (`use_image_id`)
    row_breaks: bool  # `\n` between rows of HD slices (`get_grid_placeholder`)


CHAT = ImageLayout(image_id=True, row_breaks=True)
DUPLEX = ImageLayout(image_id=False, row_breaks=False)


def image_ids(tokens: SpecialTokens, encode: Encode, grid: tuple[int, int] | None, per_slice: int,
              index: int, layout: ImageLayout) -> list[int]:
    """Token ids of one image: the overview, then its HD `grid` (rows, cols; None: no HD slices)."""
    embeds = [tokens.audio_placeholder] * per_slice
    ids = [tokens.image_id, *encode(str(index)), tokens.image_id_end] if layout.image_id else []
    ids += [tokens.image, *embeds, tokens.image_end]
    rows, cols = grid or (0, 0)
    for r in range(rows):
        if r and layout.row_breaks:
            ids += encode("\n")
        ids += [tokens.slice, *embeds, tokens.slice_end] * cols
    return ids


"""The cost model per caller (pure code): every input that costs the server work or memory has a bound here,
checked at the edge (the dialect that takes it in) with a client code, before any model work.

Text is bounded in UTF-8 bytes: a byte-level BPE tokenizer (Qwen's, and `tiny`'s byte tokenizer) never makes
more tokens than a text has bytes, so a byte bound is a token bound that needs no tokenizer at the edge.
The defaults keep the longest single prefill within a step's budget (docs/security.md has the figures);
MINICPMO_MAX_<NAME> sets each (gateway/settings.py; docs/security.md lists them all).
"""

from __future__ import annotations

import dataclasses
import io
import re
import warnings
from dataclasses import dataclass
from typing import Any

from minicpmo_triton.media.images import IMAGE_FORMATS, MAX_PIXELS

from .codes import ClientCode
from .settings import Settings
from .wire import ProtocolError

TOO_LARGE = ClientCode.INPUT_TOO_LARGE  # one code for every size bound; `param` and the message say which
CONVERSATION_FULL = ClientCode.CONVERSATION_FULL  # the remedy differs: delete items first
NAME_CHARS = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")


@dataclass(frozen=True)
class Limits:
    """The bounds, from the settings (MINICPMO_MAX_*: gateway/settings.py has their defaults and docs)."""

    prompt_bytes: int  # a system prompt / session instructions (prefilled with the first step)
    text_bytes: int  # one text: a context or tool result, a typed message, a text to say, instructions
    conversation_items: int  # items an OpenAI-dialect conversation (or a turn_based turn) holds
    conversation_bytes: int  # their text, audio and images together
    images_per_message: int  # a chat message / conversation item (a duplex step: inputs.MAX_FRAMES)
    request_pixels: int  # all images of one message or step together
    item_audio_s: float  # audio of one message / conversation item / uncommitted buffer

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(**{f.name: getattr(settings, f"max_{f.name}") for f in dataclasses.fields(cls)})

    @classmethod
    def default(cls) -> Limits:
        return cls.of(Settings())

    # ---- text ----
    def prompt(self, value: Any, param: str, close_code: int | None = None) -> str:
        """A system prompt / instructions: a string within `prompt_bytes`."""
        return _text(value, self.prompt_bytes, param, close_code, "MINICPMO_MAX_PROMPT_BYTES")

    def text(self, value: Any, param: str, close_code: int | None = None) -> str:
        """One text the caller sends: a string within `text_bytes`."""
        return _text(value, self.text_bytes, param, close_code, "MINICPMO_MAX_TEXT_BYTES")

    # ---- images ----
    def images(self, images: list[bytes], param: str, per_message: int | None = None) -> None:
        """The images of one message or step: how many, and their pixels together (from their headers)."""
        most = self.images_per_message if per_message is None else per_message
        if len(images) > most:
            raise ProtocolError(TOO_LARGE, f"at most {most} images per message", param)
        pixels = sum(image_pixels(raw) for raw in images)
        if pixels > self.request_pixels:
            raise ProtocolError(TOO_LARGE, f"the images hold {pixels} pixels together; at most {self.request_pixels} "
                                "per message", param)

    # ---- conversation ----
    def conversation(self, items: int, nbytes: int) -> None:
        """A conversation of `items` items of `nbytes` bytes together, an item about to be added included."""
        if items > self.conversation_items:
            raise ProtocolError(CONVERSATION_FULL, f"the conversation holds at most {self.conversation_items} "
                                "items; delete some first", "item")
        if nbytes > self.conversation_bytes:
            raise ProtocolError(CONVERSATION_FULL, f"the conversation holds at most {self.conversation_bytes >> 20} "
                                "MiB of text, audio and images; delete items first", "item")

    def audio_samples(self, rate: int) -> int:
        return int(self.item_audio_s * rate)


def _text(value: Any, most: int, param: str, close_code: int | None, setting: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(ClientCode.INVALID_VALUE, f"{param} must be a string", param, close_code=close_code)
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > most:
        raise ProtocolError(TOO_LARGE, f"{param} is {size} bytes of UTF-8; at most {most} ({setting})", param,
                            close_code=close_code)
    return value


def identifier(value: Any, param: str, code: ClientCode = ClientCode.INVALID_VALUE,
               close_code: int | None = None) -> str:
    """A name the server echoes or looks up (a voice of the voice folder, a context kind): letters, digits and
    _.+-, at most NAME_CHARS characters (a file name stem, never a path), else refused."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ProtocolError(code, f"{param} must be a name: letters, digits and _.+-, at most {NAME_CHARS} "
                            "characters", param, close_code=close_code)
    return value


def image_pixels(raw: bytes) -> int:
    """An image's pixel count from its header (nothing is decoded): of an allowed format and within the vision
    stage's MAX_PIXELS, else `bad_image` (what the stage would answer, said before the image travels)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # its size is judged below
            with Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS) as img:
                pixels = int(img.width) * int(img.height)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise ProtocolError(ClientCode.BAD_IMAGE, f"an image must be one of {', '.join(IMAGE_FORMATS)}, of at most "
                            f"{MAX_PIXELS} pixels ({type(exc).__name__})") from exc
    if pixels > MAX_PIXELS:
        raise ProtocolError(ClientCode.BAD_IMAGE, f"an image of {pixels} pixels is over {MAX_PIXELS}")
    return pixels


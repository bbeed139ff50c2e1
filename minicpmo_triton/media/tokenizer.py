"""Tokenizers: byte-level for `tiny`, the checkpoint's own files for a real model."""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Protocol

from ..model_config import PresetConfig

TINY_SPECIALS = (
    "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<unit>", "</unit>",
    "<image>", "</image>", "<slice>", "</slice>", "<|tts_bos|>", "<|listen|>", "<|speak|>",
    "<|turn_eos|>", "<|chunk_eos|>", "<|chunk_tts_eos|>", "<|tts_pad|>", "<|audio|>", "<image_id>", "</image_id>",
)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def is_text(self, token_id: int) -> bool: ...

    def bad_ids(self, vocab: int) -> list[int]:
        """Ids the duplex decoder never draws (the checkpoint's `bad_token_ids`)."""
        ...

    def special_ids(self) -> set[int]:
        """The ids StreamDecoder counts as special (`_all_special_ids`): transformers' `all_special_ids` and the
        duplex control tokens."""
        ...

    def decoder(self) -> IncrementalDecoder: ...

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` at once, special tokens skipped, broken characters as U+FFFD (the duplex loop's
        28-character count: `tokenizer.decode(ids, skip_special_tokens=True)`)."""
        ...


class IncrementalDecoder(Protocol):
    def feed(self, ids: list[int]) -> str: ...


class _ByteDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: list[int]) -> str:
        return self._utf8.decode(bytes(i for i in ids if i < 256))


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; special tokens follow.

    Only printable ASCII counts as generated text, so the random `tiny` model says readable noise.
    """

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def is_text(self, token_id: int) -> bool:
        return 32 <= token_id < 127

    def bad_ids(self, vocab: int) -> list[int]:
        """tiny's `bad_token_ids`: the bytes that are not printable ASCII and the ids past its specials."""
        return [i for i in range(vocab) if i < 256 and not self.is_text(i) or i >= 256 + len(TINY_SPECIALS)]

    def special_ids(self) -> set[int]:
        return set(tiny_special_ids().values())

    def decoder(self) -> _ByteDecoder:
        return _ByteDecoder()

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class _HfDecoder:
    def __init__(self, tok: object, specials: set[int]) -> None:
        self._tok = tok
        self._specials = specials
        self._ids: list[int] = []
        self._emitted = ""

    def feed(self, ids: list[int]) -> str:
        self._ids.extend(i for i in ids if i not in self._specials)
        text = self._tok.decode(self._ids)  # type: ignore[attr-defined]
        if text.endswith("\ufffd"):  # an unfinished multi-byte character: wait for more
            return ""
        delta = text[len(self._emitted):]
        # every character is whole: start afresh (byte-level text splits there cleanly), so an hour-long
        # session neither keeps its whole transcript here nor decodes it again at every step
        self._ids, self._emitted = [], ""
        return delta


def _text_encoder(tokenizer_json: str) -> object:
    """The tokenizer as an encoder of text only: every added token (the checkpoint marks 12 of them non-special:
    `<think>`, `<tool_call>`, `<|fim_prefix|>`, ...) made special, and special tokens not parsed out of text, so a
    caller's literal `<|im_end|>`, `<|listen|>` or `<think>` is encoded as its characters, never as the token
    (control tokens are placed by id, never parsed from a string)."""
    from tokenizers import Tokenizer as HfTokenizer

    spec = json.loads(tokenizer_json)
    for added in spec.get("added_tokens") or []:
        added["special"] = True
    tok = HfTokenizer.from_str(json.dumps(spec))
    tok.encode_special_tokens = True
    return tok


class HuggingFaceTokenizer:
    """The checkpoint's `tokenizer.json`, read with the `tokenizers` package; it never parses an added token out
    of text (`_text_encoder`), and decodes as the checkpoint's own tokenizer does."""

    def __init__(self, folder: Path, specials: set[int]) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        spec = (Path(folder) / "tokenizer.json").read_text(encoding="utf-8")
        self._tok = HfTokenizer.from_str(spec)  # decoding: a non-special added token the model says is its text
        self._encoder = _text_encoder(spec)
        self._specials = specials
        config = Path(folder) / "tokenizer_config.json"
        self._bad: tuple[int, ...] = tuple(json.loads(config.read_text(encoding="utf-8")).get("bad_token_ids", [])) \
            if config.exists() else ()
        self._special_ids = _named_special_ids(config, self._tok) if config.exists() else set()

    def encode(self, text: str) -> list[int]:
        return self._encoder.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]

    def is_text(self, token_id: int) -> bool:
        return token_id not in self._specials

    def bad_ids(self, vocab: int) -> list[int]:
        return list(self._bad)

    def special_ids(self) -> set[int]:
        return set(self._special_ids)

    def decoder(self) -> _HfDecoder:
        return _HfDecoder(self._tok, self._specials)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


# StreamDecoder's `custom_special_tokens` (MiniCPM-o-Demo MiniCPMO45/utils.py:1190-1207)
DUPLEX_SPECIALS = ("<unit>", "</unit>", "<image>", "</image>", "<slice>", "</slice>", "<|listen|>", "<|speak|>",
                   "<|tts_bos|>", "<|tts_eos|>", "<|audio_start|>", "<|audio_end|>", "<|chunk_eos|>",
                   "<|chunk_tts_eos|>", "<|turn_eos|>")


def _named_special_ids(config: Path, tok: object) -> set[int]:
    """StreamDecoder's `_all_special_ids` (utils.py:1181-1213): transformers' `all_special_ids` (the tokens
    tokenizer_config.json names as bos / eos / unk / pad and its `additional_special_tokens`) and
    DUPLEX_SPECIALS."""
    cfg = json.loads(config.read_text(encoding="utf-8"))
    names = [cfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    names += [*(cfg.get("additional_special_tokens") or []), *DUPLEX_SPECIALS]
    names = [n.get("content") if isinstance(n, dict) else n for n in names]
    return {i for n in names if isinstance(n, str) and (i := tok.token_to_id(n)) is not None}  # type: ignore[attr-defined]


def load_tokenizer(preset: PresetConfig, folder: Path) -> Tokenizer:
    if preset.tokenizer == "bytes":
        return ByteTokenizer()
    specials = set(vars(preset.tokens).values())
    return HuggingFaceTokenizer(Path(folder) / "tokenizer", specials)


def tiny_special_ids() -> dict[str, int]:
    return {name: 256 + i for i, name in enumerate(TINY_SPECIALS)}

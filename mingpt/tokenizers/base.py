"""The interface every tokenizer shares, and the JSON form it is saved in."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Sequence

import fsspec
import numpy as np

from mingpt.errors import TokenizerError

FORMAT = "mingpt-tokenizer"
FORMAT_VERSION = 1
KINDS = ("char", "bpe", "tiktoken")
EOT = "<|endoftext|>"


class Tokenizer(ABC):
    """Text to token ids and back."""

    kind: str
    eot_id: int | None  # the end-of-text token, which ends every document of prepared data

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """The ids of `text`; TokenizerError where it is not text that UTF-8 can hold (see `lone_surrogate`)."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """`encode`, as an array of integers: for a whole corpus."""
        try:
            return self._encode(text)
        except UnicodeEncodeError:
            raise TokenizerError(f"the text is not UTF-8: {lone_surrogate(text)}") from None

    @abstractmethod
    def _encode(self, text: str) -> np.ndarray:
        """The ids of `text`, as an array; UnicodeEncodeError where it holds a lone surrogate."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The UTF-8 bytes of `ids` (a BPE token may hold part of a character: decode a stream incrementally)."""
        return self.decode(ids).encode("utf-8")

    @abstractmethod
    def to_dict(self) -> dict:
        """Everything needed to rebuild this tokenizer; plain JSON types only."""

    def to_json(self) -> str:
        """The tokenizer file's content; `tokenizer_from_dict(json.loads(...))` reads it back."""
        return json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "kind": self.kind, **self.to_dict()})

    def save(self, path: str) -> None:
        """Write the tokenizer as JSON to a local path or fsspec URL."""
        with fsspec.open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    def describe(self) -> str:
        return f"{self.kind} (vocab {self.vocab_size})"


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> str | None:
    """Which lone surrogate `text` holds (a character that no UTF-8 text holds), in words; else None. Python makes one
    of each byte of a command-line argument that is not UTF-8, and a JSON escape of half a UTF-16 pair makes one."""
    found = _LONE_SURROGATE.search(text)
    if found is None:
        return None
    return (f"its {found.group()!r} at character {found.start()} is a lone surrogate (Python's stand-in for a "
            "byte that is not UTF-8, or half of a UTF-16 pair from a JSON escape)")

"""The interface every tokenizer shares, and the JSON form it is saved in."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Sequence

import fsspec
import numpy as np

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

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The UTF-8 bytes of `ids`; a BPE token may hold part of a character, so a stream
        of tokens is best decoded through bytes and an incremental UTF-8 decoder."""
        return self.decode(ids).encode("utf-8")

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` for a whole corpus, as an array of integers."""
        return np.asarray(self.encode(text), dtype=np.int64)

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

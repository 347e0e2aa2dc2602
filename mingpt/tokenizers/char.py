"""One token per character of the corpus."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from mingpt.errors import TokenizerError
from mingpt.tokenizers.base import EOT, Tokenizer, lone_surrogate


class CharTokenizer(Tokenizer):
    """One token per character: the sorted set of characters of the corpus, then end-of-text."""

    kind = "char"

    def __init__(self, chars: Iterable[str], eot: bool = True):
        chars = sorted(set(chars))
        if not chars or any(len(c) != 1 for c in chars):
            raise TokenizerError("a char vocabulary must be a non-empty list of single characters")
        problem = lone_surrogate("".join(chars))
        if problem:  # it could never be written out as UTF-8
            raise TokenizerError(f"a char vocabulary must be UTF-8 text: {problem}")
        self.chars = chars
        self.codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)  # sorted
        self.eot_id = len(chars) if eot else None
        self.symbols = chars + [EOT] if eot else chars  # what each id decodes to

    @classmethod
    def train(cls, texts: str | Iterable[str]) -> "CharTokenizer":
        chars: set[str] = set()
        for text in [texts] if isinstance(texts, str) else texts:
            chars.update(text)
        return cls(chars)

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    def _encode(self, text: str) -> np.ndarray:
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self.codepoints, points)
        ids_clipped = np.minimum(ids, len(self.codepoints) - 1)
        unknown = self.codepoints[ids_clipped] != points
        if unknown.any():
            missing = sorted({chr(p) for p in points[unknown]})
            shown = ", ".join(repr(c) for c in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise TokenizerError(
                f"text has {len(missing)} character(s) that this char vocabulary lacks: {shown}; "
                "remove them from the text, or use a byte-level tokenizer (bpe), which encodes any text"
            )
        return ids_clipped.astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return "".join(self.symbols[i] for i in ids)
        except IndexError:
            raise TokenizerError(f"token id out of range for a char vocabulary of {self.vocab_size}") from None

    def to_dict(self) -> dict:
        return {"chars": "".join(self.chars), "eot": self.eot_id is not None}

"""Tokenizers: characters, a byte-level BPE trained on the corpus, or a named tiktoken encoding.

All three share one small interface (`encode`, `decode`, `vocab_size`, `save`, `load`).
A saved tokenizer is a small JSON file, never a pickle, so that a snapshot or a
prepared data folder carries its vocabulary and can be decoded without the corpus.

Each reserves an end-of-text token (`eot_id`, written `<|endoftext|>`), the last id for char and
bpe, tiktoken's own for its encodings. Prepared data ends every document with it, so that
documents never run into each other. Text is always encoded as plain text: a corpus that says
"<|endoftext|>" does not make that token. (Tokenizer files written before it was added load
without one.)
"""

from __future__ import annotations

import base64
import json
import logging
import os
from abc import ABC, abstractmethod
from typing import Iterable, Sequence

import fsspec
import numpy as np
import tiktoken

from mingpt.errors import TokenizerError

log = logging.getLogger(__name__)

FORMAT = "mingpt-tokenizer"
FORMAT_VERSION = 1
KINDS = ("char", "bpe", "tiktoken")
EOT = "<|endoftext|>"

# GPT-4's split pattern: words, numbers of up to 3 digits, punctuation runs and whitespace
# are merged within, never across. rustbpe's default is the same pattern.
BPE_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)


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
        """`encode` for a whole corpus, as an int64 array."""
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


class CharTokenizer(Tokenizer):
    """One token per character: the sorted set of characters of the corpus, then end-of-text."""

    kind = "char"

    def __init__(self, chars: Iterable[str], eot: bool = True):
        chars = sorted(set(chars))
        if not chars or any(len(c) != 1 for c in chars):
            raise TokenizerError("a char vocabulary must be a non-empty list of single characters")
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

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        # Vectorised: look every code point up in the sorted vocabulary at once.
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


class _TiktokenBacked(Tokenizer):
    """Shared code of the two tokenizers that encode with a `tiktoken.Encoding`."""

    encoding: tiktoken.Encoding

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        # Special tokens are plain text here: a corpus saying "<|endoftext|>" is not a control signal.
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        try:
            return self.encoding.decode_bytes(list(ids))
        except KeyError as e:
            raise TokenizerError(f"token id {e} is not in this {self.describe()} vocabulary") from None


class BPETokenizer(_TiktokenBacked):
    """Byte-level BPE trained on the corpus with rustbpe, encoded with tiktoken.

    The first 256 tokens are the bytes, so any text round-trips.
    """

    kind = "bpe"

    def __init__(self, pattern: str, ranks: Sequence[bytes], eot: bool = True):
        self.pattern = pattern
        self.ranks = list(ranks)
        self.eot_id = len(self.ranks) if eot else None
        self.encoding = tiktoken.Encoding(
            name=f"mingpt-bpe-{len(self.ranks)}",
            pat_str=pattern,
            mergeable_ranks={token: rank for rank, token in enumerate(self.ranks)},
            special_tokens={EOT: self.eot_id} if eot else {},
        )

    @classmethod
    def train(cls, texts: str | Iterable[str], vocab_size: int) -> "BPETokenizer":
        """Merges learnt from `texts` (pieces cut between words: see mingpt.corpus), up to a vocabulary
        of `vocab_size` including end-of-text."""
        import rustbpe

        check_bpe_vocab_size(vocab_size)
        logging.getLogger("rustbpe").setLevel(logging.WARNING)  # its INFO is a line per 1% of merges
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(iter([texts] if isinstance(texts, str) else texts), vocab_size - 1,
                                    pattern=BPE_PATTERN)
        ranked = sorted(trainer.get_mergeable_ranks(), key=lambda pair: pair[1])
        if len(ranked) < vocab_size - 1:  # rustbpe stops when no pair occurs twice; say so, or it looks like a bug
            log.warning("the corpus is too small for a BPE vocabulary of %d: training stopped at %d tokens (no pair "
                        "of tokens left to merge); give a larger corpus or a smaller vocab_size",
                        vocab_size, len(ranked) + 1)
        return cls(trainer.get_pattern(), [bytes(token) for token, _ in ranked])

    def to_dict(self) -> dict:
        return {"pattern": self.pattern, "ranks": [base64.b64encode(t).decode("ascii") for t in self.ranks],
                "eot": self.eot_id is not None}


class TiktokenTokenizer(_TiktokenBacked):
    """A named tiktoken encoding such as `gpt2` or `cl100k_base`, from tiktoken's cache or the network."""

    kind = "tiktoken"

    def __init__(self, name: str):
        self.name = name
        self.encoding = _load_named_encoding(name)
        # Every named encoding reserves it; an encoding without one still prepares, with documents run together.
        self.eot_id = self.encoding.encode_single_token(EOT) if EOT in self.encoding.special_tokens_set else None

    def to_dict(self) -> dict:
        return {"name": self.name}

    def describe(self) -> str:
        return f"tiktoken {self.name} (vocab {self.vocab_size})"


def _load_named_encoding(name: str) -> tiktoken.Encoding:
    known = tiktoken.list_encoding_names()
    if name not in known:
        raise TokenizerError(f"unknown tiktoken encoding {name!r}; known: {', '.join(known)}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # requests' connection errors, hash mismatches, unreadable cache
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "<unset>")
        raise TokenizerError(
            f"cannot load the tiktoken encoding {name!r}: it is neither in tiktoken's cache "
            f"(TIKTOKEN_CACHE_DIR={cache}) nor downloadable ({type(e).__name__}). On a machine with "
            "network access, load it once with TIKTOKEN_CACHE_DIR set and copy that folder here, "
            "or train an offline vocabulary with tokenizer=bpe"
        ) from None


def check_bpe_vocab_size(vocab_size: int | None) -> None:
    if not isinstance(vocab_size, int) or vocab_size <= 256:
        raise TokenizerError(
            f"BPE vocab_size must be an integer above 256 (the 256 byte tokens come first, merges after), "
            f"got {vocab_size!r}; try 4096"
        )


def train_tokenizer(kind: str, texts: str | Iterable[str], vocab_size: int | None = None) -> Tokenizer:
    """Build a tokenizer of `kind` ('char', 'bpe', a tiktoken encoding name such as 'gpt2', or a folder holding
    a tokenizer: see mingpt.hf) for `texts`."""
    if kind == "char":
        return CharTokenizer.train(texts)
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size)
    if kind == "tiktoken":
        raise TokenizerError("name the tiktoken encoding itself as the tokenizer, e.g. 'gpt2' or 'cl100k_base'")
    from mingpt import hf  # it builds on this module

    if hf.is_path(kind):
        return hf.load_tokenizer_folder(kind)
    return TiktokenTokenizer(kind)


def tokenizer_from_dict(payload: dict) -> Tokenizer:
    """Rebuild a tokenizer from what `save` wrote (already parsed JSON)."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TokenizerError("not a mingpt tokenizer file (no 'format': 'mingpt-tokenizer' field)")
    if payload.get("version") != FORMAT_VERSION:
        raise TokenizerError(f"tokenizer file version {payload.get('version')!r} is not supported (expected {FORMAT_VERSION})")
    kind = payload.get("kind")
    try:
        eot = payload.get("eot", False)  # files written before end-of-text tokens have none
        if kind == "char":
            return CharTokenizer(list(payload["chars"]), eot=eot)
        if kind == "bpe":
            return BPETokenizer(payload["pattern"], [base64.b64decode(t, validate=True) for t in payload["ranks"]],
                                eot=eot)
        if kind == "tiktoken":
            return TiktokenTokenizer(payload["name"])
    except TokenizerError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise TokenizerError(f"damaged {kind} tokenizer file ({type(e).__name__}: {e}); prepare the data again") from None
    raise TokenizerError(f"unknown tokenizer kind {kind!r} in tokenizer file; expected one of {', '.join(KINDS)}")


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer saved with `Tokenizer.save` from a local path or fsspec URL."""
    try:
        with fsspec.open(path, "r", encoding="utf-8") as f:
            payload = json.load(f)
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"tokenizer file {path} is damaged (not valid JSON: {e}); prepare the data again") from None
    return tokenizer_from_dict(payload)

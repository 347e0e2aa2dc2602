"""Tiktoken-backed tokenizers: a byte-level BPE learnt with rustbpe, or a named encoding (gpt2, cl100k_base...)."""

from __future__ import annotations

import base64
import logging
import os
from typing import Iterable, Sequence

import numpy as np
import tiktoken

from mingpt.errors import TokenizerError
from mingpt.tokenizers.base import EOT, Tokenizer

log = logging.getLogger(__name__)
TIKTOKEN_TESTED = "0.14"  # the tiktoken release the tests ran on (pyproject's range), for its private tables

# GPT-4's split pattern (rustbpe's default): words, numbers of up to 3 digits, punctuation and whitespace never merge.
BPE_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)


class _TiktokenBacked(Tokenizer):
    """Shared code of the two tokenizers that encode with a `tiktoken.Encoding`."""

    encoding: tiktoken.Encoding

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def _encode(self, text: str) -> np.ndarray:
        # Special tokens are plain text here: a corpus saying "<|endoftext|>" is not a control signal. (Not
        # encode_ordinary: it puts U+FFFD for a lone surrogate in silence.)
        return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        try:
            return self.encoding.decode_bytes(list(ids))
        except KeyError as e:
            raise TokenizerError(f"token id {e} is not in this {self.describe()} vocabulary") from None

    def tables(self) -> tuple[dict[bytes, int], str]:
        """The encoding's merge ranks and split pattern, from tiktoken's private fields; TokenizerError where absent."""
        ranks, pattern = getattr(self.encoding, "_mergeable_ranks", None), getattr(self.encoding, "_pat_str", None)
        if not isinstance(ranks, dict) or not isinstance(pattern, str):
            raise TokenizerError(f"tiktoken {tiktoken.__version__} keeps its merge ranks and split pattern elsewhere "
                                 f"than mingpt reads them; mingpt is tested with tiktoken {TIKTOKEN_TESTED}: pip "
                                 f"install 'tiktoken=={TIKTOKEN_TESTED}.*'")
        return ranks, pattern


class BPETokenizer(_TiktokenBacked):
    """Byte-level BPE trained on the corpus with rustbpe, encoded with tiktoken; tokens 0-255 are the bytes."""

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
        """Merges learnt from `texts` (cut between words: mingpt.data.pieces), up to `vocab_size` with end-of-text."""
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


MAX_BPE_VOCAB = 1 << 24  # far past any useful vocabulary (GPT-4o's has 200k); rustbpe's counts overflow further on


def check_bpe_vocab_size(vocab_size: int | None) -> None:
    if not isinstance(vocab_size, int) or not 256 < vocab_size <= MAX_BPE_VOCAB:
        raise TokenizerError(
            f"BPE vocab_size must be an integer above 256 (the 256 byte tokens come first, merges after) and at most "
            f"{MAX_BPE_VOCAB}, got {vocab_size!r}; try 4096"
        )

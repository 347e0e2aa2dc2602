"""Tokenizers: characters, a byte-level BPE trained on the corpus, or a named tiktoken encoding; and the tokenizer of a
folder (a Hugging Face one, or a mingpt snapshot's). All share mingpt.tokenizers.base's interface.

A saved tokenizer is a small JSON file, never a pickle (loading one could run code). Each reserves an end-of-text token
(`eot_id`) that ends every document of prepared data; text is encoded as plain text, so a corpus saying
"<|endoftext|>" cannot make it."""

from __future__ import annotations

import base64
from typing import Iterable

from mingpt.errors import TokenizerError
from mingpt.storage import open_fs
from mingpt.tokenizers import huggingface
from mingpt.tokenizers.base import EOT, FORMAT, FORMAT_VERSION, KINDS, Tokenizer
from mingpt.tokenizers.bpe import BPETokenizer, TiktokenTokenizer, check_bpe_vocab_size
from mingpt.tokenizers.char import CharTokenizer
from mingpt.tokenizers.files import json_object, read_file

__all__ = ["EOT", "Tokenizer", "CharTokenizer", "BPETokenizer", "TiktokenTokenizer", "check_bpe_vocab_size",
           "is_path", "train_tokenizer", "tokenizer_from_dict", "load_tokenizer", "load_tokenizer_folder"]


def is_path(spec: str) -> bool:
    """Whether a tokenizer or init_from value names a folder or file (it has a slash), not a name such as gpt2."""
    return "/" in spec or "\\" in spec


def train_tokenizer(kind: str, texts: str | Iterable[str], vocab_size: int | None = None) -> Tokenizer:
    """Build a tokenizer of `kind` ('char', 'bpe', a tiktoken encoding such as 'gpt2', or a folder) for `texts`."""
    if kind == "char":
        return CharTokenizer.train(texts)
    if kind == "bpe":
        return BPETokenizer.train(texts, vocab_size)
    if kind == "tiktoken":
        raise TokenizerError("name the tiktoken encoding itself as the tokenizer, e.g. 'gpt2' or 'cl100k_base'")
    if is_path(kind):
        return load_tokenizer_folder(kind)
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
    fs, file = open_fs(path)
    try:
        payload = read_file(fs, file, json_object, "the tokenizer file is damaged; prepare the data again")
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {path} does not exist") from None
    return tokenizer_from_dict(payload)


def load_tokenizer_folder(url: str) -> Tokenizer:
    """The tokenizer of a folder: mingpt's own tokenizer.json (a snapshot or prepared data), a Hugging Face byte-level
    BPE (tokenizer.json, or vocab.json + merges.txt) as a tiktoken encoding, or mingpt-export's char vocabulary."""
    fs, path = open_fs(url.rstrip("/"))
    if fs.isfile(path):  # a tokenizer.json named itself
        path = path.rpartition("/")[0]
    if fs.exists(f"{path}/tokenizer.json"):
        payload = read_file(fs, f"{path}/tokenizer.json", json_object)
        if payload.get("format") == FORMAT:
            return tokenizer_from_dict(payload)
        return huggingface.from_tokenizer_json(payload, url)
    return huggingface.from_vocab_and_merges(fs, path, url)

"""What a worker does with a piece of the corpus: its documents' characters (`chars`), their texts (`texts`), or their
tokens, written by split to part files (`encode`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from mingpt.data.pieces import Piece, documents
from mingpt.data.split import is_val_record
from mingpt.tokenizers import Tokenizer, tokenizer_from_dict

# What this worker process knows: set once by `setup`.
_worker: dict = {}


def setup(context: dict) -> None:
    """Learn `context` (see `Job.context`), and the tokenizer from its JSON where there is one."""
    _worker.clear()
    _worker.update(context)
    if context.get("tokenizer"):
        _worker["tok"] = tokenizer_from_dict(json.loads(context["tokenizer"]))
    _worker["val_sources"] = set(context["val_sources"])


def _documents(piece: Piece) -> Iterator[tuple[int, str]]:
    piece = piece.filled(_worker["paths"][piece.source])
    form = _worker["formats"][piece.source]
    return documents(piece, form, _worker["text_field"], _worker["names"][piece.source])


def chars(piece: Piece) -> set[str]:
    """The characters of the piece's documents."""
    found: set[str] = set()
    for _, text in _documents(piece):
        found.update(text)
    return found


def texts(piece: Piece) -> list[str]:
    """The texts of the piece's documents."""
    return [text for _, text in _documents(piece)]


def encode(piece: Piece) -> tuple[dict[str, tuple[Path, int]], bool]:
    """Write the tokens of `piece` by split to part files (cheaper than a pipe), each document ended by end-of-text;
    return each split's part file and token count, and whether the piece held any text that is not whitespace."""
    tok: Tokenizer = _worker["tok"]
    eot = [] if tok.eot_id is None else [tok.eot_id]
    records = _worker["formats"][piece.source] != "text"
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    has_text = False
    for number, text in _documents(piece):
        has_text = has_text or not text.isspace() and bool(text)
        if records:  # by the record's number across the corpus: the same split whatever the container
            split = "val" if is_val_record(number, _worker["val_fraction"]) else "train"
        else:
            split = "val" if piece.source in _worker["val_sources"] else "train"
        parts[split].append(tok.encode_array(text))
        if records or piece.last:
            parts[split].append(np.asarray(eot, dtype=np.int64))
    written = {}
    for split, arrays in parts.items():
        if arrays:
            path = _worker["folder"] / f"part-{piece.source}-{piece.offset}.{split}"
            ids = np.concatenate(arrays).astype(_worker["dtype"])
            ids.tofile(path)
            written[split] = (path, len(ids))
    return written, has_text

"""The validation split: which documents, or which tokens, of a corpus are held out for evaluation. One text document
(a single file, or the built-in corpus): its last `val_fraction` of tokens. Several: whole documents; of text files, the
last `val_fraction` of them in a seeded order (at least one); of records (JSONL lines, Parquet rows), each whose number
across the corpus has a seeded hash below `val_fraction`."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from mingpt.data.corpus import Source

SPLIT_SEED = 0  # the validation documents do not change with the training seed


def unit_hash(*key) -> float:
    """A number in [0, 1) from `key`, the same on every machine and Python (unlike hash())."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def is_val_record(number: int, val_fraction: float) -> bool:
    """Whether the record `number` (across the corpus) is held out: the same whatever file holds it."""
    return unit_hash(SPLIT_SEED, "record", number) < val_fraction


def val_files(sources: Sequence[Source], val_fraction: float) -> list[int]:
    """The text files held out: the last `val_fraction` in a seeded order, at least one of 2+ where none are records."""
    text_files = [i for i, source in enumerate(sources) if not source.records]
    count = round(val_fraction * len(text_files))
    if val_fraction > 0 and count == 0 and len(text_files) >= 2 and len(text_files) == len(sources):
        count = 1
    order = np.random.default_rng(SPLIT_SEED).permutation(len(text_files))
    return sorted(text_files[i] for i in order[len(order) - count:]) if count else []


def move_tail(train: Path, val: Path, dtype: np.dtype, val_fraction: float) -> dict:
    """Move the last `val_fraction` of the tokens of `train` to `val` (a one-document corpus)."""
    total = train.stat().st_size // dtype.itemsize
    n_val = int(total * val_fraction)
    with open(train, "r+b") as src, open(val, "wb") as dst:
        src.seek((total - n_val) * dtype.itemsize)
        shutil.copyfileobj(src, dst, 1 << 20)
        src.truncate((total - n_val) * dtype.itemsize)
    return {"train": total - n_val, "val": n_val}

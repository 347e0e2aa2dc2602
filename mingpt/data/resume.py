"""How far a stopped preparation got, so that the next start on this machine goes on from there."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from mingpt.data.prepared import TOKENIZER_FILE
from mingpt.data.scratch import leftovers, remove_leftovers
from mingpt.storage import parse_json

PROGRESS_FILE = "progress.json"  # in a scratch folder: how far tokenizing got, for the next start to go on
PROGRESS_LIMIT = 1 << 20  # bytes of a progress file read at most: it holds a few numbers and the settings


class CorpusChanged(Exception):
    """A resumed preparation read the corpus pieces it had done, and they read differently now."""


def take_leftover(out: Path, meta: dict) -> tuple[Path, "Tokenized"] | None:
    """The furthest stopped preparation of this data into `out` and its progress; other leftovers are removed."""
    best = None
    for path in leftovers(out.parent):
        done = Tokenized.load(path, meta) if path.name.startswith(f".{out.name}.tmp-") else None
        if done and (best is None or done.pieces > best[1].pieces):
            best = (path, done)
    remove_leftovers(out.parent, keep=best[0] if best else None)
    return best


@dataclass
class Tokenized:
    """How far tokenizing got (PROGRESS_FILE, saved after every piece): the pieces done, the bytes of each token file
    that hold their tokens, and the `meta` they are for. A resume trusts none of it unchecked: the file is sealed by a
    hash of its fields, the kept token bytes must hash as recorded, and the pieces done must read as they did."""

    meta: dict
    pieces: int = 0
    read: int = 0
    any_text: bool = False
    sizes: dict = field(default_factory=lambda: {"train": 0, "val": 0})  # bytes of each token file kept
    counts: dict = field(default_factory=lambda: {"train": 0, "val": 0})  # tokens in them
    tokens_sha256: dict = field(default_factory=dict)  # of those bytes
    corpus_sha256: str = ""  # of the corpus read up to the end of the pieces done
    hashers: dict = field(default_factory=lambda: {"train": hashlib.sha256(), "val": hashlib.sha256()}, repr=False)

    @classmethod
    def start(cls, meta: dict) -> "Tokenized":
        return cls(json.loads(json.dumps(meta)))

    def append(self, split: str, out, part: Path, count: int) -> None:
        """Append the part file `part` of `count` tokens to the open token file `out`, and delete it."""
        data = part.read_bytes()
        out.write(data)
        self.hashers[split].update(data)
        self.sizes[split] += len(data)
        self.counts[split] += count
        part.unlink()

    def add(self, size: int, has_text: bool, corpus_sha256: str) -> None:
        """Count one more piece done, whose end the corpus has read to with digest `corpus_sha256`."""
        self.pieces, self.read, self.any_text = self.pieces + 1, self.read + size, self.any_text or has_text
        self.corpus_sha256 = corpus_sha256
        self.tokens_sha256 = {split: hasher.hexdigest() for split, hasher in self.hashers.items()}

    def fields(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "hashers"}

    def save(self, folder: Path) -> None:
        record = self.fields()
        record["seal"] = _seal(record)
        tmp = folder / f".{PROGRESS_FILE}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, folder / PROGRESS_FILE)

    @classmethod
    def load(cls, folder: Path, meta: dict) -> "Tokenized | None":
        """The sealed progress in `folder` for `meta`, if its token files begin with the bytes it counts; else None."""
        try:
            record = parse_json((folder / PROGRESS_FILE).read_bytes()[:PROGRESS_LIMIT])
            if not isinstance(record, dict) or record.pop("seal", None) != _seal(record):
                return None
            done = cls(**record)
        except (OSError, ValueError, TypeError):
            return None
        numbers = [done.pieces, done.read, *done.sizes.values(), *done.counts.values()]
        if done.meta != json.loads(json.dumps(meta)) or not (folder / TOKENIZER_FILE).is_file() \
                or set(done.sizes) != {"train", "val"} or set(done.counts) != {"train", "val"} \
                or not all(isinstance(n, int) and n >= 0 for n in numbers):
            return None
        for split in ("train", "val"):
            if not _begins_with(folder / f"{split}.bin", done.sizes.get(split), done.tokens_sha256.get(split),
                                done.hashers[split]):
                return None
        return done


def _seal(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _begins_with(path: Path, size, digest, hasher) -> bool:
    """Whether the file `path` holds at least `size` bytes whose sha256 is `digest`; `hasher` has read them."""
    if not isinstance(size, int) or size < 0 or not isinstance(digest, str):
        return False
    try:
        with open(path, "rb") as f:
            left = size
            while left:
                block = f.read(min(left, 1 << 20))
                if not block:
                    return False
                hasher.update(block)
                left -= len(block)
    except OSError:
        return False
    return hasher.hexdigest() == digest

"""Prepared data: tokenize a corpus once into flat token files, then read examples by memory map.

A prepared folder holds
    train.bin, val.bin   the token ids, raw little-endian uint16 (uint32 when the vocabulary needs it)
    tokenizer.json       the tokenizer (see mingpt.tokenizers)
    meta.json            what was prepared from what: corpus checksum, tokenizer, counts, dtype

`prepare` reuses a folder whose corpus checksum and tokenizer settings match, and otherwise
builds a new one under a temporary name and renames it into place, so a reader never sees a
half-written folder and two processes preparing the same data at once cannot corrupt it.
It replaces only prepared data (a folder with a mingpt meta.json) or an empty folder: a
folder holding anything else belongs to someone else and is refused, never deleted.

An example is a block of `block_size` input tokens `x` and the same block shifted by one,
`y`. Example `i` starts at token `i * stride`; the default stride of one block makes an
epoch read every token once. Examples are addressed by a global index, so that the order
is decided elsewhere (by the trainer's sampler) as a pure function of seed and position.
"""


from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from mingpt.corpus import BUILTIN_CORPUS, read_corpus
from mingpt.storage import redact
from mingpt.errors import DataError
from mingpt.tokenizers import Tokenizer, check_bpe_vocab_size, load_tokenizer, train_tokenizer

log = logging.getLogger(__name__)

FORMAT = "mingpt-prepared"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"


def default_out_dir(corpus: str, tokenizer: str, vocab_size: int | None, root: str = "data") -> Path:
    """`data/<corpus stem>[-<hash of its location>]-<tokenizer>[-<vocab size>]`, e.g. data/python-docs-char.

    The hash keeps two corpora of the same file name (./input.txt, s3://b/input.txt) apart."""
    stem = Path(corpus.rstrip("/").split("://")[-1]).stem or "corpus"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem)
    if corpus != BUILTIN_CORPUS:
        location = corpus if "://" in corpus else str(Path(corpus).resolve())
        stem += "-" + hashlib.sha256(location.encode()).hexdigest()[:8]
    suffix = f"-{vocab_size}" if tokenizer == "bpe" else ""
    return Path(root) / f"{stem}-{tokenizer}{suffix}"


def prepare(
    corpus: str = BUILTIN_CORPUS,
    tokenizer: str = "char",
    vocab_size: int | None = None,
    out: str | os.PathLike | None = None,
    val_fraction: float = 0.1,
) -> Path:
    """Tokenize `corpus` into `out` (default: see `default_out_dir`) unless it is already there; return `out`.

    `tokenizer` is 'char', 'bpe' (with `vocab_size`) or a tiktoken encoding name such as 'gpt2'.
    The last `val_fraction` of the tokens form the validation split.
    """
    if tokenizer == "bpe":
        check_bpe_vocab_size(vocab_size)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    out = Path(out) if out is not None else default_out_dir(corpus, tokenizer, vocab_size)
    check_replaceable(out)  # before reading and tokenizing: refusing late wastes the expensive part
    text = read_corpus(corpus)
    wanted = {
        "corpus_sha256": text.sha256,
        "tokenizer": tokenizer,
        "requested_vocab_size": vocab_size if tokenizer == "bpe" else None,
        "val_fraction": val_fraction,
    }
    if _matches(out, wanted):
        log.info("reusing prepared data in %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _machine_lock(out.parent):  # processes on one machine prepare once; the others wait, then reuse
        if _matches(out, wanted):
            log.info("reusing prepared data in %s, prepared by another process", out)
            return out
        _build(corpus, text, tokenizer, vocab_size, val_fraction, wanted, out)
    return out


def _build(corpus: str, text, tokenizer: str, vocab_size: int | None, val_fraction: float, wanted: dict,
           out: Path) -> None:
    started = time.perf_counter()
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tok = train_tokenizer(tokenizer, text.text, vocab_size)
        tokens = tok.encode_array(text.text)
        dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
        n_val = int(len(tokens) * val_fraction)
        splits = {"train": tokens[: len(tokens) - n_val], "val": tokens[len(tokens) - n_val :]}
        for split, ids in splits.items():
            ids.astype(dtype).tofile(tmp / f"{split}.bin")
        tok.save(str(tmp / TOKENIZER_FILE))
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **wanted,
            "corpus": redact(corpus),
            "corpus_bytes": text.num_bytes,
            "vocab_size": tok.vocab_size,
            "dtype": np.dtype(dtype).name,
            "train_tokens": len(splits["train"]),
            "val_tokens": len(splits["val"]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        _publish(tmp, out, wanted)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "prepared %s: %d train + %d val tokens, %s in %.1fs -> %s",
        redact(corpus), meta["train_tokens"], meta["val_tokens"], tok.describe(), time.perf_counter() - started, out,
    )


@contextmanager
def _machine_lock(folder: Path):
    """An exclusive flock on `folder` itself (no lock file to leave behind). Where the file system
    has no flock, go on without: `_publish` keeps concurrent preparation correct, only slower."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def read_meta(directory: str | os.PathLike) -> dict:
    """The meta.json of a prepared folder; DataError when it is missing or damaged."""
    path = Path(directory) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{directory} is not prepared data (no {META_FILE}); run `python -m mingpt.prepare`") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"{path} is damaged; delete {directory} and prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{path} is not a mingpt-prepared v{FORMAT_VERSION} description; prepare the data again")
    return meta


def _matches(directory: Path, wanted: dict) -> bool:
    try:
        meta = read_meta(directory)
    except DataError:
        return False
    return all(meta.get(key) == value for key, value in wanted.items())


def check_replaceable(out: Path) -> None:
    """DataError unless `out` is new, an empty folder, or prepared data (which `prepare` may replace).

    Anything else may be a user's files: preparing there would delete them."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"the prepared-data folder {out} is a file; choose an empty or new folder "
                        "(mingpt-prepare --out, or data.prepared_dir for training)")
    if not any(out.iterdir()):
        return
    try:
        read_meta(out)
    except DataError:
        raise DataError(
            f"{out} is not empty and holds no mingpt prepared data (no valid {META_FILE}); preparing there would "
            "replace its files, so choose an empty or new folder (mingpt-prepare --out, or data.prepared_dir "
            "for training)"
        ) from None


def _publish(tmp: Path, out: Path, wanted: dict) -> None:
    """Move the finished folder `tmp` to `out`, replacing stale data but never a concurrent twin,
    nor a folder that is not prepared data."""
    for _ in range(3):
        try:
            tmp.rename(out)
            return
        except OSError:  # `out` exists and is not empty
            if _matches(out, wanted):
                return  # another process prepared the same data first; theirs is as good
            check_replaceable(out)  # again: files may have appeared since `prepare` checked
            stale = out.parent / f".{out.name}.stale-{uuid.uuid4().hex[:8]}"
            try:
                out.rename(stale)
            except FileNotFoundError:
                continue  # someone else moved it meanwhile; try again
            shutil.rmtree(stale, ignore_errors=True)
    raise DataError(f"could not replace {out}; is another process preparing different data there?")


class TokenBlocks:
    """`(x, y)` blocks of a flat token file, read through a memory map."""

    def __init__(self, path: str | os.PathLike, dtype: str, block_size: int, stride: int | None = None,
                 vocab_size: int | None = None):
        self.path = Path(path)
        self.block_size = block_size
        self.vocab_size = vocab_size  # when known, each batch is checked against it (see `batch`)
        self.stride = stride or block_size
        if block_size < 1 or self.stride < 1:
            raise DataError(f"block_size and stride must be positive, got {block_size} and {self.stride}")
        try:
            self.tokens = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
        except FileNotFoundError:
            raise DataError(f"token file {self.path} is missing; prepare the data again") from None
        except ValueError:  # numpy cannot map an empty file
            self.tokens = np.zeros(0, dtype=np.dtype(dtype))
        # Each example needs block_size + 1 tokens: the inputs and one more target.
        spare = len(self.tokens) - (block_size + 1)
        self.num_examples = spare // self.stride + 1 if spare >= 0 else 0
        self._offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([index])
        return x[0], y[0]

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (len(indices), block_size) as int64 tensors, in one gather."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_examples):
            raise IndexError(f"example index out of range [0, {self.num_examples})")
        rows = np.asarray(self.tokens[indices[:, None] * self.stride + self._offsets], dtype=np.int64)
        # An id beyond the vocabulary would fail deep in the embedding (or on a GPU, as a device assert).
        # Checking the gathered batch costs one max; scanning the whole token file at start would not.
        if self.vocab_size is not None and rows.size and rows.max() >= self.vocab_size:
            raise DataError(
                f"{self.path} holds token id {rows.max()}, beyond the tokenizer's vocabulary of {self.vocab_size}; "
                f"the token file and tokenizer do not belong together: prepare the data again"
            )
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]


class PreparedData:
    """A prepared data folder (see mingpt.prepare): its tokenizer, description and splits."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        self.tokenizer: Tokenizer = load_tokenizer(str(self.directory / TOKENIZER_FILE))
        prepared_with = self.meta.get("vocab_size")
        if self.tokenizer.vocab_size != prepared_with:  # e.g. tokenizer.json copied from another folder
            raise DataError(
                f"{self.directory / TOKENIZER_FILE} has a vocabulary of {self.tokenizer.vocab_size} but the data "
                f"was prepared with {prepared_with} ({META_FILE}); the folder is damaged: delete {self.directory} "
                "and prepare the data again"
            )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def split(self, name: str, block_size: int, stride: int | None = None) -> TokenBlocks:
        """The 'train' or 'val' examples; DataError when the split is shorter than one block."""
        if name not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {name!r}")
        blocks = TokenBlocks(self.directory / f"{name}.bin", self.meta["dtype"], block_size, stride, self.vocab_size)
        if len(blocks.tokens) != self.meta[f"{name}_tokens"]:
            raise DataError(
                f"{blocks.path} holds {len(blocks.tokens)} tokens but {self.meta[f'{name}_tokens']} were "
                f"prepared; the file is damaged: delete {self.directory} and prepare the data again"
            )
        if len(blocks) == 0:
            raise DataError(
                f"the {name} split of {self.directory} has {len(blocks.tokens)} tokens, fewer than one "
                f"block of {block_size} + 1; use a smaller block_size or a longer corpus"
                + (" (or a larger val_fraction)" if name == "val" else "")
            )
        return blocks

"""Prepared data, and reading it: examples by memory map (mingpt.data.prepare writes it). A folder holds train.bin
and val.bin (raw little-endian uint16, or uint32, token ids), tokenizer.json, and meta.json (the sources as listed,
settings, counts, dtype, each file's sha256 and their fingerprint). An example is a window of `block_size` input tokens
`x` and the same window shifted by one, `y`, addressed by its token offset: the sampler picks a step's windows from seed
and position alone."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from mingpt.errors import DataError
from mingpt.storage import parse_json, read_regular_file
from mingpt.tokenizers import Tokenizer, load_tokenizer

if TYPE_CHECKING:  # torch is imported where a batch is made: preparing data and its commands need none of it
    import torch

FORMAT = "mingpt-prepared"
FORMAT_VERSION = 3  # a folder of an older version is prepared again
META_FILE = "meta.json"
MAX_META_BYTES = 64 << 20  # a description lists the sources: large for a corpus of many files, never this
TOKENIZER_FILE = "tokenizer.json"
TOKEN_FILES = (TOKENIZER_FILE, "train.bin", "val.bin")  # what the tokens are: the fingerprint covers these


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file, as meta.json records it."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


TOKEN_DTYPES = ("uint16", "uint32")  # what token files are written in: the smallest that holds the vocabulary


def fingerprint(digests: dict[str, str]) -> str:
    """One sha256 over the sha256 of each of TOKEN_FILES: it changes whenever the tokens do."""
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


class DamagedData(DataError):
    """A description of ours that contradicts itself or its files: refused, never prepared over in silence."""


def read_meta(directory: str | os.PathLike) -> dict:
    """The meta.json of a prepared folder; DataError when it is missing or damaged."""
    path = Path(directory) / META_FILE
    try:
        text = read_regular_file(path, MAX_META_BYTES).decode()
    except FileNotFoundError:
        raise DataError(f"{directory} is not prepared data (no {META_FILE}); run mingpt-prepare") from None
    except OSError as e:  # a link, a FIFO, a folder, too large
        raise DamagedData(f"{path} is damaged ({e.strerror or e}); delete {directory} and prepare the data again") \
            from None
    except UnicodeDecodeError:
        text = ""
    return parse_meta(text, str(path), str(directory))


def parse_meta(text: str, path: str, directory: str) -> dict:
    """The description `text` (from `path` in `directory`); DataError unless it is valid and consistent."""
    try:
        meta = parse_json(text)
    except ValueError:
        raise DamagedData(f"{path} is damaged; delete {directory} and prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} description; prepare the data again")
    damaged = lambda field, why: DamagedData(f"{path} is damaged: its {field} is {meta.get(field)!r}, {why}; "
                                             f"delete {directory} and prepare the data again")
    digests = meta.get("sha256")
    if not isinstance(digests, dict) or set(digests) != set(TOKEN_FILES) or \
            not all(isinstance(digest, str) for digest in digests.values()):
        raise damaged("sha256", f"not a sha256 for each of {', '.join(TOKEN_FILES)}")
    if meta.get("fingerprint") != fingerprint(digests):
        raise damaged("fingerprint", "not the one of its sha256 entries")
    for field in ("vocab_size", "train_tokens", "val_tokens"):
        if type(meta.get(field)) is not int or meta[field] < 0:
            raise damaged(field, "not a count")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise damaged("dtype", f"not one of {', '.join(TOKEN_DTYPES)}")
    if meta["dtype"] != token_dtype(meta["vocab_size"]):
        raise damaged("dtype", f"but the tokens of a vocabulary of {meta['vocab_size']} are "
                               f"{token_dtype(meta['vocab_size'])}")
    return meta


def token_dtype(vocab_size: int) -> str:
    """What the token files of a vocabulary are written in: the smallest of TOKEN_DTYPES that holds its ids."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class TokenBlocks:
    """`(x, y)` windows of a flat token file, read through a memory map. Examples by index (`batch`, `[i]`) are the
    fixed blocks `i * stride`: evaluation reads those, so that every evaluation sees the same text. Training reads
    windows at any token offset (`windows`), chosen by the sampler."""

    def __init__(self, path: str | os.PathLike, dtype: str, block_size: int, stride: int | None = None,
                 vocab_size: int | None = None):
        self.path = Path(path)
        self.block_size = block_size
        self.vocab_size = vocab_size  # when known, each batch is checked against it (see `windows`)
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
        self.num_starts = max(0, spare + 1)  # token offsets where a window fits
        self._offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch([index])
        return x[0], y[0]

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (len(indices), block_size) of the blocks `indices`, as int64 tensors."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_examples):
            raise IndexError(f"example index out of range [0, {self.num_examples})")
        return self.windows(indices * self.stride)

    def windows(self, starts: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (len(starts), block_size) of the windows at token offsets `starts`, in one gather."""
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (starts.min() < 0 or starts.max() >= self.num_starts):
            raise IndexError(f"window offset out of range [0, {self.num_starts})")
        rows = np.asarray(self.tokens[starts[:, None] + self._offsets], dtype=np.int64)
        # An id beyond the vocabulary fails deep in the embedding (a GPU device assert); one max per batch catches it.
        if self.vocab_size is not None and rows.size and rows.max() >= self.vocab_size:
            raise DataError(
                f"{self.path} holds token id {rows.max()}, beyond the tokenizer's vocabulary of {self.vocab_size}; "
                f"the token file and tokenizer do not belong together: prepare the data again"
            )
        import torch

        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]


class PreparedData:
    """A prepared data folder: its tokenizer, description and splits."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        for name in TOKEN_FILES:  # read as they are: never through a link to a file elsewhere, nor a FIFO
            try:
                regular = stat.S_ISREG(os.lstat(self.directory / name).st_mode)
            except FileNotFoundError:
                continue  # (named below)
            if not regular:
                raise DamagedData(f"{self.directory / name} is not a regular file (a link, a FIFO, a folder): the "
                                  f"folder is damaged; delete {self.directory} and prepare the data again")
        self.tokenizer: Tokenizer = load_tokenizer(str(self.directory / TOKENIZER_FILE))
        prepared_with = self.meta.get("vocab_size")
        if self.tokenizer.vocab_size != prepared_with:  # e.g. tokenizer.json copied from another folder
            raise DataError(
                f"{self.directory / TOKENIZER_FILE} has a vocabulary of {self.tokenizer.vocab_size} but the data "
                f"was prepared with {prepared_with} ({META_FILE}); the folder is damaged: delete {self.directory} "
                "and prepare the data again"
            )
        self._check_meta()

    def _check_meta(self) -> None:
        """DataError where a field of meta.json contradicts the files it describes (which its sha256 cover)."""
        path, itemsize = self.directory / META_FILE, np.dtype(self.meta["dtype"]).itemsize
        says = {"eot_id": (self.tokenizer.eot_id, f"but {TOKENIZER_FILE} ends documents with {self.tokenizer.eot_id}")}
        for split in ("train", "val"):
            try:
                size = os.stat(self.directory / f"{split}.bin").st_size
            except FileNotFoundError:
                raise DataError(f"token file {self.directory / split}.bin is missing; prepare the data again") from None
            says[f"{split}_tokens"] = (size / itemsize, f"but {split}.bin holds {size} bytes of {self.meta['dtype']}")
        for field, (value, why) in says.items():
            if self.meta.get(field) != value:
                raise DataError(f"{path} is damaged: its {field} is {self.meta.get(field)!r}, {why}; delete "
                                f"{self.directory} and prepare the data again")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def fingerprint(self) -> str:
        """A sha256 of the tokens and tokenizer: the same prepared data gives the same on any machine."""
        return self.meta["fingerprint"]

    def split(self, name: str, block_size: int, stride: int | None = None) -> TokenBlocks:
        """The 'train' or 'val' examples; DataError when the split is shorter than one block."""
        if name not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {name!r}")
        blocks = TokenBlocks(self.directory / f"{name}.bin", self.meta["dtype"], block_size, stride, self.vocab_size)
        if len(blocks) == 0:
            raise DataError(
                f"the {name} split of {self.directory} has {len(blocks.tokens)} tokens, fewer than one "
                f"block of {block_size} + 1; use a smaller block_size or a longer corpus"
                + (" (or a larger val_fraction)" if name == "val" else "")
            )
        return blocks

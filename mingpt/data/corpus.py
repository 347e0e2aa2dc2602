"""Corpus sources: what the user names, the files that makes, and their documents, read in pieces.

`data.corpus` is one of these, or a list of them:
    a file           corpus.txt, s3://bucket/corpus.txt.gz
    a folder         every file under it, in sorted path order (names starting with "." skipped)
                     following symbolic links to files and folders (a Hugging Face cache's layout)
    a quoted glob    'corpus/*.jsonl', s3://bucket/shards/part-*.txt, 'hf://datasets/ORG/NAME/data/*.parquet'
    python-docs      the built-in corpus: the Python language reference that every CPython install
                     carries as text (`pydoc_data.topics`, about 0.47 MB), so the default job needs
                     no network and no downloads

Files ending in .gz, .bz2, .xz or .zst are decompressed as they are read. A text file is one
document; a .jsonl file holds one document per line and a .parquet file one per row, in the field
(column) `data.text_field`. Listing the sources reads no content: their sizes and versions (mtime,
or the ETag or blob id on object stores and the Hub) tell prepared data whether it is still current.
An hf:// URL is read through huggingface_hub (HF_TOKEN for private data); with HF_HUB_OFFLINE=1, from
its local cache.

Records (JSONL lines, Parquet rows) are numbered across the whole corpus, so the same documents get
the same numbers, and so the same split, in whichever container and shards they are stored.

Documents are read in pieces of about `piece_bytes` (of a Parquet file: a batch of rows). A text
document larger than that is cut where a line break stands between two characters that are not
whitespace ("x\\nY"): tokenizers split words there anyway, so the pieces encode to the same tokens
as the whole document. A line with no such place within 4 pieces is cut at any line break, or else
anywhere (a minified megabyte-long line); only there can tokens differ from encoding the document
whole.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import io
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np

from mingpt.data.formats import (ZstdReader, check_hub_file, explain_hub_error, from_hub_cache, in_hub_cache,
                                  open_hub_file, parquet_batches, parquet_documents)
from mingpt.errors import DataError, MinGPTError
from mingpt.storage import explain_storage_error, is_local, open_fs, parse_json, redact

BUILTIN_CORPUS = "python-docs"
PIECE_BYTES = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # a JSONL line or a Parquet row is read whole: memory is bounded by this
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


@dataclass(frozen=True)
class Source:
    """One file of a corpus, as listed: where it is and which version of it."""

    url: str  # a local absolute path, a URL with its protocol, or BUILTIN_CORPUS
    size: int  # bytes as stored (compressed, where it is)
    version: str  # changes when the content does: mtime locally, the ETag on object stores, the blob id on the Hub

    @property
    def format(self) -> str:
        """How it holds documents: "text" (it is one), "jsonl" (one per line), "parquet" (one per row)."""
        name = self.url.lower()
        if name.endswith(".parquet"):
            return "parquet"
        for suffix in COMPRESSED:
            name = name.removesuffix(suffix)
        return "jsonl" if name.endswith(".jsonl") else "text"

    @property
    def records(self) -> bool:
        """Whether it holds records (documents numbered across the corpus), not one text document."""
        return self.format != "text"

    @property
    def seekable(self) -> bool:
        """Lines of text as stored (not compressed, not Parquet, not built in): a piece can be read from its offset."""
        return self.url != BUILTIN_CORPUS and self.format != "parquet" and not self.url.lower().endswith(COMPRESSED)

    @property
    def local_plain(self) -> bool:
        """A seekable local file: any process on this machine can read a piece of it. Not one of a Hugging Face
        cache, which is opened only after checking where its link leads (`open_hub_file`)."""
        return self.seekable and self.url.startswith("/") and not in_hub_cache(self.url)

    def to_dict(self) -> dict:
        return {**asdict(self), "url": redact(self.url)}


def as_list(corpus: str | Sequence[str]) -> list[str]:
    return [corpus] if isinstance(corpus, str) else list(corpus)


def list_sources(corpus: str | Sequence[str]) -> list[Source]:
    """The files of `corpus`, in order; DataError saying what to do where an entry names nothing readable."""
    sources = [source for entry in as_list(corpus) for source in _expand(entry)]
    if not sources:
        raise DataError("data.corpus is an empty list; name at least one file, folder or glob")
    return sources


def _expand(entry: str) -> list[Source]:
    if entry == BUILTIN_CORPUS:
        text = builtin_bytes()
        return [Source(BUILTIN_CORPUS, len(text), hashlib.sha256(text).hexdigest()[:16])]
    url, entry = entry, from_hub_cache(entry)
    try:
        fs, path = open_fs(entry)
    except MinGPTError as e:  # an unknown protocol, or its package is missing
        raise DataError(f"{e}; fix data.corpus (or --corpus of mingpt-prepare)") from None
    local = is_local(fs)
    if local and os.path.islink(path) and not os.path.exists(path):
        raise _broken_link(path)
    try:
        fs.invalidate_cache()  # an object store's listing may be cached from before a change
        if glob.has_magic(path):  # the hidden-file check starts where the pattern does
            found, what, root = fs.glob(path, detail=True), "glob", re.split(r"[*?[]", path)[0].rsplit("/", 1)[0]
        elif fs.isdir(path):
            found, what, root = _local_tree(fs, path) if local else fs.find(path, detail=True), "folder", path
        else:
            found, what, root = {path: fs.info(path)}, "file", path
        if local:
            found = {p: _followed(fs, p, info) for p, info in found.items() if not _hidden(p, root)}
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"corpus {redact(entry)} does not exist; give a file, folder or glob of UTF-8 text or "
                        f"JSONL, or {BUILTIN_CORPUS!r} for the built-in corpus") from None
    except Exception as e:  # storage clients raise many types (OSError, botocore, aiohttp): explain any
        hub = explain_hub_error(e, url) if url.startswith("hf://") else None
        if hub:
            raise DataError(hub) from None
        reason = explain_storage_error(e, local=is_local(fs), setting="data.corpus")
        raise DataError(f"cannot list the corpus {redact(entry)} (data.corpus, or --corpus of mingpt-prepare): "
                        f"{reason}") from None
    files = [
        Source(p if is_local(fs) else fs.unstrip_protocol(p), int(info.get("size") or 0), _version(info))
        for p, info in sorted(found.items())
        if info.get("type") == "file" and not _hidden(p, root)
    ]
    if not files:
        raise DataError(f"corpus {what} {redact(entry)} holds no files; check the path (quote a glob, so that the "
                        "shell does not expand it)")
    for file in files:
        if local and (in_hub_cache(file.url) or url.startswith("hf://")):
            _confined(file.url)
    return files


def _confined(path: str) -> None:
    """DataError unless the local `path`, of a Hugging Face cache, leads to a file of its repository (see
    `check_hub_file`)."""
    if not in_hub_cache(path):
        raise DataError(f"corpus file {path} is not in a repository's snapshot of the Hugging Face cache; check "
                        "HF_HOME, and download the dataset again")
    check_hub_file(path)


def _local_tree(fs, folder: str, above: dict | None = None) -> dict[str, dict]:
    """The files under the local `folder` and their info, following symbolic links to files and to
    folders (a Hugging Face cache links each file to its blob); hidden names are left out.

    `above` holds the folders this one lies in: a link back to one of them would be a loop."""
    stat = os.stat(folder)
    key = (stat.st_dev, stat.st_ino)
    if key in (above or {}):
        raise DataError(f"the corpus folder has a loop: {folder} is a symbolic link back to {above[key]}; remove "
                        "the link, or give a folder below it")
    above = {**(above or {}), key: folder}
    found = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if os.path.isdir(entry.path):  # follows a link (false for a broken one, told by `_followed`)
                found.update(_local_tree(fs, entry.path, above))
            else:
                found[entry.path] = fs.info(entry)  # a link's info is followed by `_followed`
    return found


def _followed(fs, path: str, info: dict) -> dict:
    """The info of what the local symbolic link `path` points to (its own where it is not a link). A link into
    a Hugging Face cache's blobs/ folder is versioned by the blob's name, its hash: the same on every machine
    that downloaded the same file, whenever it did (an mtime is not)."""
    if not info.get("islink"):
        return info
    try:
        target = os.path.realpath(path)
        followed = fs.info(path)  # a path, not a directory entry: fsspec follows the link
        if os.path.basename(os.path.dirname(target)) == "blobs":
            followed = {**followed, "blob_id": os.path.basename(target)}
        return followed
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ELOOP):
            raise
        raise _broken_link(path) from None


def _broken_link(path: str) -> DataError:
    """Why the symbolic link `path` leads to no file: a loop of links, or a target that does not exist."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return DataError(f"corpus file {path} is a loop of symbolic links ({path} -> {os.readlink(path)} -> ...); "
                             "fix or remove the link")
    return DataError(f"corpus file {path} is a symbolic link to {os.readlink(path)}, which does not exist; fix or "
                     "remove the link")


def _hidden(path: str, root: str) -> bool:
    """Whether `path`, found under `root`, is or lies in a hidden file or folder (.git, .DS_Store)."""
    return any(part.startswith(".") for part in path[len(root):].split("/"))


def _version(info: dict) -> str:
    for key in ("ETag", "etag", "blob_id", "mtime", "LastModified", "last_modified"):
        if info.get(key) is not None:
            return str(info[key]).strip('"')
    return ""


def open_source(source: Source) -> BinaryIO:
    """The content of `source`, decompressed where its name says it is compressed."""
    if source.url == BUILTIN_CORPUS:
        return io.BytesIO(builtin_bytes())
    if in_hub_cache(source.url):
        f = open_hub_file(source.url)
        return ZstdReader(f) if source.url.lower().endswith(".zst") else _decompressed(f, source.url)
    import fsspec

    zstd = source.url.lower().endswith(".zst")  # fsspec's zstd reader ends a truncated file in silence
    try:
        f = fsspec.open(source.url, "rb", compression=None if zstd or source.format == "parquet" else "infer").open()
        return ZstdReader(f) if zstd else f
    except FileNotFoundError:
        raise DataError(f"corpus file {redact(source.url)} disappeared while being read; run again") from None
    except (ValueError, ImportError) as e:  # e.g. .zst without zstandard
        raise DataError(f"cannot read {redact(source.url)}: {e}; install the package it names, or decompress "
                        "the file") from None
    except Exception as e:
        raise DataError(f"cannot read the corpus {redact(source.url)}: "
                        f"{explain_storage_error(e, setting='data.corpus')}") from None


def _decompressed(f: BinaryIO, url: str) -> BinaryIO:
    """`f`, decompressed where the name `url` says it is (gzip, bz2, xz); closing the result closes `f`."""
    from fsspec.compression import compr
    from fsspec.utils import infer_compression

    kind = None if url.lower().endswith(".parquet") else infer_compression(url)
    if kind is None:
        return f
    reader, close = compr[kind](f, mode="rb"), f.close
    reader.close = lambda: (type(reader).close(reader), close())
    return reader


@dataclass(frozen=True)
class Piece:
    """Consecutive documents of one source: part of one text document, whole lines of a JSONL file, or
    rows of a Parquet file."""

    source: int  # index into the list of sources
    offset: int  # of `data` in the (decompressed) source; for Parquet, the row of its first document
    data: bytes  # empty where the receiver reads the bytes from the file itself (see `lean`)
    size: int  # len(data) as read
    last: bool  # the source's last piece: a text document ends here
    records: int = 0  # how many records (documents numbered across the corpus) it holds
    first: int = 0  # the number of its first record
    ends: bytes = b""  # for Parquet: where each document ends in `data` (int64)

    def lean(self) -> "Piece":
        """This piece without its bytes: for a process that reads them from the same local file."""
        return replace(self, data=b"")

    def filled(self, path: str | None) -> "Piece":
        """This piece with its bytes: read from the local file `path` where it was sent lean."""
        if self.data or not self.size:
            return self
        with open(path, "rb") as f:
            f.seek(self.offset)
            return replace(self, data=f.read(self.size))


def read_pieces(sources: Sequence[Source], text_field: str, digests: dict[int, str] | None = None) -> Iterator[Piece]:
    """Every source in order, in pieces of about PIECE_BYTES cut at safe places (see the module
    docstring), their records numbered across the corpus. Where `digests` is given, it holds each
    source's sha256 (of its documents as read), up to the piece last yielded while it is being read."""
    records = 0
    for index, source in enumerate(sources):
        hasher = hashlib.sha256()
        for piece in _pieces(index, source, text_field):
            hasher.update(piece.data)
            hasher.update(piece.ends)
            if digests is not None:
                digests[index] = hasher.hexdigest()
            yield replace(piece, first=records)
            records += piece.records
        if digests is not None:
            digests[index] = hasher.hexdigest()


def _check_rows(ends: bytes, first_row: int, name: str) -> None:
    """DataError naming the first row of a Parquet batch (its rows' `ends`) whose text is longer than a JSONL record
    may be: the same bound on a document's memory in every format."""
    lengths = np.diff(np.frombuffer(ends, dtype=np.int64), prepend=0)
    if len(lengths) and lengths.max() > MAX_RECORD_BYTES:
        row = first_row + int(lengths.argmax())
        raise DataError(f"corpus {name}, row {row}, holds {int(lengths.max()):,} bytes of text, more than the "
                        f"{MAX_RECORD_BYTES:,} one document may hold; split its text into several rows")


def _pieces(index: int, source: Source, text_field: str, chosen: Callable[[int], bool] | None = None) \
        -> Iterator[Piece]:
    """All of `source` (number `index` of the corpus), read through, in pieces cut at safe places; of a
    Parquet file, only the row groups g where `chosen(g)`, if given."""
    with open_source(source) as f:
        if source.format == "parquet":
            for row, data, ends in parquet_batches(f, redact(source.url), text_field, PIECE_BYTES, chosen):
                _check_rows(ends, row, redact(source.url))
                yield Piece(index, row, data, len(data), False, len(ends) // 8, ends=ends)
            return
        offset = 0
        for data, last in _cut(_read_blocks(f, source, PIECE_BYTES), source.records, PIECE_BYTES,
                               redact(source.url)):
            records = sum(1 for line in data.split(b"\n") if line.strip()) if source.records else 0
            yield Piece(index, offset, data, len(data), last, records)
            offset += len(data)


def sample_pieces(sources: Sequence[Source], text_field: str, chosen: Callable[[int, int], bool]) -> Iterator[Piece]:
    """The pieces numbered n of source s where `chosen(s, n)`, each about PIECE_BYTES of whole lines
    (of a Parquet file, the row groups n).

    A file stored uncompressed is read only where a piece is chosen (a seek, or a ranged GET on an
    object store), so sampling a large corpus reads about the sample, not the corpus. Parquet reads
    only the chosen row groups' text column. A compressed file cannot seek: it is read through, and
    its cut pieces are chosen the same way."""
    piece_bytes = PIECE_BYTES
    for index, source in enumerate(sources):
        if source.format == "parquet":
            yield from _pieces(index, source, text_field, lambda group: chosen(index, group))
            continue
        if not source.seekable:
            yield from (piece for number, piece in enumerate(_pieces(index, source, text_field))
                        if chosen(index, number))
            continue
        for number in range(-(-source.size // piece_bytes)):
            if chosen(index, number):
                start, last = number * piece_bytes, (number + 1) * piece_bytes >= source.size
                data = _read_range(source, start, piece_bytes)
                begins = number == 0 or b"\n" in data  # a record: the piece holds the start of one
                if source.records and not last and begins and not data.endswith(b"\n"):
                    data += _rest_of_line(source, start + piece_bytes)  # a record longer than a piece is sampled
                data = _whole_lines(data, first=number == 0, last=last)  # by the piece it begins in
                yield Piece(index, start, data, len(data), False)


def _read_range(source: Source, offset: int, size: int) -> bytes:
    """`size` bytes of an uncompressed `source` from `offset`: one ranged read on an object store."""
    fs, path = open_fs(source.url)
    try:
        with open_hub_file(path) if in_hub_cache(source.url) else fs.open(path, "rb", block_size=size) as f:  # an object store fetches these bytes, not 50 MB
            f.seek(offset)
            return f.read(size)
    except Exception as e:
        raise DataError(f"cannot read the corpus {redact(source.url)}: "
                        f"{explain_storage_error(e, local=is_local(fs), setting='data.corpus')}") from None


def _rest_of_line(source: Source, offset: int) -> bytes:
    """The bytes of `source` from `offset` to the end of its line, where that is at most MAX_RECORD_BYTES on (a
    longer record is the full pass's error to name: here, nothing)."""
    rest = b""
    while len(rest) <= MAX_RECORD_BYTES and offset + len(rest) < source.size:
        block = _read_range(source, offset + len(rest), PIECE_BYTES)
        end = block.find(b"\n")
        if end >= 0:
            return rest + block[:end + 1]
        rest += block
    return rest if offset + len(rest) >= source.size else b""


def _whole_lines(data: bytes, first: bool, last: bool) -> bytes:
    """`data` without the partial line it may start with (unless `first`) and end with (unless `last`)."""
    start = 0 if first else data.find(b"\n") + 1
    end = len(data) if last else data.rfind(b"\n") + 1
    return data[start:end] if end > start else b""


def _read_blocks(f: BinaryIO, source: Source, size: int) -> Iterator[bytes]:
    while True:
        try:
            block = f.read(size)
        except Exception as e:  # a truncated or damaged .gz or .zst (OSError, EOFError, ZstdError), a lost connection
            raise DataError(f"cannot read {redact(source.url)}: {type(e).__name__}: {e}; if it is compressed, check "
                            "that it decompresses (gzip -t, zstd -t)") from None
        if not block:
            return
        yield block


def _cut(blocks: Iterator[bytes], by_line: bool, piece_bytes: int, name: str) -> Iterator[tuple[bytes, bool]]:
    """Re-cut `blocks` (of the file `name`) into pieces of at least `piece_bytes`, each ending at a safe place.
    A text piece is at most 4 pieces long (see `_safe_end`); a record, MAX_RECORD_BYTES."""
    pending, offset = b"", 0
    for block in blocks:
        pending += block
        while len(pending) >= piece_bytes:
            end = _safe_end(pending, piece_bytes, by_line)
            if end is None:
                if by_line and len(pending) - piece_bytes > MAX_RECORD_BYTES:  # a line from before piece_bytes
                    start = offset + pending.rfind(b"\n", 0, piece_bytes - 1) + 1
                    raise DataError(f"{name}, the record at byte {start}, is longer than {MAX_RECORD_BYTES:,} bytes, "
                                    "the most one record may hold; split its text into several records")
                break  # read on: the next block may hold a safe place
            yield pending[:end], False
            pending, offset = pending[end:], offset + end
    yield pending, True


def _safe_end(data: bytes, start: int, by_line: bool) -> int | None:
    """The end of the first piece of `data`: just after a line break at or beyond `start`."""
    if by_line:
        at = data.find(b"\n", start - 1)
        return at + 1 if at >= 0 else None
    at = start - 1
    while True:
        at = data.find(b"\n", at)
        if at < 0 or at + 1 >= len(data):
            break
        if at > 0 and not data[at - 1 : at].isspace() and not data[at + 1 : at + 2].isspace():
            return at + 1
        at += 1
    if len(data) < 4 * start:
        return None
    at = data.find(b"\n", start - 1)  # no such place in 4 pieces: any line break, else anywhere
    if 0 <= at < len(data) - 1:
        return at + 1
    end = start
    while end < len(data) and (data[end] & 0xC0) == 0x80:  # not inside a UTF-8 character
        end += 1
    return end


def documents(piece: Piece, form: str, text_field: str, name: str) -> Iterator[tuple[int, str]]:
    """The texts in `piece` of a source of format `form`, each with its record number (see `read_pieces`):
    one text for a piece of a text document (numbered -1), one per record for JSONL and Parquet."""
    if form == "text":
        yield -1, _decode(piece.data, name, piece.offset)
        return
    if form == "parquet":
        yield from enumerate(parquet_documents(piece.data, piece.ends, name, piece.offset), start=piece.first)
        return
    start, number = 0, piece.first
    for line in piece.data.split(b"\n"):
        offset, start = piece.offset + start, start + len(line) + 1
        if not line.strip():
            continue
        where = f"{name}, the record at byte {offset}"
        try:
            record = parse_json(_decode(line, name, offset))
        except ValueError as e:  # not JSON, nested thousands deep, an integer of thousands of digits
            raise DataError(f"{where} is not a JSON record ({e}); fix or remove that line") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            fields = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            raise DataError(f"{where} has no text field {text_field!r}; set data.text_field (--text-field) to the "
                            f"field holding the text (this record has: {fields})")
        if b"\\u" in line:  # only a JSON escape can make a lone surrogate, which no text holds
            _check_no_surrogate(text, where)
        yield number, text
        number += 1


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _check_no_surrogate(text: str, where: str) -> None:
    found = _SURROGATE.search(text)
    if found:
        raise DataError(f"{where} is not UTF-8 text: its {found.group()!r} at character {found.start()} is half of a "
                        "UTF-16 pair (a lone surrogate); fix that record")


def _decode(data: bytes, name: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"corpus {name} is not UTF-8 text (bad byte at offset {offset + e.start}); convert it to "
                        "UTF-8, e.g. `iconv -f LATIN1 -t UTF-8`") from None


def builtin_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics)).encode("utf-8")

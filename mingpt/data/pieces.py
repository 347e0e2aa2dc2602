"""The corpus read in pieces of about `piece_bytes` (of Parquet, a batch of rows), whole (`read_pieces`) or a sample
drawn across it (`sample_pieces`); and the documents of a piece (`documents`). A text document is cut where a line break
stands between two non-whitespace characters ("x\\nY"): tokenizers split words there anyway, so the pieces encode as the
whole would. A line with no such place within 4 pieces is cut at any line break, else anywhere (a minified megabyte-long
line): only there can tokens differ."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import BinaryIO, Callable, Iterator, Sequence

import numpy as np

from mingpt.data.corpus import Source, open_source
from mingpt.data.formats import in_hub_cache, open_hub_file, parquet_batches, parquet_documents
from mingpt.errors import DataError
from mingpt.tokenizers.base import lone_surrogate
from mingpt.storage import explain_storage_error, is_local, open_fs, parse_json, redact

PIECE_BYTES = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # a JSONL line or a Parquet row is read whole: memory is bounded by this


@dataclass(frozen=True)
class Piece:
    """Consecutive documents of one source: part of a text document, whole lines of a JSONL file, or Parquet rows."""

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
    """Every source in order, in pieces of about PIECE_BYTES cut at safe places, records numbered across the corpus.
    `digests`, where given, holds each source's sha256 (of its documents as read) to the last piece yielded."""
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
    """DataError naming the first row of a Parquet batch (its rows' `ends`) longer than a JSONL record may be."""
    lengths = np.diff(np.frombuffer(ends, dtype=np.int64), prepend=0)
    if len(lengths) and lengths.max() > MAX_RECORD_BYTES:
        row = first_row + int(lengths.argmax())
        raise DataError(f"corpus {name}, row {row}, holds {int(lengths.max()):,} bytes of text, more than the "
                        f"{MAX_RECORD_BYTES:,} one document may hold; split its text into several rows")


def _pieces(index: int, source: Source, text_field: str, chosen: Callable[[int], bool] | None = None) \
        -> Iterator[Piece]:
    """All of `source` (number `index`) in pieces cut at safe places; of Parquet, the row groups where `chosen`."""
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
    """The pieces n of source s where `chosen(s, n)`, each about PIECE_BYTES of whole lines (of Parquet, row group n).
    An uncompressed file is read only where a piece is chosen (a seek, a ranged GET): a sample reads about the sample;
    Parquet, the chosen row groups' text column. A compressed file cannot seek: it is read through, chosen alike."""
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
    """`source` from `offset` to its line's end, if within MAX_RECORD_BYTES (a longer one is the full pass's error)."""
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
    """The texts in `piece` with their record numbers: one per JSONL or Parquet record; a text document's, -1."""
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
        problem = lone_surrogate(text) if b"\\u" in line else None  # only a JSON escape can make one here
        if problem:
            raise DataError(f"{where} is not UTF-8 text: {problem}; fix that record")
        yield number, text
        number += 1


def _decode(data: bytes, name: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"corpus {name} is not UTF-8 text (bad byte at offset {offset + e.start}); convert it to "
                        "UTF-8, e.g. `iconv -f LATIN1 -t UTF-8`") from None

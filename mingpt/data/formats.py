"""How stored corpus files become documents, beyond plain and compressed text: zstd streams, Parquet row groups, and
Hugging Face Hub URLs (from the local cache under HF_HUB_OFFLINE). The readers are the field's libraries; here is what
they leave to the caller: a truncated zstd file raises instead of ending early, Parquet is read a batch of rows at a
time (bounded memory whatever its row groups' size), and every failure names the file."""

from __future__ import annotations

import io
import os
import re
import stat
from typing import BinaryIO, Callable, Iterator

import numpy as np

from mingpt.errors import DataError
from mingpt.storage import redact

ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE = range(0x184D2A50, 0x184D2A60)  # frames of metadata, not content


class ZstdReader(io.RawIOBase):
    """The decompressed content of a zstd stream, a block (at most 128 KiB) at a time, cut by the blocks' headers (RFC
    8878): a highly compressed file (a GB of zeros in a few KB) never decompresses all at once. EOFError where the
    stream ends inside a frame: zstandard's own readers end there in silence, dropping a truncated file's tail."""

    def __init__(self, raw: BinaryIO):
        import zstandard

        self.raw, self.new_frame = raw, zstandard.ZstdDecompressor().decompressobj
        self.blocks, self.pending, self.at = self._blocks(), b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at >= len(self.pending):
            block = next(self.blocks, None)
            if block is None:
                return 0
            self.pending, self.at = block, 0
        count = min(len(buffer), len(self.pending) - self.at)
        buffer[:count] = self.pending[self.at : self.at + count]
        self.at += count
        return count

    def _blocks(self) -> Iterator[bytes]:
        """The decompressed content, a block at a time (an empty one where a piece of a frame holds no content)."""
        while magic := self.raw.read(4):
            number = int.from_bytes(magic + self._read(4 - len(magic)), "little")
            if number in ZSTD_SKIPPABLE:
                self._read(int.from_bytes(self._read(4), "little"))
                continue
            if number != ZSTD_MAGIC:
                raise ValueError("not a zstd frame where one should start: the file is damaged or not zstd")
            frame, descriptor = self.new_frame(), self._read(1)
            flags = descriptor[0]  # content size field, single segment, checksum, dictionary id
            single = bool(flags & 0x20)
            header = (not single) + (0, 1, 2, 4)[flags & 3] + (single, 2, 4, 8)[flags >> 6]
            yield frame.decompress(number.to_bytes(4, "little") + descriptor + self._read(header))
            last = False
            while not last:
                block = self._read(3)
                value = int.from_bytes(block, "little")
                last, kind, size = bool(value & 1), (value >> 1) & 3, value >> 3
                yield frame.decompress(block + self._read(1 if kind == 1 else size))  # kind 1: one byte, repeated
            if flags & 4:
                yield frame.decompress(self._read(4))  # the content's checksum

    def _read(self, size: int) -> bytes:
        data = self.raw.read(size)
        while len(data) < size:
            more = self.raw.read(size - len(data))
            if not more:
                raise EOFError("the zstd stream ends inside a frame: the file is truncated")
            data += more
        return data

    def close(self) -> None:
        self.raw.close()
        super().close()


def parquet_batches(f: BinaryIO, name: str, text_field: str, piece_bytes: int,
                    chosen: Callable[[int], bool] | None = None) -> Iterator[tuple[int, bytes, bytes]]:
    """The text column of Parquet file `f` in batches of about `piece_bytes`: (the batch's first row, its documents'
    UTF-8 bytes one after another, their ends as int64 bytes); with `chosen`, only the row groups g where chosen(g)."""
    import pyarrow.parquet as pq

    try:  # a read buffer: a column chunk is read a buffer at a time, not whole
        parquet = pq.ParquetFile(f, buffer_size=piece_bytes, pre_buffer=False)
    except Exception as e:  # ArrowInvalid for a truncated file (no footer), OSError
        raise DataError(f"{name} is not a readable Parquet file ({_reason(e)}); check that it was copied whole") \
            from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{name} has no column {text_field!r}; set data.text_field (--text-field) to the column "
                        f"holding the text (its columns: {', '.join(columns)})")
    if columns.count(text_field) > 1:
        raise DataError(f"{name} has {columns.count(text_field)} columns named {text_field!r}; write the file with "
                        "one, or set data.text_field (--text-field) to another column")
    _check_text_type(parquet.schema_arrow.field(text_field).type, name, text_field)
    row = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if chosen is None or chosen(group):
            try:
                batches = parquet.iter_batches(_batch_rows(parquet, group, text_field, piece_bytes),
                                               row_groups=[group], columns=[text_field], use_threads=False)
                for batch in batches:
                    yield row, *_texts(batch.column(0), name, text_field, row)
                    row += batch.num_rows
            except DataError:
                raise
            except Exception as e:  # a damaged page: ArrowInvalid, OSError from the decompressor
                raise DataError(f"cannot read {name}, row group {group}: {_reason(e)}; the file is damaged, copy "
                                "it again") from None
        else:
            row += rows


def _batch_rows(parquet, group: int, text_field: str, piece_bytes: int) -> int:
    """Rows that hold about `piece_bytes` of text in row group `group`, from its metadata."""
    meta = parquet.metadata.row_group(group)
    size = next((meta.column(i).total_uncompressed_size for i in range(meta.num_columns)
                 if meta.column(i).path_in_schema == text_field), 0)
    return max(1, min(meta.num_rows, piece_bytes * meta.num_rows // max(size, 1)))


def _check_text_type(kind, name: str, text_field: str) -> None:
    import pyarrow as pa

    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{name}: column {text_field!r} holds {kind}, not text; set data.text_field (--text-field) "
                        "to a column of strings")


def _texts(column, name: str, text_field: str, first_row: int) -> tuple[bytes, bytes]:
    """The UTF-8 bytes of a column of strings one after another, and where each ends (int64 bytes)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column.null_count:
        row = first_row + pc.index(column.is_null(), True).as_py()
        raise DataError(f"{name}, row {row}: {text_field!r} is null, not text; fill or drop that row")
    column = column.cast(pa.large_string())  # one layout to read: int64 offsets into one data buffer
    _, offsets, values = column.buffers()
    ends = np.frombuffer(offsets, dtype=np.int64, count=len(column) + 1, offset=column.offset * 8)
    start, end = int(ends[0]), int(ends[-1])
    data = values.slice(start, end - start).to_pybytes() if end > start else b""
    return data, (ends[1:] - start).tobytes()


def parquet_documents(data: bytes, ends: bytes, name: str, first_row: int) -> Iterator[str]:
    """The documents of a batch from `parquet_batches`, whose first is the row `first_row` of the file `name`."""
    start = 0
    for row, end in enumerate(np.frombuffer(ends, dtype=np.int64).tolist(), start=first_row):
        try:  # a writer may store any bytes as a string: Arrow does not check them when it reads
            yield data[start:end].decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"corpus {name}, row {row}, is not UTF-8 text (bad byte at offset {e.start} of its "
                            "text); fix that row, or write the file again as UTF-8") from None
        start = end


def _reason(e: BaseException) -> str:
    """The error's type and first sentence (Arrow's messages go on with guesses)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {redact(first.split('. ')[0].rstrip('.'))}"


HUB_URL = re.compile(r"^hf://(?P<kind>datasets|spaces)/(?P<repo>[^/@]+/[^/@]+)(@(?P<revision>[^/]+))?(/(?P<path>.*))?$")


def from_hub_cache(url: str) -> str:
    """For an hf:// URL under HF_HUB_OFFLINE, the same files in the local Hugging Face cache; else `url` itself."""
    if not url.startswith("hf://"):
        return url
    if ".." in re.split(r"[/@]", url):
        raise DataError(f"{redact(url)}: a Hub path may not hold '..'; name files inside the repository")
    found = HUB_URL.match(url)
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() not in ("1", "ON", "YES", "TRUE"):
        return url
    from huggingface_hub import snapshot_download

    if not found:
        raise DataError(f"{redact(url)} is not a Hub dataset URL; write hf://datasets/ORG/NAME/PATH-OR-GLOB")
    repo, path = found["repo"], found["path"] or ""
    try:
        folder = snapshot_download(repo, repo_type=found["kind"].removesuffix("s"), revision=found["revision"],
                                   local_files_only=True)
    except Exception:  # LocalEntryNotFoundError: nothing of this repository (or revision) in the cache
        raise DataError(f"{redact(url)}: HF_HUB_OFFLINE is set and the Hugging Face cache holds nothing of {repo}; "
                        f"download it first (hf download {repo} --repo-type dataset --include '{path or '*'}') or "
                        "unset HF_HUB_OFFLINE") from None
    return os.path.join(folder, path) if path else folder


# A file of a repository in a Hugging Face cache: REPO/snapshots/REVISION/PATH, each file a link into REPO/blobs.
HUB_SNAPSHOT = re.compile(r"^(?P<repo>/.*/(?:datasets|spaces|models)--[^/]+)/snapshots/[^/]+(?=/)")
# A blob's name there is its content's hash: git's sha1 of a small file, the sha256 of a large (LFS) one.
HUB_BLOB_NAME = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")


def in_hub_cache(path: str) -> bool:
    """Whether the local `path` is a file of a repository's snapshot in a Hugging Face cache."""
    return HUB_SNAPSHOT.match(path) is not None


def hub_blob_name(path: str) -> str | None:
    """The hash naming the content of `path`, a file of a Hugging Face cache's snapshot linking to its repository's
    blob; else None (a user's own folder named blobs names nothing by content: its files can be edited in place)."""
    found = HUB_SNAPSHOT.match(path)
    if found is None:
        return None
    folder, name = os.path.split(os.path.realpath(path))
    if folder != os.path.join(os.path.realpath(found["repo"]), "blobs") or not HUB_BLOB_NAME.match(name):
        return None
    return name


def check_hub_file(path: str) -> str:
    """The real path of `path`, a file of a snapshot in a Hugging Face cache; DataError unless it leads into its
    own snapshot or its repository's blobs, to a regular file of this user's or root's. A cache can be shared
    with other users (HF_HOME on a folder all can write): a link planted there must not read this user's files."""
    found = HUB_SNAPSHOT.match(path)
    repo, snapshot, real = found["repo"], found[0], os.path.realpath(path)
    inside = [os.path.realpath(snapshot), os.path.realpath(os.path.join(repo, "blobs"))]
    if inside[1] != os.path.join(os.path.realpath(repo), "blobs") or \
            not any(real.startswith(folder + "/") for folder in inside):
        raise DataError(f"corpus file {path} leads to {real}, outside its repository in the Hugging Face cache (a "
                        "link someone else may have put there); remove it and download the dataset again, into a "
                        "cache of your own (HF_HOME) if others can write this one")
    _check_owner(os.lstat(real), path)
    return real


def _check_owner(found: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(found.st_mode) or found.st_uid not in (os.getuid(), 0):
        raise DataError(f"corpus file {path} in the Hugging Face cache is not a regular file of yours or root's "
                        f"(mode {stat.filemode(found.st_mode)}, owner uid {found.st_uid}); download the dataset "
                        "into a cache of your own (HF_HOME)")


def open_hub_file(path: str) -> BinaryIO:
    """`path`, a Hugging Face cache's file, opened once `check_hub_file` allows it, never through a link put since."""
    real = check_hub_file(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise DataError(f"cannot open corpus file {path} ({real}): {e.strerror}; download the dataset again") from None
    try:
        _check_owner(os.fstat(fd), path)
        opened = os.readlink(f"/proc/self/fd/{fd}")  # a folder on the way swapped for a link since: elsewhere
        if opened != real:
            raise DataError(f"corpus file {path} changed while it was opened (it now leads to {opened}); remove "
                            "it and download the dataset again, into a cache of your own (HF_HOME)")
    except DataError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def explain_hub_error(e: BaseException, url: str) -> str | None:
    """One line for a failure to reach or read an hf:// URL, or None where it is not the Hub's."""
    name = type(e).__name__
    if name == "OfflineModeIsEnabled":
        return f"{redact(url)}: HF_HUB_OFFLINE is set; unset it to reach the Hub, or download the files first"
    if name in ("RepositoryNotFoundError", "GatedRepoError", "HfHubHTTPError") or "401" in str(e):
        return (f"the Hub refused {redact(url)} ({name}); check the dataset's name, and for a private or gated one "
                "that HF_TOKEN holds a token with access to it")
    if name in ("ConnectError", "ConnectTimeout", "ReadTimeout", "ConnectionError") or isinstance(e, ConnectionError):
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        return (f"cannot reach the Hugging Face Hub at {redact(endpoint)} for {redact(url)} ({name}); check the "
                "network, or download the files where there is one and set HF_HUB_OFFLINE=1")
    return None

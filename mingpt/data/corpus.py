"""Corpus sources: what the user names (files, folders, quoted globs, python-docs: docs/data.md), the files that
makes, and how each is opened (mingpt.data.pieces reads them). A folder's files come in sorted path order, hidden names
skipped, following symbolic links (a Hugging Face cache's layout). Listing reads no content: sizes and versions (mtime,
ETag, the Hub's blob id) tell prepared data whether it is still current. Records (JSONL lines, Parquet rows) are
numbered across the whole corpus, so the same documents get the same split in whichever files they are stored."""

from __future__ import annotations

import errno
import glob
import hashlib
import io
import os
import re
from dataclasses import asdict, dataclass
from typing import BinaryIO, Sequence

from mingpt.data.formats import (ZstdReader, check_hub_file, explain_hub_error, from_hub_cache, hub_blob_name,
                                  in_hub_cache, open_hub_file)
from mingpt.errors import DataError, MinGPTError
from mingpt.storage import explain_storage_error, is_local, open_fs, redact

BUILTIN_CORPUS = "python-docs"
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
        """A seekable local file any process here can read pieces of; not a Hugging Face cache's (`open_hub_file`)."""
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
    """DataError unless the local `path`, of a Hugging Face cache, leads to a file of its repository."""
    if not in_hub_cache(path):
        raise DataError(f"corpus file {path} is not in a repository's snapshot of the Hugging Face cache; check "
                        "HF_HOME, and download the dataset again")
    check_hub_file(path)


def _local_tree(fs, folder: str, above: dict | None = None) -> dict[str, dict]:
    """The files under the local `folder` and their info, following links to files and folders (a Hugging Face cache
    links each file to its blob), hidden names left out. `above`: the folders it lies in (a link back is a loop)."""
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
    """The info of what the local link `path` points to (its own where not a link). A Hugging Face cache's file is
    versioned by its blob's name, its content's hash, the same on every machine (an mtime is not); others by mtime."""
    if not info.get("islink"):
        return info
    try:
        followed = fs.info(path)  # a path, not a directory entry: fsspec follows the link
        blob = hub_blob_name(path)
        return {**followed, "blob_id": blob} if blob else followed
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


def builtin_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics)).encode("utf-8")

"""A snapshot's manifest, its commit record: the snapshot's name (its step), and each file's size and sha256 (hashed
by `HashingWriter` as it is written). Reading a manifest and its files (snapshots, compile caches) opens only regular
files of the expected size (a planted FIFO or device would block or never end) and reads no more than that."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from mingpt.storage import parse_json

FORMAT = "mingpt-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# A file in a snapshot: a name, or a name in one folder; a manifest naming anything else (`../..`, `/etc`) is damaged.
_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_.][A-Za-z0-9_.-]*)?$")
_NAME = re.compile(r"^step-(\d{9})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MANIFEST_MAX_BYTES = 1 << 20  # a manifest takes a few KiB: a larger file is none this project wrote
_CHUNK = 64 << 20  # hashing reads, and the read-ahead of S3 files


class Untrusted(Exception):
    """A manifest, or a file it records, cannot be trusted: why, in a few words."""


def read_manifest(fs, path: str) -> Any | None:
    """The JSON of the manifest at `path` on `fs`; None where there is none. Untrusted where it is not a regular
    file of at most MANIFEST_MAX_BYTES, or not JSON. The storage's own errors pass."""
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    if info.get("type") != "file" or info.get("size", 0) > MANIFEST_MAX_BYTES:
        raise Untrusted(f"{MANIFEST} is not a regular file of at most {MANIFEST_MAX_BYTES >> 20} MiB")
    try:
        return parse_json(fs.cat_file(path))
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise Untrusted(f"{MANIFEST} is not valid JSON") from None


def check_recorded(fs, path: str, name: str, size: int) -> None:
    """Untrusted unless `path` (the file `name` of a manifest) is a regular file of the `size` bytes it records."""
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise Untrusted(f"{name} is missing") from None
    if info.get("type") != "file":
        raise Untrusted(f"{name} is not a regular file")
    if info.get("size") != size:
        raise Untrusted(f"{name} has {info.get('size')} bytes, its manifest records {size}")


def read_recorded(fs, path: str, name: str, size: int, sha256: str, keep: bool = True) -> bytes:
    """The bytes of `path` (the file `name` of a manifest), once they are the `size` bytes of sha256 `sha256` it
    records (Untrusted otherwise); with `keep` false, they are hashed in chunks and b"" is returned."""
    check_recorded(fs, path, name, size)
    digest, data, read = hashlib.sha256(), b"", 0
    with fs.open(path, "rb", block_size=_CHUNK) as f:
        if keep:  # one read, bounded by the size just checked (and one byte more, should it grow)
            data = f.read(size + 1)
            digest.update(data)
            read = len(data)
        else:
            while read <= size and (chunk := f.read(_CHUNK)):
                digest.update(chunk)
                read += len(chunk)
    if read != size or digest.hexdigest() != sha256:
        raise Untrusted(f"{name} does not match the checksum its manifest records")
    return data


def snapshot_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(name: str) -> int:
    return int(_NAME.match(name)[1])


def is_snapshot_name(name: str) -> bool:
    """Whether `name` is a snapshot's folder name: step- and 9 digits."""
    return bool(_NAME.match(name))


def manifest_problem(manifest: Any, step: int) -> str | None:
    """Why `manifest` cannot be trusted as the commit of `step`, in a few words; None when it can."""
    if not isinstance(manifest, dict):
        return "the manifest is not a JSON object"
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        return f"the manifest is not {FORMAT} version {FORMAT_VERSION}"
    if manifest.get("step") != step:
        return f"the manifest says step {manifest.get('step')!r}, the folder step {step}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "the manifest lists no files"
    for name, entry in files.items():
        if not _FILE.match(name) or ".." in name.split("/"):
            return f"the manifest names a file {name!r} that snapshots never hold"
        if not (isinstance(entry, dict) and is_count(entry.get("bytes")) and is_sha256(entry.get("sha256"))):
            return f"the manifest entry of {name} is not {{bytes, sha256}}"
    return None


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_sha256(value: Any) -> bool:
    return isinstance(value, str) and bool(_SHA256.match(value))


class HashingWriter:
    """A write-only file that passes bytes on and keeps their count and sha256."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        """Nothing: whoever opened the file closes it (and makes it durable first)."""

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> dict:
        return {"bytes": self.size, "sha256": self.sha.hexdigest()}

"""A snapshot's manifest, its commit record: the snapshot's name (its step), and for each file its size and
sha256 (an entry, made by `HashingWriter` as the file is written); `manifest_problem` says why a manifest read
back cannot be trusted."""

from __future__ import annotations

import hashlib
import re
from typing import Any

FORMAT = "mingpt-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# What a file in a snapshot may be called: a name, or a name in one folder; never `..`, never absolute.
# A manifest naming anything else (`../../etc/passwd`) is damaged.
_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_.][A-Za-z0-9_.-]*)?$")
_NAME = re.compile(r"^step-(\d{9})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
        if not (isinstance(entry, dict) and _is_count(entry.get("bytes"))
                and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])):
            return f"the manifest entry of {name} is not {{bytes, sha256}}"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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

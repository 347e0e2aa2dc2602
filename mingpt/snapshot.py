"""Snapshots of a training run, in a local folder or any fsspec URL, one folder per snapshot.

    <dir>/step-000001200/model.pt        model weights (state dict; all a sampler needs)
                        optimizer.pt    AdamW state
                        tokenizer.json  the vocabulary
                        manifest.json   written last: step, configs, size and sha256 of each file

The manifest is the commit marker: a folder without one is debris from an interrupted save and
is never loaded. A committed snapshot is never overwritten. Files are loaded only after their
checksum matches, with `torch.load(weights_only=True)`: nothing from storage is unpickled.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
from fsspec.core import url_to_fs

from mingpt.errors import MinGPTError

log = logging.getLogger(__name__)

FORMAT = "mingpt-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d{9})$")


class SnapshotError(MinGPTError):
    """A snapshot folder cannot be written, or a snapshot cannot be read or trusted."""


def snapshot_name(step: int) -> str:
    return f"step-{step:09d}"


@dataclass
class Snapshot:
    """A committed snapshot: its manifest, and the store it lives in."""

    store: "SnapshotStore"
    name: str
    manifest: dict

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def url(self) -> str:
        return self.store.url_of(self.name)

    def read(self, filename: str) -> bytes:
        """The bytes of one payload file, after checking its size and sha256 against the manifest."""
        entry = self.manifest["files"].get(filename)
        if entry is None:
            raise SnapshotError(f"snapshot {self.url} has no file {filename}")
        path = f"{self.store.path}/{self.name}/{filename}"
        try:
            data = self.store.fs.cat_file(path)
        except FileNotFoundError:
            raise SnapshotError(f"snapshot {self.url} is damaged: {filename} is missing") from None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise SnapshotError(
                f"snapshot {self.url} is damaged: {filename} has {len(data)} bytes and another checksum "
                f"than the {entry['bytes']} bytes its manifest records"
            )
        return data

    def load_tensors(self, filename: str, map_location: Any = "cpu") -> Any:
        """A verified `.pt` payload, loaded without unpickling (`weights_only=True`)."""
        data = self.read(filename)
        try:
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as e:  # UnpicklingError for anything but plain tensors and containers
            raise SnapshotError(
                f"refusing to load {filename} of snapshot {self.url}: it is not a plain tensor file "
                f"({type(e).__name__}); only weights_only data is ever loaded"
            ) from None

    def verify(self) -> None:
        """Check every payload file against the manifest; SnapshotError when one does not match."""
        for filename in self.manifest["files"]:
            self.read(filename)


class SnapshotStore:
    """The snapshots of one run, under `url` (a local path or fsspec URL)."""

    def __init__(self, url: str, keep: int = 3, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.keep = keep
        self.fs, self.path = url_to_fs(self.url, **(storage_options or {}))
        self.path = self.path.rstrip("/")

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def check_writable(self) -> None:
        """Fail now, not at the first save, when the folder cannot be created or written."""
        probe = f"{self.path}/.write-test-{uuid.uuid4().hex}"
        try:
            self.fs.makedirs(self.path, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except Exception as e:
            raise SnapshotError(
                f"cannot write snapshots to {self.url} ({type(e).__name__}: {e}); "
                "choose a writable snapshot.dir or fix its permissions"
            ) from None

    # -- listing -------------------------------------------------------------------------------

    def committed(self) -> list[Snapshot]:
        """Committed snapshots (those with a readable manifest), oldest first. Payloads unchecked."""
        self.fs.invalidate_cache(self.path)
        found = []
        for name in self._folder_names():
            manifest = self._read_manifest(name)
            if manifest is not None:
                found.append(Snapshot(self, name, manifest))
        return sorted(found, key=lambda s: s.step)

    def latest(self) -> Snapshot | None:
        """The newest committed snapshot whose files all verify; damaged newer ones are logged and skipped."""
        for snapshot in reversed(self.committed()):
            try:
                snapshot.verify()
                return snapshot
            except SnapshotError as e:
                log.warning("%s; falling back to the snapshot before it", e)
        return None

    def get(self, name: str) -> Snapshot:
        manifest = self._read_manifest(name)
        if manifest is None:
            raise SnapshotError(f"{self.url_of(name)} is not a committed snapshot (no readable {MANIFEST})")
        return Snapshot(self, name, manifest)

    def _folder_names(self) -> list[str]:
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)
        return sorted(name for name in names if _NAME.match(name))

    def _read_manifest(self, name: str) -> dict | None:
        try:
            manifest = json.loads(self.fs.cat_file(f"{self.path}/{name}/{MANIFEST}"))
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            log.warning("snapshot %s has a damaged manifest; ignoring it", self.url_of(name))
            return None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            log.warning("snapshot %s has a manifest of another format; ignoring it", self.url_of(name))
            return None
        return manifest

    # -- writing -------------------------------------------------------------------------------

    def save(self, step: int, tensors: dict[str, Any], files: dict[str, bytes], info: dict) -> Snapshot:
        """Commit a snapshot of `step`: each of `tensors` as NAME.pt, each of `files` as is, then the manifest.

        `tensors` must already be on the CPU. A committed snapshot of the same step is kept as it is.
        """
        name = snapshot_name(step)
        existing = self._read_manifest(name)
        if existing is not None:
            log.info("snapshot %s is already committed; keeping it", self.url_of(name))
            return Snapshot(self, name, existing)
        started = time.perf_counter()
        folder = f"{self.path}/{name}"
        if self.fs.exists(folder):  # debris of an interrupted save of this same step
            self.fs.rm(folder, recursive=True)
        self.fs.makedirs(folder, exist_ok=True)
        payload = {f"{key}.pt": _serialize(value) for key, value in tensors.items()} | files
        entries = {}
        for filename, data in payload.items():
            self.fs.pipe_file(f"{folder}/{filename}", data)
            entries[filename] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **info,
            "files": entries,
        }
        self.fs.pipe_file(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        total = sum(e["bytes"] for e in entries.values())
        log.info("snapshot %s committed (%.1f MB in %.2fs)", self.url_of(name), total / 1e6, time.perf_counter() - started)
        self._prune()
        return Snapshot(self, name, manifest)

    def _prune(self) -> None:
        """Keep the newest `keep` committed snapshots; remove debris older than the newest commit."""
        committed = self.committed()
        if not committed:
            return
        newest = committed[-1].step
        doomed = [s.name for s in committed[: -self.keep]]
        committed_names = {s.name for s in committed}
        doomed += [n for n in self._folder_names() if n not in committed_names and int(_NAME.match(n)[1]) < newest]
        for name in doomed:
            try:
                # Manifest first: a deletion cut short leaves debris, never a damaged commit.
                if self.fs.exists(f"{self.path}/{name}/{MANIFEST}"):
                    self.fs.rm_file(f"{self.path}/{name}/{MANIFEST}")
                self.fs.rm(f"{self.path}/{name}", recursive=True)
            except FileNotFoundError:
                pass


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()

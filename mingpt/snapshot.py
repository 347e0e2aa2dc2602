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
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mingpt.storage import explain_storage_error, is_local, open_fs, redact
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


def _step_of(name: str) -> int:
    return int(_NAME.match(name)[1])


@dataclass
class Snapshot:
    """A committed snapshot: its manifest, and the store it lives in."""

    store: "SnapshotStore"
    name: str
    manifest: dict
    _verified: dict[str, bytes] = field(default_factory=dict, repr=False)

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def url(self) -> str:
        return self.store.url_of(self.name)

    def read(self, filename: str) -> bytes:
        """The bytes of one payload file, after checking its size and sha256 against the manifest."""
        if filename in self._verified:  # read by verify() a moment ago; hand over, do not keep
            return self._verified.pop(filename)
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

    def verify(self, files: Sequence[str] | None = None) -> None:
        """Check the payload files (default: all) against the manifest; SnapshotError when one does not match.

        The checked bytes are kept for the next `read` of each file, so verifying and then
        loading reads the storage once; `forget` drops what will not be read."""
        for filename in files or self.manifest["files"]:
            self._verified[filename] = self.read(filename)

    def forget(self) -> None:
        """Drop bytes kept by `verify` that will not be read."""
        self._verified.clear()


class SnapshotStore:
    """The snapshots of one run, under `url` (a local path or fsspec URL)."""

    def __init__(self, url: str, keep: int = 3, storage_options: dict | None = None):
        self.url = redact(url.rstrip("/"))  # for messages; credentials never shown
        self.keep = keep
        try:
            self.fs, self.path = open_fs(url.rstrip("/"), storage_options)
        except MinGPTError as e:
            raise SnapshotError(f"{e}; fix snapshot.dir") from None
        self.path = self.path.rstrip("/")
        # Object stores have no folders; creating one there may create a bucket instead.
        self.local = is_local(self.fs)

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def check_writable(self) -> None:
        """Fail now, not at the first save, when the folder cannot be created or written."""
        probe = f"{self.path}/.write-test-{uuid.uuid4().hex}"
        try:
            if self.local:
                self.fs.makedirs(self.path, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except Exception as e:
            raise SnapshotError(f"cannot write snapshots to {self.url}: {explain_storage_error(e, self.local)}") from None

    # -- listing -------------------------------------------------------------------------------

    def committed(self) -> list[Snapshot]:
        """Committed snapshots (those with a readable manifest), oldest first. Payloads unchecked."""
        return self._scan()[0]

    def _scan(self) -> tuple[list[Snapshot], list[str]]:
        """Committed snapshots, oldest first, and the names of folders without a manifest (debris)."""
        committed, debris = [], []
        for name in self._folder_names():
            manifest = self._read_manifest(name)
            if manifest is None:
                debris.append(name)
            else:
                committed.append(Snapshot(self, name, manifest))
        return sorted(committed, key=lambda s: s.step), debris

    def latest(self, files: Sequence[str] | None = None) -> Snapshot | None:
        """The newest committed snapshot whose files (default: all) verify; damaged newer ones are logged
        and skipped."""
        for snapshot in reversed(self.committed()):
            try:
                snapshot.verify(files)
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
        self.fs.invalidate_cache(self.path)
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
        valid = (isinstance(manifest, dict) and manifest.get("format") == FORMAT
                 and manifest.get("version") == FORMAT_VERSION and manifest.get("step") == _step_of(name)
                 and isinstance(manifest.get("files"), dict))
        if not valid:
            log.warning("snapshot %s has a manifest of another format or version; ignoring it", self.url_of(name))
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
            try:
                Snapshot(self, name, existing).verify()
                log.info("snapshot %s is already committed; keeping it", self.url_of(name))
                return Snapshot(self, name, existing)
            except SnapshotError as e:  # never keep a damaged commit over good state
                log.warning("%s; replacing it", e)
                self._remove(name, f"{self.path}/{name}/{MANIFEST}")
        started = time.perf_counter()
        folder = f"{self.path}/{name}"
        if name in self._folder_names():  # debris of an interrupted save of this same step
            self.fs.rm(folder, recursive=True)
        if self.local:
            self.fs.makedirs(folder, exist_ok=True)
        entries = {}
        payload = {f"{key}.pt": value for key, value in tensors.items()} | files
        for filename, content in payload.items():
            # Streamed: serialised, hashed and written in one pass, never whole in memory.
            with self.fs.open(f"{folder}/{filename}", "wb") as f:
                out = _HashingWriter(f)
                out.write(content) if isinstance(content, bytes) else torch.save(content, out)
            entries[filename] = out.entry()
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **info,
            "files": entries,
        }
        with self.fs.open(f"{folder}/{MANIFEST}", "wb") as f:  # the commit: one small object, written whole
            f.write(json.dumps(manifest, indent=2).encode())
        total = sum(e["bytes"] for e in entries.values())
        log.info("snapshot %s committed (%.1f MB in %.2fs)", self.url_of(name), total / 1e6, time.perf_counter() - started)
        try:
            self._prune()
        except Exception as e:  # the snapshot is committed; old ones can go next time
            log.warning("could not remove old snapshots from %s: %s", self.url, explain_storage_error(e))
        return Snapshot(self, name, manifest)

    def _prune(self) -> None:
        """Keep the newest `keep` committed snapshots; remove debris older than the newest commit."""
        committed, debris = self._scan()
        if not committed:
            return
        newest = committed[-1].step
        for snapshot in committed[: -self.keep]:
            # Manifest first: a deletion cut short leaves debris, never a damaged commit.
            self._remove(snapshot.name, f"{self.path}/{snapshot.name}/{MANIFEST}")
        for name in debris:
            if _step_of(name) < newest:
                self._remove(name)

    def _remove(self, name: str, *first: str) -> None:
        try:
            for path in first:
                self.fs.rm_file(path)
            self.fs.rm(f"{self.path}/{name}", recursive=True)
        except FileNotFoundError:
            pass


class _HashingWriter:
    """A write-only file that passes bytes on and keeps their count and sha256."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> dict:
        return {"bytes": self.size, "sha256": self.sha.hexdigest()}


class SnapshotWriter:
    """Saves snapshots, in the background (`async_save`) or in the caller's thread.

    At most one save is in flight: a new one first waits for the previous. A failed save is
    logged and leaves no manifest, so it never looks committed; the next interval tries again.
    After `max_failures` failures in a row, `failed_too_often` turns true and `check` raises
    SnapshotError: the trainer then stops the job on every process together.
    """

    def __init__(self, store: SnapshotStore, async_save: bool = True, max_failures: int = 3):
        self.store = store
        self.async_save = async_save
        self.max_failures = max_failures
        self.failures = 0  # consecutive; 0 after a success
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None

    def save(self, step: int, tensors: dict[str, Any], files: dict[str, bytes], info: dict) -> None:
        """Save a snapshot of `step`; `tensors` must be CPU copies that nobody changes afterwards."""
        self.wait()
        if self.async_save:
            self._thread = threading.Thread(target=self._save, args=(step, tensors, files, info),
                                            name=f"snapshot-{step}", daemon=True)
            self._thread.start()
        else:
            self._save(step, tensors, files, info)

    def wait(self) -> None:
        """Block until no save is in flight."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def failed_too_often(self) -> bool:
        """True when the last `max_failures` saves all failed (as far as finished saves tell)."""
        return self.failures >= self.max_failures

    def check(self, final: bool = False) -> None:
        """SnapshotError when too many saves failed in a row, or (`final`) when the last save failed."""
        if self.failed_too_often or (final and self.failures):
            what = "the last snapshot" if final and not self.failed_too_often else f"{self.failures} snapshots in a row"
            raise SnapshotError(
                f"{what} could not be written to {self.store.url}; last error: {self.last_error}. Fix the "
                "storage, then run the same command to resume from the newest committed snapshot"
            )

    def _save(self, step, tensors, files, info) -> None:
        try:
            self.store.save(step, tensors, files, info)
            self.failures = 0
        except Exception as e:
            self.failures += 1
            self.last_error = explain_storage_error(e, self.store.local)
            log.error("SNAPSHOT FAILED at step %d (%d in a row, the job stops after %d): %s",
                      step, self.failures, self.max_failures, self.last_error)


def main(argv: list[str] | None = None) -> int:
    """`python -m mingpt.snapshot list|verify URL`: each snapshot's step, time, size and state."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m mingpt.snapshot", description=main.__doc__.split(": ", 1)[1])
    parser.add_argument("command", choices=["list", "verify"], help="list reads manifests; verify also checks every file")
    parser.add_argument("url", help="a snapshot folder: local path or s3://bucket/prefix")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(message)s")
    try:
        store = SnapshotStore(args.url)
        committed, debris = store._scan()
    except Exception as e:
        print(f"error: cannot read {args.url}: {explain_storage_error(e)}", file=sys.stderr)
        return 2
    rows = [(s.name, s) for s in committed] + [(name, None) for name in debris]
    damaged = 0
    print(f"{'snapshot':<16} {'step':>9}  {'created':<24} {'size':>10}  state")
    for name, snapshot in sorted(rows, key=lambda row: row[0]):
        if snapshot is None:
            size = sum(store.fs.du(f"{store.path}/{name}", total=False).values())
            print(f"{name:<16} {_step_of(name):>9}  {'-':<24} {size / 1e6:>8.1f}MB  debris (no manifest)")
            continue
        state = "committed"
        if args.command == "verify":
            try:
                snapshot.verify()
                snapshot.forget()
                state = "verified"
            except SnapshotError as e:
                damaged += 1
                state = f"damaged: {e}"
        size = sum(f["bytes"] for f in snapshot.manifest["files"].values())
        print(f"{name:<16} {snapshot.step:>9}  {snapshot.manifest.get('created', '-'):<24} {size / 1e6:>8.1f}MB  {state}")
    if not committed:
        print(f"no committed snapshot in {args.url}", file=sys.stderr)
    return 1 if damaged or not committed else 0


if __name__ == "__main__":
    raise SystemExit(main())

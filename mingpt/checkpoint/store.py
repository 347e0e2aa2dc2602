"""Snapshots of a run, in a local folder or any fsspec URL, one folder per snapshot: files, their hashes, and an opaque
info dict that the store's user fills and checks (docs/snapshots.md; mingpt.checkpoint.load, mingpt.checkpoint.sharded).

The manifest (mingpt.checkpoint.manifest) is the commit marker: a folder without one is debris from an interrupted save
and is never loaded. A committed snapshot is never overwritten. Files are loaded only after their checksum matches, with
`torch.load(weights_only=True)`: nothing from storage is unpickled."""

from __future__ import annotations

import io
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mingpt.errors import MinGPTError
from mingpt.jobenv import JobEnv
from mingpt.checkpoint.lease import RESTART, Commit, RunLease, job_identity
from mingpt.checkpoint.manifest import (
    FORMAT, FORMAT_VERSION, MANIFEST, HashingWriter, Untrusted, check_recorded, is_snapshot_name, manifest_problem,
    read_manifest, read_recorded, snapshot_name, step_of,
)
from mingpt.rundir import RunDir
from mingpt.storage import create_exclusive, explain_storage_error, open_exclusive, sync_folder

log = logging.getLogger(__name__)

STATE_DIR = "state"  # a sharded snapshot's shards, and DCP's index of them
INDEX = f"{STATE_DIR}/.metadata"  # DCP's index: every process of a sharded job reads it whole


class SnapshotError(MinGPTError):
    """A snapshot folder cannot be written, or a snapshot cannot be read or trusted."""


@dataclass
class Snapshot:
    """A committed snapshot: its (validated) manifest, and the store it lives in."""

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

    @property
    def sharded(self) -> bool:
        """Written by every process of an fsdp job (state/), not by one (model.pt, optimizer.pt)."""
        return INDEX in self.manifest["files"]

    def read(self, filename: str) -> bytes:
        """The bytes of one payload file, after checking its size and sha256 against the manifest."""
        if filename in self._verified:  # read by verify() a moment ago; hand over, do not keep
            return self._verified.pop(filename)
        return self._check(filename, keep=True)

    def load_tensors(self, filename: str, map_location: Any = "cpu") -> Any:
        """A verified `.pt` payload, loaded without unpickling (`weights_only=True`)."""
        import torch  # here, not at the top: the commands that list snapshots start without it

        data = self.read(filename)
        try:
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as e:  # UnpicklingError for anything but plain tensors and containers
            raise SnapshotError(
                f"refusing to load {filename} of snapshot {self.url}: it is not a plain tensor file "
                f"({type(e).__name__}); only weights_only data is ever loaded"
            ) from None

    def verify(self, files: Sequence[str] | None = None, keep: bool = True) -> None:
        """Check the payload files (default: all) against the manifest; SnapshotError when one does not match. With
        `keep`, the checked bytes wait for the next `read`, so storage is read once (`forget` drops them). Shards (not
        DCP's index) are never kept: the process that verifies them all reads only its own share."""
        for filename in files or self.manifest["files"]:
            shard = filename.startswith(f"{STATE_DIR}/") and filename != INDEX
            try:
                data = self._check(filename, keep and not shard)
            except SnapshotError:
                self.store._good.discard(self._key)
                raise
            if keep and not shard:
                self._verified[filename] = data
        problem = self.store.reads_back(self)
        if problem:
            self.store._good.discard(self._key)
            raise SnapshotError(f"snapshot {self.url} is damaged: {problem}")
        if files is None:
            self.store._good.add(self._key)

    @property
    def _key(self) -> tuple[str, str]:
        return self.name, json.dumps(self.manifest["files"], sort_keys=True)

    def _check(self, filename: str, keep: bool) -> bytes:
        """Check one file's size and sha256 against the manifest: its bytes where `keep`, else b""."""
        if filename not in self.manifest["files"]:
            raise SnapshotError(f"snapshot {self.url} has no file {filename}")
        entry = self.manifest["files"][filename]
        try:
            return read_recorded(self.store.fs, self._path(filename), filename, entry["bytes"], entry["sha256"], keep)
        except Untrusted as e:
            raise SnapshotError(f"snapshot {self.url} is damaged: {e}") from None

    def check_sizes(self) -> None:
        """A quick check without reading: every file is there, a regular file of its recorded size."""
        for filename, entry in self.manifest["files"].items():
            try:
                check_recorded(self.store.fs, self._path(filename), filename, entry["bytes"])
            except Untrusted as e:
                raise SnapshotError(f"snapshot {self.url} is damaged: {e}") from None

    def _path(self, filename: str) -> str:
        return f"{self.store.path}/{self.name}/{filename}"


SET_ASIDE = ".damaged-"  # a damaged commit of a step written anew is kept as step-NNNNNNNNN.damaged-WHEN


@dataclass
class Listing:
    """What a snapshot folder holds: commits (oldest first), damaged commits with a reason, debris."""

    committed: list[Snapshot]
    damaged: list[tuple[str, str]]
    debris: list[str]
    aside: list[str] = field(default_factory=list)  # damaged commits set aside as their step was written anew


class SnapshotStore:
    """The snapshots of one run, under `url` (a local path or fsspec URL)."""

    def __init__(self, run: RunDir | str, keep: int = 3, storage_options: dict | None = None,
                 expects: Callable[[dict], str | None] = lambda manifest: None,
                 reads_back: Callable[["Snapshot"], str | None] = lambda snapshot: None):
        if isinstance(run, str):
            try:
                run = RunDir(run, storage_options)
            except MinGPTError as e:
                raise SnapshotError(f"{e}; fix snapshot.dir") from None
        self.run, self.keep = run, keep
        self.expects = expects  # why a manifest's files and info do not make a snapshot its user can read
        self.reads_back = reads_back  # why files that match their checksums still cannot be read (a bad index)
        self.fs, self.path, self.url, self.local = run.fs, run.path, run.url, run.local
        self.lease: RunLease | None = None  # set by `claim`; saving then asks it whether this process may write
        self._good: set[tuple[str, str]] = set()  # snapshots verified or written by this process

    def url_of(self, name: str) -> str:
        return self.run.url_of(name)

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

    def claim(self, timeout_s: float, job: JobEnv, mode: str = RESTART) -> RunLease:
        """Become `job`'s one writer of this run (see mingpt.checkpoint.lease), renewing the claim in the background."""
        if job.run_id == "none" and job.nodes > 1:
            log.warning("torchrun was started without --rdzv-id: each node's agent then counts as a job of its "
                        "own for run ownership. Give every node the same --rdzv-id=NAME")
        lease = RunLease(self.run, timeout_s, job_identity(job), mode, job.launcher)
        try:
            lease.acquire(self._last_commit)
        except MinGPTError:
            raise
        except Exception as e:
            raise SnapshotError(f"cannot claim {self.url}: {explain_storage_error(e, self.local)}") from None
        try:
            lease.keep_alive()
        except BaseException:  # Ctrl-C right here: release, or another host would wait out the timeout
            lease.release()
            raise
        self.lease = lease
        return lease

    def refuse_the_other_mode(self, timeout_s: float, job: JobEnv, mode: str) -> None:
        """RunOwnedError where `job`'s id holds the run, alive, in the mode that is not `mode`."""
        try:
            RunLease(self.run, timeout_s, job_identity(job), mode).refuse_the_other_mode(self._last_commit)
        except MinGPTError:
            raise
        except Exception as e:
            raise SnapshotError(f"cannot read who holds {self.url}: {explain_storage_error(e, self.local)}") from None

    def _last_commit(self) -> Commit | None:
        committed = self.committed()
        return _as_commit(committed[-1].name, committed[-1].manifest) if committed else None

    def committed(self) -> list[Snapshot]:
        """Committed snapshots (those with a valid manifest), oldest first. Payloads unchecked."""
        return self.scan().committed

    def scan(self) -> Listing:
        listing = Listing([], [], [])
        for name in self._folder_names():
            if SET_ASIDE in name and is_snapshot_name(name.split(SET_ASIDE)[0]):
                listing.aside.append(name)
            elif not is_snapshot_name(name):
                listing.damaged.append((name, "not a snapshot name (step- and 9 digits)"))
            else:
                manifest, problem = self._read_manifest(name)
                if problem:
                    listing.damaged.append((name, problem))
                elif manifest is None:
                    listing.debris.append(name)
                else:
                    listing.committed.append(Snapshot(self, name, manifest))
        listing.committed.sort(key=lambda s: s.step)
        return listing

    def latest(self, files: Callable[[Snapshot], list[str]] | None = None) -> Snapshot | None:
        """The newest committed snapshot whose files (or those `files` names) verify; newer damaged ones are skipped."""
        listing = self.scan()
        for name, problem in listing.damaged:
            log.warning("snapshot %s is damaged (%s); ignoring it", self.url_of(name), problem)
        for name in listing.aside:
            log.info("%s is a damaged snapshot, set aside when its step was written anew: inspect or delete it",
                     self.url_of(name))
        for snapshot in reversed(listing.committed):
            try:
                snapshot.verify(files(snapshot) if files else None)
                return snapshot
            except SnapshotError as e:
                log.warning("%s; falling back to the snapshot before it", e)
        if listing.committed:  # a run that started over would be a surprise, and set them aside step by step
            names = ", ".join(s.name for s in listing.committed[-3:])
            raise SnapshotError(f"every snapshot in {self.url} is damaged ({names}, the lines above say how); nothing "
                                "is resumed or written: restore them, or give another snapshot.dir for a new run")
        return None

    def get(self, name: str) -> Snapshot:
        if not is_snapshot_name(name):
            raise SnapshotError(f"{self.url_of(name)} is not a snapshot: its name is not step- and 9 digits")
        manifest, problem = self._read_manifest(name)
        if problem:
            raise SnapshotError(f"snapshot {self.url_of(name)} is damaged: {problem}")
        if manifest is None:
            raise SnapshotError(f"{self.url_of(name)} is not a committed snapshot (it has no {MANIFEST})")
        return Snapshot(self, name, manifest)

    def _folder_names(self) -> list[str]:
        self.fs.invalidate_cache(self.path)
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        names = (entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)
        return sorted(name for name in names if name.startswith("step-"))

    def _read_manifest(self, name: str) -> tuple[dict | None, str | None]:
        """(manifest, None) for a valid one; (None, None) when there is none (debris); (None, why) when damaged."""
        try:
            manifest = read_manifest(self.fs, f"{self.path}/{name}/{MANIFEST}")
        except Untrusted as e:
            return None, str(e)
        except NotADirectoryError:
            return None, "not a folder"
        except OSError as e:  # a symbolic link loop, no permission, ...
            return None, f"unreadable ({e.strerror or type(e).__name__})"
        if manifest is None:
            return None, None
        problem = manifest_problem(manifest, step_of(name)) or self.expects(manifest)
        return (None, problem) if problem else (manifest, None)

    def save(self, step: int, tensors: dict[str, Any], files: dict[str, bytes], info: dict) -> Snapshot:
        """Commit a snapshot of `step`: each of `tensors` (on the CPU) as NAME.pt, each of `files` as is, then the
        manifest. A good commit of that step is kept, a damaged one replaced; nothing is written after a lost lease."""
        payload = {f"{key}.pt": value for key, value in tensors.items()} | files
        existing = self.begin(step)
        if existing is not None:
            return existing
        return self.commit(step, self.write(step, payload), info)

    def begin(self, step: int) -> Snapshot | None:
        """A good commit of `step` to keep; else None, once damaged commits and debris are gone and its folder made."""
        name = snapshot_name(step)
        self._fence()
        existing = self._replace_damaged_or_keep(name)
        if existing is None and self.local:
            self.fs.makedirs(f"{self.path}/{name}", exist_ok=True)
            sync_folder(self.fs, self.path)
        return existing

    def write(self, step: int, payload: dict[str, Any]) -> dict[str, dict]:
        """Write each payload file (bytes as is, else by torch.save) into `step`'s folder, streamed and hashed in one
        pass; their manifest entries. Exclusive: a writer that lost the run while frozen cannot overwrite them."""
        import torch

        entries = {}
        for filename, content in payload.items():
            self._fence()
            with open_exclusive(self.fs, f"{self.path}/{snapshot_name(step)}/{filename}") as f:
                out = HashingWriter(f)
                out.write(content) if isinstance(content, bytes) else torch.save(content, out)
            entries[filename] = out.entry()
        return entries

    def commit(self, step: int, entries: dict[str, dict], info: dict) -> Snapshot:
        """Publish the manifest of `step`, naming `entries` (every file written), then prune old snapshots."""
        name = snapshot_name(step)
        folder = f"{self.path}/{name}"
        if any(filename.startswith(f"{STATE_DIR}/") for filename in entries):
            sync_folder(self.fs, f"{folder}/{STATE_DIR}")
        sync_folder(self.fs, folder)  # payload bytes and names are on the disk before the manifest names them
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **info,
            **({"writer": self.lease.writer()} if self.lease else {}),
            "files": dict(sorted(entries.items())),
        }
        self._commit(name, json.dumps(manifest, indent=2).encode())
        snapshot = Snapshot(self, name, manifest)
        self._good.add(snapshot._key)
        total = sum(e["bytes"] for e in entries.values())
        log.info("snapshot %s committed (%.1f MB)", self.url_of(name), total / 1e6)
        try:
            self._prune(name)
        except Exception as e:  # the snapshot is committed; old ones can go next time
            log.warning("could not remove old snapshots from %s: %s", self.url, explain_storage_error(e, self.local))
        return snapshot

    def _replace_damaged_or_keep(self, name: str) -> Snapshot | None:
        """A good commit of this step, to keep; else None, once a damaged commit is set aside and debris removed."""
        manifest, problem = self._read_manifest(name)
        if manifest is not None:
            snapshot = Snapshot(self, name, manifest)
            if self._is_good(snapshot, thorough=True):
                self._fence(_as_commit(name, manifest))
                log.info("snapshot %s is already committed; keeping it", snapshot.url)
                return snapshot
            problem = "its files do not match its manifest"
        if problem:  # never keep a damaged commit over good state, nor lose what it holds
            aside = f"{name}{SET_ASIDE}{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
            log.warning("snapshot %s is damaged (%s); setting it aside as %s and writing this step anew",
                        self.url_of(name), problem, aside)
            self._set_aside(name, aside)
        elif name in self._folder_names():  # debris of an interrupted save of this same step
            self._remove(name)
        return None

    def _commit(self, name: str, manifest: bytes) -> None:
        """Publish the manifest with exclusive create: it appears whole, and never over another commit."""
        path = f"{self.path}/{name}/{MANIFEST}"
        self._fence()
        try:
            create_exclusive(self.fs, path, manifest)
        except FileExistsError:
            if self.fs.cat_file(path) == manifest:
                return  # our own PUT, retried after a cut connection
            theirs, _ = self._read_manifest(name)
            self._fence(_as_commit(name, theirs))  # another job's: LeaseLostError
            raise SnapshotError(f"{self.url_of(name)} was committed meanwhile by another writer; keeping it") from None

    def _fence(self, found: Commit | None = None) -> None:
        """LeaseLostError where the lease says this process may no longer write here (nor keep `found`)."""
        if self.lease is not None:
            self.lease.check(found)

    def _is_good(self, snapshot: Snapshot, thorough: bool) -> bool:
        """Whether `snapshot` loads: by checksums (`thorough`), else known good here or its files' sizes are right."""
        try:
            if thorough:
                snapshot.verify(keep=False)
            elif snapshot._key not in self._good:
                snapshot.check_sizes()
            return True
        except SnapshotError as e:
            log.warning("%s", e)
            return False

    def _prune(self, just_committed: str) -> None:
        """Keep the newest `keep` snapshots not known damaged, and anything newer (left for inspection); remove the
        rest, and debris older than the newest commit. The one just committed is never removed: a run ends with a
        verified snapshot. Older ones are checked by size: hashing them all per save costs more than the save."""
        listing = self.scan()
        if not listing.committed:
            return
        # (step, name, snapshot): damaged commits (no usable manifest) take part by their folder's step.
        entries = [(s.step, s.name, s) for s in listing.committed]
        entries += [(step_of(name), name, None) for name, _ in listing.damaged if is_snapshot_name(name)]
        good, older = 0, []
        for _, name, snapshot in sorted(entries, key=lambda entry: entry[0], reverse=True):
            if good >= self.keep:
                older.append(name)
            elif name == just_committed or (snapshot is not None and self._is_good(snapshot, thorough=False)):
                good += 1
        for name in older:
            if name != just_committed:
                # Manifest first: a deletion cut short leaves debris, never a damaged commit.
                self._remove(name, f"{self.path}/{name}/{MANIFEST}")
        newest = listing.committed[-1].step
        for name in listing.debris:
            if step_of(name) < newest:
                self._remove(name)

    def _set_aside(self, name: str, aside: str) -> None:
        """Move the folder `name` to `aside`: renamed on a local disk; copied, then removed, on object storage."""
        folder = f"{self.path}/{name}"
        if self.local:
            self.fs.mv(folder, f"{self.path}/{aside}", recursive=True)
            return
        for path in self.fs.find(folder):
            self.fs.copy(path, f"{self.path}/{aside}{path[len(folder):]}")
        self._remove(name, f"{folder}/{MANIFEST}")

    def _remove(self, name: str, *first: str) -> None:
        try:
            for path in first:
                self.fs.rm_file(path)
            self.fs.rm(f"{self.path}/{name}", recursive=True)
        except FileNotFoundError:
            pass


def _as_commit(name: str, manifest: dict | None) -> Commit:
    """A commit as the lease judges it; `manifest` None where it cannot be read (its writer is unknown)."""
    return Commit(name, step_of(name), manifest.get("writer") if manifest else None)

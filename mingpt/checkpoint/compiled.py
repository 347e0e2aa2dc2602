"""torch.compile's caches in the run folder, so that a worker on any machine compiles from them: `compile-cache/` holds
`<key>.<sha256 prefix>.zip` and, written last, `manifest.json` (key, file, bytes, sha256, writer). The key
(mingpt.training.compile_cache makes it) names what makes the caches valid. Only the lease holder writes, and only the
newest key's caches stay. Compiled caches are code, and loading them runs it: a blob is trusted only through a manifest
that names a writer (its lease), and only when its size and sha256 match."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from typing import Any, Callable

from mingpt.checkpoint.lease import RunLease
from mingpt.checkpoint.manifest import MANIFEST, Untrusted, is_count, is_sha256, read_manifest, read_recorded
from mingpt.rundir import RunDir
from mingpt.storage import explain_storage_error, open_exclusive, replace_atomically

log = logging.getLogger(__name__)

FORMAT = "mingpt-compile-cache"
FORMAT_VERSION = 1
MAX_BYTES = 1 << 30  # a manifest that claims more names no cache this project writes
_KEY = re.compile(r"^[0-9a-f]{32}$")
_BLOB = re.compile(r"^([0-9a-f]{32})\.[0-9a-f]{16}\.zip$")


class CompiledCaches:
    """The compile caches of one run folder: read the committed ones of a key, commit new ones."""

    def __init__(self, run: RunDir):
        self.run, self.fs = run, run.fs
        self.folder = run.compile_cache
        self.url = run.url_of(RunDir.COMPILE_CACHE)

    def read(self, key: str, say: Callable[..., None] = log.log) -> bytes | None:
        """The committed caches of `key` if size and sha256 match; else None, as `say(level, message, *args)` logs."""
        try:
            manifest = self._manifest()
            if manifest is None:
                log.debug("no compile caches in %s", self.url)
                return None
            if manifest["key"] != key:
                say(logging.INFO, "the compile caches in %s are for another torch, device, model or precision (key %s, "
                         "this job's %s): not loaded, left alone; compiling from scratch", self.url,
                         manifest["key"][:12], key[:12])
                return None
            return self._blob(manifest)
        except Untrusted as e:
            say(logging.WARNING, "the compile caches in %s are not loaded (%s); compiling from scratch", self.url, e)
        except Exception as e:
            say(logging.WARNING, "cannot read the compile caches in %s (%s); compiling from scratch", self.url,
                        explain_storage_error(e, self.run.local))
        return None

    def commit(self, key: str, blob: bytes, describes: dict, lease: RunLease) -> None:
        """Publish `blob` for `key`, then its manifest, each after the lease's fence; then remove every other blob."""
        sha = hashlib.sha256(blob).hexdigest()
        name = f"{key}.{sha[:16]}.zip"
        path = f"{self.folder}/{name}"
        lease.check()
        if self.run.local:
            self.fs.makedirs(self.folder, exist_ok=True)
        self._write(path, blob)
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "key": key, "file": name, "bytes": len(blob),
                    "sha256": sha, "describes": describes, "writer": lease.writer(),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        lease.check()
        replace_atomically(self.fs, f"{self.folder}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
        log.info("compile caches committed to %s (%.1f MB, key %s)", self.url, len(blob) / 1e6, key[:12])
        self._prune(keep=name, lease=lease)

    def _write(self, path: str, blob: bytes) -> None:
        """The blob under its name, which its content names: one already there is kept when it matches."""
        try:
            with open_exclusive(self.fs, path) as f:
                f.write(blob)
        except FileExistsError:
            if self.fs.cat_file(path) == blob:
                return
            self.fs.rm_file(path)  # a cut write of these same bytes: the manifest never named it
            with open_exclusive(self.fs, path) as f:
                f.write(blob)

    def _prune(self, keep: str, lease: RunLease) -> None:
        """Remove the blobs of older keys (and older blobs of this one): only the committed one stays."""
        try:
            self.fs.invalidate_cache(self.folder)
            for entry in self.fs.ls(self.folder, detail=False):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if _BLOB.match(name) and name != keep:
                    lease.check()
                    self.fs.rm_file(f"{self.folder}/{name}")
        except Exception as e:  # committed; older ones can go next time
            log.warning("could not remove old compile caches from %s: %s", self.url,
                        explain_storage_error(e, self.run.local))

    def _manifest(self) -> dict | None:
        self.fs.invalidate_cache(self.folder)  # an object store's listing may predate the last commit
        manifest = read_manifest(self.fs, f"{self.folder}/{MANIFEST}")
        problem = manifest_problem(manifest) if manifest is not None else None
        if problem:
            raise Untrusted(problem)
        return manifest

    def _blob(self, manifest: dict) -> bytes:
        name = manifest["file"]
        return read_recorded(self.fs, f"{self.folder}/{name}", name, manifest["bytes"], manifest["sha256"])


def manifest_problem(manifest: Any) -> str | None:
    """Why `manifest` is no commit of compile caches by a lease holder; None when it is one."""
    if not isinstance(manifest, dict):
        return "the manifest is not a JSON object"
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        return f"the manifest is not {FORMAT} version {FORMAT_VERSION}"
    key, name, size = manifest.get("key"), manifest.get("file"), manifest.get("bytes")
    if not (isinstance(key, str) and _KEY.match(key)):
        return "the manifest names no key"
    if not (isinstance(name, str) and _BLOB.match(name) and _BLOB.match(name)[1] == key):
        return "the manifest names a file that compile caches never are"
    if not (is_count(size) and 0 < size <= MAX_BYTES):
        return "the manifest's size is not a count of bytes"
    if not is_sha256(manifest.get("sha256")):
        return "the manifest records no sha256"
    writer = manifest.get("writer")
    if not (isinstance(writer, dict) and isinstance(writer.get("job"), str)):
        return "the manifest names no writer holding the run's lease"
    return None

"""Prepared data in an object store (data.prepared_dir=s3://...): prepared once, by the node that claims it first, and
copied by every other node into a local folder that it memory-maps (the layout: docs/data.md). The claim is
mingpt.claim's: one node prepares, and the others wait for meta.json, written last, taking the claim over from a holder
that released it, ended on their machine, or whose beat stood still for CLAIM_TIMEOUT_S on their own clock. A copy
checks each file's sha256 against meta.json in a scratch folder before renaming it into place, so a damaged upload, or
one replaced during the copy, is never used."""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from mingpt.claim import Claim, Files, GenerationalClaim, ended_here, pids, same_machine, stood_still
from mingpt.data.prepared import FORMAT, FORMAT_VERSION, MAX_META_BYTES, META_FILE, TOKEN_FILES, file_sha256, parse_meta
from mingpt.errors import DataError, check_stopped
from mingpt.storage import (create_exclusive, explain_storage_error, is_local, open_fs, parse_json, read_head,
                            redact, replace_atomically)

log = logging.getLogger(__name__)

CLAIMS = "claim"  # the folder of the claim's generations
BEAT_S = 5.0  # how often the preparing node advances its claim's beat
CLAIM_TIMEOUT_S = 120.0  # a claim unchanged this long, on the waiter's clock, is a dead node's
POLL_S = 1.0  # how often a waiting node looks again
CHUNK_BYTES = 16 << 20  # one ranged read
PARALLEL_READS = 16  # ranged reads in flight: memory stays under PARALLEL_READS * CHUNK_BYTES


class RemoteFolder:
    """A prepared folder at an fsspec URL: its description, its claim, and copies to and from it."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.path = open_fs(url)

    def _join(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def meta(self) -> dict | None:
        """The published description; None where none (complete) is, or it is of an older version (prepared again, as
        a stale local folder is). DataError for a damaged one, or a newer version's: not this version's to replace."""
        try:
            text = read_head(self.fs, self._join(META_FILE), MAX_META_BYTES).decode("utf-8", "replace")
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._error(e, "read") from None
        try:
            return parse_meta(text, f"{redact(self.url)}/{META_FILE}", redact(self.url))
        except DataError as e:
            version = _version(text)
            if version is not None and version < FORMAT_VERSION:
                log.info("%s/%s is of the older format version %d; preparing it again", redact(self.url), META_FILE,
                         version)
                return None
            if version is not None and version > FORMAT_VERSION:
                raise DataError(f"{e} (it is of version {version}, newer than this mingpt-elastic's "
                                f"{FORMAT_VERSION}: upgrade it)") from None
            raise  # not a description of ours, or a damaged one: not this node's to replace

    def claim(self, published: Callable[[], bool]) -> GenerationalClaim | None:
        """This process's renewed claim, waiting while a live node holds it; None once `published()`."""
        gone = None
        while not published():
            claim = self.try_claim(gone)
            if claim is not None:
                return claim
            gone = self.wait_for_holder(published)
        return None

    def try_claim(self, gone: Claim | None = None) -> GenerationalClaim | None:
        """This process's claim, renewed in the background until released; None while another node holds it. Taken over
        from a holder that released it, or from `gone` (found dead by `wait_for_holder`) if unchanged since."""
        claims = self._claims()
        try:
            claim = claims.take(lambda holder: bool(holder.record.get("released")) or holder == gone)
        except Exception as e:
            raise self._error(e, "claim") from None
        if claim is None:
            return None
        claims.keep_alive(BEAT_S, lambda newer: log.warning(
            "another node took over the claim of %s; preparing on: the data is the same", redact(self.url)))
        return claims

    def wait_for_holder(self, published: Callable[[], bool]) -> Claim | None:
        """Wait while the node holding the claim lives and `published()` is false. The holder once found dead (see the
        module docstring); None when it is worth looking again (published, released, or the claim changed hands)."""
        claims, said = self._claims(), float("-inf")
        newest = lambda: self._newest(claims)

        def done() -> bool:
            check_stopped()
            return published()

        while not done():
            holder = newest()
            if holder is None or holder.record.get("released"):
                return None
            if ended_here(holder.record):
                return self._dead(holder)
            if time.monotonic() - said >= 30:
                log.info("waiting for %s to prepare %s and publish it", _describe(holder.record), redact(self.url))
                said = time.monotonic()
            if stood_still(newest, holder, CLAIM_TIMEOUT_S, POLL_S, until=done):
                return self._dead(holder)
        return None

    def _newest(self, claims: GenerationalClaim) -> Claim | None:
        try:
            return claims.newest()
        except Exception as e:
            raise self._error(e, "read") from None

    def _dead(self, holder: Claim) -> Claim:
        """`holder`, found dead: to take over, unless it runs on this machine after all (stopped or hung)."""
        record = holder.record
        if same_machine(record) and not ended_here(record):  # it holds this machine's lock: taking over would hang
            raise DataError(f"process {pids(record)} on this machine claimed {redact(self.url)} and has not "
                            f"advanced its claim for {CLAIM_TIMEOUT_S:.0f} s, but runs (stopped or hung?): "
                            "resume it (kill -CONT) or end it, then run again")
        log.warning("the node that claimed %s (%s) stopped; preparing it here instead", redact(self.url),
                    _describe(record))
        return holder

    def _claims(self) -> GenerationalClaim:
        files = Files(self.fs, is_local(self.fs), create_exclusive, replace_atomically, redact)
        return GenerationalClaim(files, self._join(CLAIMS), redact(self.url))

    def upload(self, folder: Path, meta: dict) -> None:
        """Publish `folder`, its description removed first and written last: no reader mixes new files with old."""
        started = time.perf_counter()
        try:
            self.fs.rm_file(self._join(META_FILE))
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._error(e, "write") from None
        try:
            for name in TOKEN_FILES:
                self.fs.put_file(str(folder / name), self._join(name))
            replace_atomically(self.fs, self._join(META_FILE), json.dumps(meta, indent=2).encode())
        except Exception as e:
            raise self._error(e, "write") from None
        size = sum((folder / name).stat().st_size for name in TOKEN_FILES)
        log.info("published %s: %.1f MB in %.1fs", redact(self.url), size / 1e6, time.perf_counter() - started)

    def download(self, meta: dict, folder: Path) -> None:
        """Copy the published files into the new `folder`, each checked against `meta`'s sha256, `meta` last."""
        started, size = time.perf_counter(), 0
        self.fs.invalidate_cache()  # sizes as they are now, not as listed earlier in this process
        for name in TOKEN_FILES:
            path, target = self._join(name), folder / name
            try:
                size += _ranged_copy(self.fs, path, target)
            except FileNotFoundError:
                raise DataError(f"{redact(self.url)}/{name} is missing, but {META_FILE} names it: the published "
                                f"data is damaged; delete {redact(self.url)} and prepare it again") from None
            except (DataError, KeyboardInterrupt):
                raise
            except Exception as e:
                raise self._error(e, "read") from None
            if file_sha256(target) != meta["sha256"][name]:
                raise DataError(f"{redact(self.url)}/{name} is not what {META_FILE} describes (sha256): it is "
                                f"damaged, or being replaced by another preparation; run again, or delete "
                                f"{redact(self.url)} and prepare it again")
        (folder / META_FILE).write_text(json.dumps(meta, indent=2))
        seconds = time.perf_counter() - started
        log.info("copied %s: %.1f MB in %.1fs (%.0f MB/s)", redact(self.url), size / 1e6, seconds,
                 size / 1e6 / max(seconds, 1e-9))

    def _error(self, e: Exception, doing: str) -> DataError:
        return DataError(f"cannot {doing} data.prepared_dir={redact(self.url)}: "
                         f"{explain_storage_error(e, setting='data.prepared_dir')}")


@contextmanager
def _open_for_pwrite(path: Path, size: int) -> Iterator[int]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
        yield fd
    finally:
        os.close(fd)


def _ranged_copy(fs, path: str, target: Path) -> int:
    """Copy the object `path` to the new local file `target` with PARALLEL_READS ranged reads in flight; its size."""
    size = fs.size(path)

    def fetch(start: int) -> None:
        end = min(start + CHUNK_BYTES, size)
        data = fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise DataError(f"{redact(path)} changed while it was copied (a read of {end - start} bytes gave "
                            f"{len(data)}); run again")
        os.pwrite(fd, data, start)

    with _open_for_pwrite(target, size) as fd:
        pool = ThreadPoolExecutor(PARALLEL_READS, thread_name_prefix="prepared-data-copy")
        try:
            for done in [pool.submit(fetch, start) for start in range(0, size, CHUNK_BYTES)]:
                done.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        os.fsync(fd)
    return size


def _version(text: str) -> int | None:
    """The format version a description of ours says it is, or None where it is not one of ours."""
    try:
        meta = parse_json(text)
    except ValueError:
        return None
    version = meta.get("version") if isinstance(meta, dict) and meta.get("format") == FORMAT else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def _describe(holder: dict) -> str:
    return f"host {holder.get('host', '?')}, pid {pids(holder) or '?'}"

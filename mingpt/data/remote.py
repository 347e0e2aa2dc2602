"""Prepared data in an object store (data.prepared_dir=s3://...): prepared once, by the node that claims
it first, and copied by every other node into a local folder that it memory-maps.

    s3://bucket/data/web-bpe/
        claim.json                          while a node prepares: which node, and a beat it advances
        tokenizer.json, train.bin, val.bin  as in a local prepared folder (mingpt.data.prepared)
        meta.json                           written last: the folder is published once it is there

The claim is an exclusive create (If-None-Match: *), so two nodes do not prepare at once. A node that
finds a claim waits for the meta.json. A claim whose beat stops changing for CLAIM_TIMEOUT_S, watched
on the waiter's own clock (clocks of two machines are never compared), belongs to a node that died: the
waiter removes it and claims the folder itself. A claim of this machine whose process has ended (by pid
and start time: a reused pid does not count) is taken over at once. (Claim, beat and liveness are
mingpt.claim's, which the run's lease shares.)

A copy reads each file with parallel ranged reads into a scratch folder beside the local copy, checks
each sha256 against meta.json, and only then renames the folder into place, so a damaged upload, or
one replaced halfway through the copy, is never used.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from mingpt.claim import Beat, ended_here, holder as holder_record, pids, same_machine
from mingpt.data.prepared import FORMAT, FORMAT_VERSION, META_FILE, TOKEN_FILES, file_sha256, parse_meta
from mingpt.errors import DataError, check_stopped
from mingpt.storage import create_exclusive, explain_storage_error, open_fs, redact, replace_atomically

log = logging.getLogger(__name__)

CLAIM_FILE = "claim.json"
BEAT_S = 5.0  # how often the preparing node advances its claim's beat
CLAIM_TIMEOUT_S = 120.0  # a claim unchanged this long, on the waiter's clock, is a dead node's
MAX_CLAIM_BYTES = 64 * 1024
MAX_META_BYTES = 64 << 20  # a description lists the sources: large for a corpus of many files, never this
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
        """The published description; None where nothing (complete) is published yet, or what is published
        is of an older format version (prepared again and replaced, as a stale local folder is). DataError
        for the description of a newer version, which is not this version's to replace."""
        try:
            text = self.fs.cat_file(self._join(META_FILE), start=0, end=MAX_META_BYTES).decode("utf-8", "replace")
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._error(e, "read") from None
        try:
            return parse_meta(text, f"{redact(self.url)}/{META_FILE}", redact(self.url))
        except DataError as e:
            version = _version(text)
            if version is None or version > FORMAT_VERSION:
                raise DataError(f"{e} (it is of version {version}, newer than this mingpt-elastic's "
                                f"{FORMAT_VERSION}: upgrade it)" if version else str(e)) from None
            log.info("%s/%s is of the older format version %d; preparing it again", redact(self.url), META_FILE,
                     version)
            return None

    # -- the claim -------------------------------------------------------------------------------

    def try_claim(self) -> "_Claim | None":
        """The claim, when this process got it; None when another node holds it."""
        claim = _Claim(self)
        try:
            create_exclusive(self.fs, claim.path, claim.content())
        except FileExistsError:
            return None
        except Exception as e:
            raise self._error(e, "claim") from None
        claim.start_beating()
        return claim

    def holder(self) -> dict | None:
        """What the claim says (host, pid, beat), or None when there is no claim. A damaged claim reads
        as an empty holder, which is watched like any other."""
        try:  # a claim is a small JSON object: more than MAX_CLAIM_BYTES is not one (and is not read whole)
            raw = self.fs.cat_file(self._join(CLAIM_FILE), start=0, end=MAX_CLAIM_BYTES + 1)
            data = json.loads(raw) if len(raw) <= MAX_CLAIM_BYTES else {}
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        except Exception as e:
            raise self._error(e, "read") from None
        return data if isinstance(data, dict) else {}

    def wait_for_holder(self, holder: dict, current: Callable[[], bool]) -> None:
        """Wait until the node holding the claim publishes (`current()` is true), releases, or is found
        dead (its claim removed here). Returns when it is worth looking again."""
        watched, since, said = holder, time.monotonic(), 0.0
        while True:
            check_stopped()
            if current():
                return
            now = self.holder()
            if now is None:
                return  # released: claim it, or find it published
            if now != watched:
                watched, since = now, time.monotonic()
            elif ended_here(now) or time.monotonic() - since >= CLAIM_TIMEOUT_S:
                if same_machine(now) and not ended_here(now):  # it holds this machine's lock: taking over would hang
                    raise DataError(f"process {pids(now)} on this machine claimed {redact(self.url)} and has not "
                                    f"advanced its claim for {CLAIM_TIMEOUT_S:.0f} s, but runs (stopped or hung?): "
                                    "resume it (kill -CONT) or end it, then run again")
                log.warning("the node that claimed %s (%s) stopped; preparing it here instead", redact(self.url),
                            _describe(now))
                self._remove_claim(now)
                return
            if time.monotonic() - said >= 30:
                log.info("waiting for %s to prepare %s and publish it", _describe(now), redact(self.url))
                said = time.monotonic()
            time.sleep(POLL_S)

    def _remove_claim(self, expected: dict) -> None:
        """Remove the claim if it still says `expected` (a claim made meanwhile by another waiter stays)."""
        if self.holder() == expected:
            try:
                self.fs.rm_file(self._join(CLAIM_FILE))
            except FileNotFoundError:
                pass

    # -- copies ----------------------------------------------------------------------------------

    def upload(self, folder: Path, meta: dict) -> None:
        """Publish the prepared `folder`: its description is removed first and written last, so that no
        reader takes the new files for the old ones or the other way round."""
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
        """Copy the published files into the new `folder`, each checked against `meta`'s sha256, and
        `meta` itself last. DataError when a file is not what `meta` describes."""
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


class _Claim:
    """This process's claim of a remote folder: a thread advances its beat until it is released."""

    def __init__(self, folder: RemoteFolder):
        self.folder, self.path = folder, folder._join(CLAIM_FILE)
        self.mine = {**holder_record([os.getpid()]), "started": time.time(), "beat": 0}
        self.beating = Beat(self._beat, BEAT_S, "prepared-data-claim")

    def content(self) -> bytes:
        return json.dumps(self.mine).encode()

    def start_beating(self) -> None:
        self.beating.start()

    def _beat(self) -> bool:
        try:
            if self.folder.holder() != self.mine:
                log.warning("another node took over the claim of %s; preparing on: the data is the same",
                            redact(self.folder.url))
                return False
            beat = {**self.mine, "beat": self.mine["beat"] + 1}
            replace_atomically(self.folder.fs, self.path, json.dumps(beat).encode())
            self.mine = beat  # only once written: `release` removes the claim that is there
        except Exception as e:  # a network hiccup: the next beat tries again; waiters allow for some
            log.warning("could not renew the claim of %s: %s", redact(self.folder.url), redact(e))
        return True

    def release(self) -> None:
        self.beating.stop()
        try:
            self.folder._remove_claim(self.mine)
        except Exception as e:  # waiters take over a claim that stopped beating
            log.warning("could not remove the claim of %s: %s", redact(self.folder.url), redact(e))

    def __enter__(self) -> "_Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def _open_for_pwrite(path: Path, size: int) -> Iterator[int]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
        yield fd
    finally:
        os.close(fd)


def _ranged_copy(fs, path: str, target: Path) -> int:
    """Copy the object `path` to the new local file `target` with PARALLEL_READS ranged reads in flight;
    its size."""
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
        meta = json.loads(text)
    except ValueError:
        return None
    version = meta.get("version") if isinstance(meta, dict) and meta.get("format") == FORMAT else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def _describe(holder: dict) -> str:
    return f"host {holder.get('host', '?')}, pid {pids(holder) or '?'}" if holder else "a node (claim unreadable)"

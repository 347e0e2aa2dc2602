"""Where prepared data is written before it is a prepared folder, and how it becomes one. A preparation (or copy)
writes into a scratch folder beside it named by this machine and process, so that a later start here finds what a
stopped one left (`leftovers`). A finished one is renamed into place (`publish`): a reader never sees a half-written
folder. It replaces only prepared data or an empty folder, never anything else (`check_replaceable`)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from mingpt.data.prepared import FORMAT, MAX_META_BYTES, META_FILE, TOKEN_FILES, DamagedData, read_meta
from mingpt.errors import DataError
from mingpt.storage import parse_json, read_regular_file

log = logging.getLogger(__name__)


def scratch(out: Path, kind: str) -> Path:
    """A new name for a scratch folder next to `out`: it names this machine and process."""
    return out.parent / f".{out.name}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", socket.gethostname())


def leftovers(folder: Path) -> list[Path]:
    """The scratch folders this machine's stopped or killed preparations left in `folder` (not another machine's, nor
    host "node1-b"'s for host "node1"). Looked at only under the machine lock, when none of them runs."""
    ours = re.compile(rf"^\..+\.(tmp|stale)-{re.escape(_host())}-\d+-[0-9a-f]{{8}}$")
    return sorted(path for path in folder.iterdir() if ours.match(path.name))


def remove_leftovers(folder: Path, keep: Path | None = None) -> None:
    """Remove the `leftovers` in `folder`, but `keep`."""
    for path in leftovers(folder):
        if path != keep:
            log.info("removing %s, left by a preparation that was stopped", path)
            _remove(path)


def _remove(path: Path) -> None:
    """Remove a scratch folder, or the link to a folder that an --out named (rmtree refuses links)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def matches(directory: Path, wanted: dict) -> bool:
    """Whether `directory` holds prepared data whose meta.json says what `wanted` says; DamagedData where it is ours
    but contradicts itself (tampering, a disk fault: rebuilding in silence would hide that, and cost a preparation)."""
    try:
        meta = read_meta(directory)
    except DamagedData:
        raise
    except DataError:  # none, or of an older version: prepared anew
        return False
    return all(meta.get(key) == value for key, value in wanted.items())


def check_replaceable(out: Path) -> None:
    """DataError unless `out` is new, empty or prepared data: preparing over a user's files would delete them."""
    try:
        os.stat(out)
    except FileNotFoundError:
        return
    except OSError as e:  # ELOOP: a loop of symbolic links at it or above it; ENOTDIR: a file above it
        raise DataError(f"cannot use {out} as the prepared-data folder: {e.strerror}; choose another folder "
                        "(mingpt-prepare --out, data.prepared_dir or data.local_copy)") from None
    if not out.is_dir():
        raise DataError(f"the prepared-data folder {out} is a file; choose an empty or new folder "
                        "(mingpt-prepare --out, or data.prepared_dir for training)")
    held = {entry.name for entry in out.iterdir()}
    if not held:
        return
    try:
        meta = parse_json(read_regular_file(out / META_FILE, MAX_META_BYTES))
    except (OSError, ValueError):  # missing, a link or a FIFO, not JSON
        meta = None
    others = sorted(held - {META_FILE, *TOKEN_FILES})
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or others:  # any version of ours may be replaced
        what = f"files that are not prepared data ({', '.join(others[:3])})" if others and isinstance(meta, dict) \
            else f"no mingpt prepared data (no valid {META_FILE})"
        raise DataError(f"{out} is not empty and holds {what}; preparing there would replace its files, so choose "
                        "an empty or new folder (mingpt-prepare --out, or data.prepared_dir for training)")


def publish(tmp: Path, out: Path, meta: dict) -> None:
    """Move the finished `tmp` (of `meta`) to `out`, replacing stale data, never a twin nor other files."""
    for _ in range(3):
        try:
            tmp.rename(out)
            return
        except OSError:  # `out` exists and is not empty
            if matches(out, {"fingerprint": meta["fingerprint"]}):
                return  # another process prepared the very same tokens first; theirs are as good
            check_replaceable(out)  # again: files may have appeared since `prepare` checked
            stale = scratch(out, "stale")
            try:
                out.rename(stale)
            except FileNotFoundError:
                continue  # someone else moved it meanwhile; try again
            _remove(stale)
    raise DataError(f"could not replace {out}; is another process preparing different data there?")

"""Files in a folder that every user of the machine can write (/dev/shm): a folder is used only if it is
this user's alone (not a link, mode 0700), and a file only if it is a regular file of this user's, opened
without following links and never waited on (a FIFO); a buffer's memory is reserved when it is made."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_folder(path: Path) -> bool:
    """Whether `path` is a folder (not a link) of this user's alone: what the tier may read and write."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and found.st_mode & 0o077 == 0


def own_file(path: Path) -> os.stat_result:
    """lstat of `path`; OSError unless it is a regular file of this user's."""
    found = os.lstat(path)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
        raise OSError(f"not a regular file of this user's (mode {stat.filemode(found.st_mode)}, owner {found.st_uid})")
    return found


def read_own_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of this user's, at most `limit`; never through a link, never waiting on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid() or found.st_size > limit:
            raise OSError(f"not a regular file of this user's of at most {limit} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit)
    finally:
        os.close(fd)


def allocate(path: Path, nbytes: int) -> None:
    """Make `path` a regular file of `nbytes` whose memory is reserved now: a sparse file in a full /dev/shm
    would kill the process (SIGBUS) at the first page that finds no room, instead of failing here."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
            raise OSError(f"{path} is not a regular file of this user's")
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)

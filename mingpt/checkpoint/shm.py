"""Files in a folder that every user of the machine can write (/dev/shm, /tmp): a folder is used only if it is this
user's alone (not a link, mode 0700), a file only if it is a regular file of this user's, opened without following links
and never waited on (mingpt.storage checks both); a buffer's memory is reserved when it is made. A process's own folder
is named after it, so the next one made on the machine removes it once it has ended, however (SIGKILL, OOM killer)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from mingpt.claim import process_alive, start_time
from mingpt.errors import ConfigError
from mingpt.storage import open_own_file, others_may_replace_in, private_folder

log = logging.getLogger(__name__)


def process_folder(kind: str) -> Path:
    """A new folder of this user's alone in TMPDIR named after this process; folders of ended ones go first."""
    check_temporary_folder()
    remove_ended(kind)
    pid = os.getpid()
    return Path(tempfile.mkdtemp(prefix=f"mingpt-{kind}-{pid}-{start_time(pid)}-"))  # 0700


def check_temporary_folder() -> None:
    """Refuse a temporary folder (TMPDIR) in which another user could replace this process's folders."""
    root = tempfile.gettempdir()
    if problem := others_may_replace_in(root):
        raise ConfigError(f"the temporary folder {root} (TMPDIR) is not safe: {problem}, so another user could "
                          "replace mingpt's files there; point TMPDIR at a folder of your own, or at one with the "
                          "sticky bit (as /tmp has)")


AGENT_FOLDERS = ("torchrun", "progress")  # mingpt-torchrun's process folders: its logs, its watchdog's


def remove_ended_agents_folders() -> None:
    """Remove the folders of this user's agents that have ended (a SIGKILLed agent's stay until then)."""
    for kind in AGENT_FOLDERS:
        remove_ended(kind)


def remove_ended(kind: str, root: str | None = None) -> None:
    """Remove this user's `process_folder`s of `kind` whose process has ended (another user's are never touched)."""
    for folder in Path(root or tempfile.gettempdir()).glob(f"mingpt-{kind}-*"):
        parts = folder.name.split("-")  # mingpt, kind, pid, start, random
        if len(parts) == 5 and parts[2].isdigit() and parts[3].isdigit() and private_folder(folder) \
                and not process_alive(int(parts[2]), int(parts[3])):
            log.info("removing %s: the process that made it has ended", folder)
            shutil.rmtree(folder, ignore_errors=True)


def allocate(path: Path, nbytes: int) -> None:
    """Make `path` a regular file of `nbytes` whose memory is reserved now: a sparse file in a full /dev/shm
    would kill the process (SIGBUS) at the first page that finds no room, instead of failing here."""
    fd = open_own_file(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


def available_memory() -> int:
    """Bytes this machine can still give its processes (MemAvailable): files in /dev/shm take from it too."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))

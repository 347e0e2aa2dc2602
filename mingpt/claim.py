"""Holding something among processes that may die, on machines whose clocks disagree: the claim behind the run's
lease (mingpt.checkpoint.lease) and the prepared data's (mingpt.data.remote), and the lock of a folder on one machine.

A claim is a folder of numbered generations, each created exclusively (O_EXCL, a conditional PUT on S3), so of
claimants at once exactly one wins; the holder rewrites its own at a `Beat`, and a newer one fences it off
(`overtaken`). A holder elsewhere is gone once its claim `stood_still` for its timeout on the claimant's own monotonic
clock (no two machines' clocks are compared); one here once none of its processes (pid and start time) runs."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fsspec.spec import AbstractFileSystem

log = logging.getLogger(__name__)

# A claim is a small JSON object: anything larger in a claim folder is not one, and is never read whole.
MAX_CLAIM_BYTES = 64 * 1024
_GENERATION = re.compile(r"^gen-(\d{9})\.json$")
_ATTEMPTS = 10  # how often claimants that keep losing the race for the next generation look again

Write = Callable[[AbstractFileSystem, str, bytes], None]


def holder(pids: list[int]) -> dict:
    """What a claim says of its holder: this machine (host, boot) and its processes (pid, start time)."""
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pids": [[pid, start_time(pid)] for pid in pids]}


def ended_here(record: dict) -> bool:
    """Whether the holder a claim names ran on this machine and none of its processes runs any more."""
    return same_machine(record) and not any(process_alive(*p) for p in processes_of(record))


def same_machine(record: dict) -> bool:
    return record.get("host") == socket.gethostname() and record.get("boot_id") == boot_id()


def processes_of(record: dict) -> list[tuple[int, int]]:
    """The (pid, start time) pairs a claim names; whatever else its "pids" holds is ignored."""
    found = []
    for entry in record.get("pids") if isinstance(record.get("pids"), list) else []:
        if isinstance(entry, list) and len(entry) == 2 and all(type(n) is int for n in entry):
            found.append((entry[0], entry[1]))
    return found


def pids(record: dict) -> str:
    """The pids a claim names, for a message ("" where it names none)."""
    return ", ".join(str(pid) for pid, _ in processes_of(record))


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int:
    """The start time of a process (clock ticks since boot), so that a reused pid is not taken for it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: int, start: int = 0) -> bool:
    """Whether process `pid` of this machine runs (and, given its start time, is still that process)."""
    if pid <= 0:
        return False  # kill(0) or kill(-n) would ask about process groups, not this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # exists, owned by someone else; or we cannot tell: assume alive
    return not start or start_time(pid) == start


def stood_still(state: Callable[[], object], seen: object, timeout: float, poll: float | None = None,
                until: Callable[[], bool] = lambda: False) -> bool:
    """Watch `state()` (a claim, say) for `timeout` seconds of this process's monotonic clock: True when it stayed
    `seen` throughout (its holder is gone); False as soon as it differs (its holder is alive) or `until()` is true."""
    deadline = time.monotonic() + timeout
    while True:
        if until() or state() != seen:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(poll or min(1.0, timeout / 8))


class Beat:
    """Call `renew` every `interval` s in a thread until `stop` or it returns False; `renew` handles its errors."""

    def __init__(self, renew: Callable[[], bool | None], interval: float, name: str):
        self.renew, self.interval = renew, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.renew() is False:
                return


@dataclass(frozen=True)
class Claim:
    """One generation of a claim: its number, and what its file says."""

    generation: int
    record: dict


@dataclass(frozen=True)
class Files:
    """What a claim needs of its storage, handed in by each policy (this module imports nothing of mingpt.storage)."""

    fs: AbstractFileSystem
    local: bool  # this machine's disk: folders must exist before their files, and links are never followed
    create: Write  # whole and exclusive: FileExistsError where the name is taken, so of two writers one wins
    replace: Write  # whole, over what is there: a reader sees the old bytes or the new
    redact: Callable[[object], str]  # a message without the credentials a URL may carry


class GenerationalClaim:
    """The claims on one thing: numbered generations in `folder`, of which this process holds at most one
    (`held`). `name` stands for the thing in messages; `valid` tells a policy's records from other JSON."""

    def __init__(self, files: Files, folder: str, name: str, valid: Callable[[dict], bool] = lambda record: True):
        self.files, self.fs, self.folder, self.name, self.valid = files, files.fs, folder.rstrip("/"), name, valid
        self.held: Claim | None = None
        self.lost = False  # taken over (or, the policy says, otherwise lost): this process writes nothing more
        self._beat: Beat | None = None

    def newest(self) -> Claim | None:
        """The newest valid claim (held, silent or released), or None where there is none. Entries of the folder
        that are not claims (a FIFO, a folder, a link, garbage, another policy's JSON) are skipped, never waited on."""
        for generation in reversed(self._generations()):
            record = self.read(generation)
            if record is not None:
                return Claim(generation, record)
        return None

    def read(self, generation: int) -> dict | None:
        """The claim of `generation`, or None where there is none or the entry is not a valid claim."""
        data = _read_small(self.files, self.path(generation))
        try:
            record = json.loads(data) if data is not None else None
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested thousands deep
            return None
        named = isinstance(record, dict) and type(record.get("generation")) is int
        return record if named and record["generation"] == generation and self.valid(record) else None

    def path(self, generation: int) -> str:
        return f"{self.folder}/gen-{generation:09d}.json"

    def _generations(self) -> list[int]:
        self.fs.invalidate_cache(self.folder)
        try:
            names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.folder, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(m[1]) for m in map(_GENERATION.match, names) if m)

    def take(self, may_take: Callable[[Claim], bool], fields: dict | None = None, pids: list[int] | None = None,
             newest: Callable[[], Claim | None] | None = None) -> Claim | None:
        """Claim the generation after the holder's where `may_take(holder)` allows it (or raises the policy's refusal);
        None where another holds it: refused, or other claimants won every race for the next generation. `newest` is
        who holds it now (default: the newest claim); the record holds `fields`, this machine and `pids`."""
        newest = newest or self.newest
        if self.files.local:
            self.fs.makedirs(self.folder, exist_ok=True)
        allowed, damaged = None, 0  # the holder the policy let go; the highest generation taken by a non-claim
        for _ in range(_ATTEMPTS):
            current = newest()
            if current is not None and current != allowed:
                if not may_take(current):
                    return None
                allowed = current
            generation = max(current.generation if current else 0, damaged) + 1
            record = self._record(generation, fields or {}, pids or [os.getpid()])
            try:
                self.files.create(self.fs, self.path(generation), _encode(record))
            except FileExistsError:
                existing = self.read(generation)
                if existing is None and self.fs.exists(self.path(generation)):  # a folder, a FIFO, garbage: skipped
                    log.warning("%s is not a claim; skipping it", self.path(generation))
                    damaged = generation
                if existing != record:  # another claimant's; else our own PUT, retried after a cut connection
                    continue
            self.held, self.lost = Claim(generation, record), False
            # Made from a stale listing (its number freed when newer claims forgot older files): the newer claims win.
            if self.overtaken() is not None:
                self.held = None
                continue
            self._forget_before(generation - 1)
            return self.held
        return None

    def _record(self, generation: int, fields: dict, pids: list[int]) -> dict:
        now = time.time()
        # The token tells this claim from another of the same generation (one made after its file was deleted).
        return {**fields, "generation": generation, **holder(pids), "since": now, "renewed": now, "beat": 0,
                "released": False, "token": uuid.uuid4().hex}

    def _forget_before(self, generation: int) -> None:
        """Older generations are history; the newest two are enough for the fence and for messages."""
        for old in self._generations():
            if old < generation:
                try:
                    self.fs.rm_file(self.path(old))
                except OSError:  # gone meanwhile, or not a file: left alone
                    pass

    def overtaken(self) -> Claim | None:
        """The fence: the claim that took over from this process's (a newer generation, or its own generation
        claimed anew after its file was deleted), which sets `lost`; None while this process's is the newest."""
        if self.held is None:
            return None
        newest = self.newest()
        if newest is None or newest.generation < self.held.generation:
            return None
        if newest.generation == self.held.generation and newest.record.get("token") == self.held.record["token"]:
            return None
        self.lost = True
        return newest

    def renew(self, released: bool = False) -> Claim | None:
        """Write this claim again (next beat, `released`); or, writing nothing, return the claim that took over."""
        newer = self.overtaken()
        if newer is not None:
            return newer
        held = self.held.record
        record = {**held, "renewed": time.time(), "beat": held["beat"] + 1, "released": released}
        if self.files.local:
            self.fs.makedirs(self.folder, exist_ok=True)  # the folder may have been deleted under the holder
        self.files.replace(self.fs, self.path(self.held.generation), _encode(record))
        self.held = Claim(self.held.generation, record)
        return None

    def keep_alive(self, interval: float, lost: Callable[[Claim], None]) -> None:
        """Renew every `interval` seconds in a background thread until `release`; `lost(newer)` once taken over."""
        self._beat = Beat(lambda: self._renew_quietly(lost), interval, f"claim {self.name}")
        self._beat.start()

    def _renew_quietly(self, lost: Callable[[Claim], None]) -> bool:
        try:
            newer = self.renew()
        except Exception as e:  # a storage hiccup: the next beat may get through, and watchers allow for some
            log.warning("could not renew the claim on %s: %s: %s", self.name, type(e).__name__, self.files.redact(e))
            return True
        if newer is not None:
            lost(newer)
        return newer is None

    def release(self) -> None:
        """Stop renewing, and mark the claim released (unless it was lost), so that another may take over at once."""
        if self._beat is not None:
            self._beat.stop()
        if self.held is None or self.lost:
            return
        try:
            self.renew(released=True)
        except Exception as e:  # the claim then falls silent, and is taken over after its timeout
            log.warning("could not release the claim on %s: %s", self.name, self.files.redact(e))

    def __enter__(self) -> "GenerationalClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _encode(record: dict) -> bytes:
    return json.dumps(record, indent=2).encode()


def _read_small(files: Files, path: str) -> bytes | None:
    """The bytes of `path` where it is a regular file of at most MAX_CLAIM_BYTES; None otherwise (absent, a folder,
    a FIFO, a link, larger). Never blocks on a FIFO, never reads more than MAX_CLAIM_BYTES + 1 bytes."""
    try:
        if not files.local:
            data = files.fs.cat_file(path, start=0, end=MAX_CLAIM_BYTES + 1)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                data = os.read(fd, MAX_CLAIM_BYTES + 1)
            finally:
                os.close(fd)
    except OSError:  # gone meanwhile, a link (ELOOP), unreadable, an empty object (whose range S3 cannot satisfy)
        return None
    return data if len(data) <= MAX_CLAIM_BYTES else None


class MachineLock:
    """An exclusive flock on a folder of this machine, with no lock file to leave behind: the kernel lets it go when
    its holder ends, however it ends. `doing` says what the holder does there, for a waiting process's message."""

    def __init__(self, folder: str | os.PathLike, doing: str):
        self.folder, self.doing = Path(folder), doing
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait: bool = True) -> bool:
        """Whether this process holds the lock now: False where another holds it (and not `wait`), or where the
        file system has no flock (then the caller goes on without). The folder itself is never a link: one in a
        place other users share could be swapped for a link to anything."""
        self._fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        _held.add(self)  # from here on a forked child closes its copy, even while this process waits
        held = False
        try:
            held = self._flock(wait)
        finally:
            if not held:  # also when a stop interrupts the wait
                self.release()
        return held

    def _flock(self, wait: bool) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                return False
            log.info("waiting: another process on this machine is %s %s", self.doing, self.folder)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError:  # no flock on this file system
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            _held.discard(self)
            os.close(self._fd)  # releases the lock
            self._fd = None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# The machine locks this process holds. A forked child closes its copies at once: a lock is held until every
# copy of its descriptor is closed, and a child may outlive this process.
_held: set[MachineLock] = set()


def _forget_held_locks() -> None:
    for lock in _held:
        os.close(lock._fd)
        lock._fd = None
    _held.clear()


os.register_at_fork(after_in_child=_forget_held_locks)

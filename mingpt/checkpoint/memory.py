"""The memory tier: the replica's state after every step (or every few), kept in shared memory that
outlives the worker processes, so that a restart resumes from it rather than from the last durable
snapshot, and a failure costs at most the step in flight.

    /dev/shm/mingpt-<hash of snapshot.dir>-<pid of the launcher>/
        slot-0.bin, slot-1.bin      two buffers, written in turn: one always holds a complete state
        slot-0.json, slot-1.json    what a buffer holds (job, step, where each tensor lies in it)
        reached                     the last step its writer finished, for steps_lost

One process per launcher (torchrun's agent: one per node, which outlives its workers) writes its
own folder, the first of the launcher's processes to lock it; readers look at every folder of the run on the machine, so two agents of one job on one
machine never write the same buffer. Writing a slot removes its description first and writes it
again only once the copy is complete, so a copy cut short (the process killed in the middle) is
never read: the other slot still holds the step before. A tier belongs to one job
(mingpt.checkpoint.lease.job_identity) and one snapshot.dir; one of another job, or whose launcher
has ended, is removed when a job starts.

/dev/shm is writable by every user of the machine, and these names can be worked out. So a folder is
used only if it is a folder (not a link) of this user's alone (mode 0700); every file in it is checked
to be a regular file of this user's before it is read or written, and opened without following links;
a description is checked for its types and bounds, and a buffer against the sha256 (of it and of its
description) recorded when it was written. Anything else is skipped with a warning, never loaded. A
tier that cannot be written (no room, a folder another user made, the folder deleted under the job)
turns itself off with one warning: the job goes on from its snapshots.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from mingpt.checkpoint.lease import process_alive
from mingpt.storage import replace_atomically

log = logging.getLogger(__name__)

_LOCAL = LocalFileSystem()

FORMAT = "mingpt-memory"
VERSION = 2  # 2: a sha256 of each slot
ALIGN = 64  # bytes: every tensor starts at a multiple, so any dtype can be viewed in place
MAX_HEADER = 64 * 2**20  # bytes: a larger description is not ours
DTYPES = {name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}


@dataclass
class Held:
    """A complete state in a slot: its description and the buffer's path."""

    step: int
    header: dict
    path: Path


class MemoryTier:
    """This node's memory tier for one run (`run`: where its snapshots are) and one job."""

    def __init__(self, run: str, job: str, root: str = "/dev/shm"):
        self.job = job
        self.root, self.prefix = Path(root), f"mingpt-{hashlib.sha256(run.encode()).hexdigest()[:16]}"
        self.folder = self.root / f"{self.prefix}-{os.getppid()}"  # what this process writes
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._mapped: dict[int, torch.Tensor] = {}  # slot -> its buffer, mapped once (its pages stay resident)
        self._written: int | None = None  # the slot of the last complete copy, once this process made one
        self.writes = False  # whether this process writes the folder: the first of its launcher's to lock it
        self.off = False  # turned off (turn_off): reads and writes nothing more
        self._lock: int | None = None
        self._skipped: set[Path] = set()  # what was warned about once
        self.copies = 0
        self.copy_seconds: float | None = None  # of the last copy

    def turn_off(self, why: str) -> None:
        """Stop using the tier, with one warning: the job goes on from its snapshots."""
        if not self.off:
            log.warning("memory tier off: %s; a failure resumes from the last snapshot", why)
        self.off, self.writes = True, False

    # -- reading ---------------------------------------------------------------------------------

    def folders(self) -> list[Path]:
        """The run's tier folders on this machine, one per launcher: folders of this user's alone."""
        found = []
        for folder in sorted(self.root.glob(f"{self.prefix}-*")) if not self.off else []:
            if _private_folder(folder):
                found.append(folder)
            else:
                self._skip(folder, "not a folder of this user's alone (mode 0700, no link): another user may have "
                                   "made it")
        return found

    def newest(self, newer_than: int = -1) -> Held | None:
        """The newest complete state of this job on this machine after step `newer_than`, whose buffer
        matches the sha256 it was written with; None if there is none."""
        found = [self._read_slot(folder, slot) for folder in self.folders() for slot in (0, 1)]
        for held in sorted((h for h in found if h is not None and h.step > newer_than), key=lambda h: -h.step):
            if _digest(self._map(held), held.header) == held.header["sha256"]:
                return held
            self._skip(held.path, "its contents do not match the sha256 they were written with")
        return None

    def _read_slot(self, folder: Path, slot: int) -> Held | None:
        header_path, path = folder / f"slot-{slot}.json", folder / f"slot-{slot}.bin"
        try:
            header = json.loads(_read_own_file(header_path, MAX_HEADER))
            size = _own_file(path).st_size
        except FileNotFoundError:
            return None  # an empty slot, or one being written
        except (OSError, ValueError) as e:  # a link, a FIFO, another user's file, not JSON
            self._skip(header_path, str(e))
            return None
        if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION \
                or header.get("job") != self.job:
            return None  # another job's, or another version's: not ours to read
        if not _well_described(header) or size < header["nbytes"]:
            self._skip(header_path, "a damaged description")
            return None
        return Held(header["step"], header, path)

    def _skip(self, path: Path, why: str) -> None:
        if path not in self._skipped:
            self._skipped.add(path)
            log.warning("memory tier: skipping %s: %s", path, why)

    def reached(self) -> int:
        """The last step a writer of this machine finished (0: none recorded)."""
        steps = [0]
        for folder in self.folders():
            try:
                steps.append(int(_read_own_file(folder / "reached", 64)))
            except (OSError, ValueError):
                pass
        return max(steps)

    @staticmethod
    def _map(held: Held) -> torch.Tensor:
        """The buffer of `held`, mapped: its pages are read where they lie, not copied."""
        return torch.from_file(str(held.path), shared=False, size=held.header["nbytes"], dtype=torch.uint8)

    @staticmethod
    def load(held: Held) -> torch.Tensor:
        """The buffer of `held`, read into this process's memory (it may be overwritten afterwards)."""
        return MemoryTier._map(held).clone()

    @staticmethod
    def unpack(buffer: torch.Tensor, header: dict) -> Any:
        """The state (nested dicts and lists of tensors and plain values) that `buffer` and `header` hold."""
        views = [_view(buffer, entry).clone() for entry in header["tensors"]]
        return _unpack(header["tree"], views)

    # -- writing ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Make the folder of this process's launcher, once every process has read what it needed, and
        write it if no other process of that launcher does. A folder of this run
        that holds another job's state is removed: this job holds the run (mingpt.checkpoint.lease), so
        that job ended or died. So is any tier whose launcher on this machine has ended (torchrun's agent
        outlives its workers: while it runs, its tier may be needed)."""
        if self.off:
            return
        for other in self.root.glob("mingpt-*"):
            if not _private_folder(other):
                continue  # another user's: never read, never removed
            jobs = _jobs(other)
            another_job = other.name.startswith(f"{self.prefix}-") and jobs and self.job not in jobs
            if another_job or (other != self.folder and _launcher_gone(other)):
                log.info("removing %s, the memory tier of a job that ended", other)
                shutil.rmtree(other, ignore_errors=True)
        self._mapped.clear()
        self._written = None
        try:
            self.folder.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            self.turn_off(f"cannot make {self.folder} ({e.strerror or e})")
            return
        if not _private_folder(self.folder):  # made before us, by another user: never adopted
            self.turn_off(f"{self.folder} exists and is not a folder of this user's alone (another user may have "
                          "made it)")
            return
        if self._lock is None:  # one writer per folder, whatever the ranks: the lock goes when its holder ends
            self._lock = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            # A forked child would hold the lock on after this process ended: it closes its copy at once.
            os.register_at_fork(after_in_child=self._forget_lock)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.writes = True
            except BlockingIOError:
                pass

    def mark_reached(self, step: int) -> None:
        if self.off:
            return
        try:
            replace_atomically(_LOCAL, str(self.folder / "reached"), str(step).encode())
        except OSError as e:  # the folder was deleted under the job (systemd's RemoveIPC), or the memory is full
            self.turn_off(f"cannot write in {self.folder} ({e.strerror or e})")

    def has_room(self, state: Any) -> bool:
        """Whether the shared memory has room for both slots of `state`."""
        tensors: list[torch.Tensor] = []
        _pack(state, tensors)
        try:
            held = sum(path.lstat().st_size for path in self.folder.glob("slot-*.bin"))
            free = os.statvfs(self.folder)
        except OSError:
            return False
        return free.f_bavail * free.f_frsize + held >= 2 * _layout(tensors)[1]

    def save(self, state: Any, step: int, info: dict) -> None:
        """Copy `state` (the replica's state after `step`) into the older slot, in a background thread;
        `wait` before the state changes again (the next optimizer step)."""
        self.wait()
        if self.off:
            return
        tensors: list[torch.Tensor] = []
        tree = _pack(state, tensors)
        slot = self._older_slot()
        self._thread = threading.Thread(target=self._copy, args=(slot, tensors, tree, step, info),
                                        name="memory-tier", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the copy in flight; a failed copy turns the tier off."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            self.turn_off(f"could not copy the state to {self.folder} ({self._error})")
            self._error = None

    def _older_slot(self) -> int:
        if self._written is not None:  # the other one holds the older step (or a failed copy)
            return 1 - self._written
        held = {slot: self._read_slot(self.folder, slot) for slot in (0, 1)}
        if held[0] is None or held[1] is None:
            return 0 if held[0] is None else 1
        return 0 if held[0].step < held[1].step else 1

    def _copy(self, slot: int, tensors: list[torch.Tensor], tree: Any, step: int, info: dict) -> None:
        started = time.perf_counter()
        try:
            entries, nbytes = _layout(tensors)
            header_path, path = self.folder / f"slot-{slot}.json", self.folder / f"slot-{slot}.bin"
            header_path.unlink(missing_ok=True)  # from here until the new header, this slot holds nothing
            buffer = self._mapped.get(slot)
            if buffer is None or buffer.numel() != nbytes:
                _allocate(path, nbytes)
                buffer = self._mapped[slot] = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
            with torch.no_grad():
                for entry, tensor in zip(entries, tensors):
                    _view(buffer, entry).copy_(tensor.detach())
            header = {"format": FORMAT, "version": VERSION, "job": self.job, "step": step, "nbytes": nbytes,
                      "tensors": entries, "tree": tree, "host": socket.gethostname(), "written": time.time(), **info}
            header = json.loads(json.dumps(header))  # as a reader will see it
            header["sha256"] = _digest(buffer, header)
            replace_atomically(_LOCAL, str(header_path), json.dumps(header).encode())
            self._written = slot
        except BaseException as e:  # no space left, a read-only /dev/shm: the durable tier still works
            self._error = e
        self.copy_seconds = time.perf_counter() - started
        self.copies += 1

    def _forget_lock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock, self.writes = None, False

    def release(self) -> None:
        """The job ended: the writer frees the memory."""
        self.wait()
        self._mapped.clear()
        if self.writes:
            shutil.rmtree(self.folder, ignore_errors=True)
        self._forget_lock()


def _jobs(folder: Path) -> set:
    """The jobs that the described slots in `folder` belong to."""
    jobs = set()
    for header in folder.glob("slot-*.json"):
        try:
            jobs.add(json.loads(_read_own_file(header, MAX_HEADER)).get("job"))
        except (OSError, ValueError, AttributeError, TypeError):
            pass
    return jobs


def _private_folder(path: Path) -> bool:
    """Whether `path` is a folder (not a link) of this user's alone: what the tier may read and write."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and found.st_mode & 0o077 == 0


def _own_file(path: Path) -> os.stat_result:
    """lstat of `path`; OSError unless it is a regular file of this user's."""
    found = os.lstat(path)
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
        raise OSError(f"not a regular file of this user's (mode {stat.filemode(found.st_mode)}, owner {found.st_uid})")
    return found


def _read_own_file(path: Path, limit: int) -> bytes:
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


def _allocate(path: Path, nbytes: int) -> None:
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


def _digest(buffer: torch.Tensor, header: dict) -> str:
    """sha256 of a slot: its description of the tensors and of the tree they fill, then its bytes."""
    digest = hashlib.sha256(json.dumps([header["tensors"], header["tree"]], sort_keys=True).encode())
    digest.update(memoryview(buffer.numpy()))
    return digest.hexdigest()


def _well_described(header: dict) -> bool:
    """Whether a description's fields have the types and bounds the tier reads them with."""
    try:
        if not (_whole(header["step"]) and _whole(header["nbytes"]) and isinstance(header["sha256"], str)
                and isinstance(header["tensors"], list)):
            return False
        for entry in header["tensors"]:
            dtype, shape, offset, nbytes = entry["dtype"], entry["shape"], entry["offset"], entry["nbytes"]
            if not (dtype in DTYPES and isinstance(shape, list) and all(map(_whole, shape)) and _whole(offset)
                    and nbytes == math.prod(shape) * DTYPES[dtype].itemsize and offset % ALIGN == 0
                    and offset + nbytes <= header["nbytes"]):
                return False
        return True
    except (KeyError, TypeError):
        return False


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _launcher_gone(folder: Path) -> bool:
    """Whether the launcher that the folder is named after (a process of this machine) has ended."""
    pid = folder.name.rsplit("-", 1)[-1]
    return pid.isdigit() and not process_alive(int(pid))


def _layout(tensors: list[torch.Tensor]) -> tuple[list[dict], int]:
    entries, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append({"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                        "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


def _view(buffer: torch.Tensor, entry: dict) -> torch.Tensor:
    part = buffer[entry["offset"]: entry["offset"] + entry["nbytes"]]
    return part.view(DTYPES[entry["dtype"]]).view(entry["shape"])


def _pack(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A JSON tree of `obj` whose tensors are replaced by their index in `tensors` (dict keys keep their type)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"tensor": len(tensors) - 1}
    if isinstance(obj, dict):
        return {"dict": [[key, _pack(value, tensors)] for key, value in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"list": [_pack(value, tensors) for value in obj], "tuple": isinstance(obj, tuple)}
    return {"value": obj}


def _unpack(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if "tensor" in tree:
        return tensors[tree["tensor"]]
    if "dict" in tree:
        return {key: _unpack(value, tensors) for key, value in tree["dict"]}
    if "list" in tree:
        values = [_unpack(value, tensors) for value in tree["list"]]
        return tuple(values) if tree["tuple"] else values
    return tree["value"]

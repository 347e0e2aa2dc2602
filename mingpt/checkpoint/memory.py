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
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
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
VERSION = 1
ALIGN = 64  # bytes: every tensor starts at a multiple, so any dtype can be viewed in place


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
        self._lock: int | None = None
        self.copies = 0
        self.copy_seconds: float | None = None  # of the last copy

    # -- reading ---------------------------------------------------------------------------------

    def folders(self) -> list[Path]:
        """The run's tier folders on this machine, one per launcher."""
        return sorted(self.root.glob(f"{self.prefix}-*"))

    def newest(self) -> Held | None:
        """The newest complete state of this job on this machine, if any."""
        found = [self._read_slot(folder, slot) for folder in self.folders() for slot in (0, 1)]
        return max((held for held in found if held is not None), key=lambda held: held.step, default=None)

    def _read_slot(self, folder: Path, slot: int) -> Held | None:
        try:
            header = json.loads((folder / f"slot-{slot}.json").read_text())
            path = folder / f"slot-{slot}.bin"
            complete = path.stat().st_size >= header["nbytes"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if header.get("format") != FORMAT or header.get("version") != VERSION or header.get("job") != self.job \
                or not complete:
            return None
        return Held(header["step"], header, path)

    def reached(self) -> int:
        """The last step a writer of this machine finished (0: none recorded)."""
        steps = [0]
        for folder in self.folders():
            try:
                steps.append(int((folder / "reached").read_text()))
            except (OSError, ValueError):
                pass
        return max(steps)

    @staticmethod
    def load(held: Held) -> torch.Tensor:
        """The buffer of `held`, read into this process's memory (it may be overwritten afterwards)."""
        return torch.from_file(str(held.path), shared=False, size=held.header["nbytes"], dtype=torch.uint8).clone()

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
        for other in self.root.glob("mingpt-*"):
            jobs = _jobs(other)
            another_job = other.name.startswith(f"{self.prefix}-") and jobs and self.job not in jobs
            if another_job or (other != self.folder and _launcher_gone(other)):
                log.info("removing %s, the memory tier of a job that ended", other)
                shutil.rmtree(other, ignore_errors=True)
        self._mapped.clear()
        self._written = None
        self.folder.mkdir(mode=0o700, exist_ok=True)
        if self._lock is None:  # one writer per folder, whatever the ranks: the lock goes when its holder ends
            self._lock = os.open(self.folder, os.O_RDONLY)
            # A forked child would hold the lock on after this process ended: it closes its copy at once.
            os.register_at_fork(after_in_child=self._forget_lock)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.writes = True
            except BlockingIOError:
                pass

    def mark_reached(self, step: int) -> None:
        replace_atomically(_LOCAL, str(self.folder / "reached"), str(step).encode())

    def has_room(self, state: Any) -> bool:
        """Whether the shared memory has room for both slots of `state`."""
        tensors: list[torch.Tensor] = []
        _pack(state, tensors)
        held = sum(path.stat().st_size for path in self.folder.glob("slot-*.bin"))
        stat = os.statvfs(self.folder)
        return stat.f_bavail * stat.f_frsize + held >= 2 * _layout(tensors)[1]

    def save(self, state: Any, step: int, info: dict) -> None:
        """Copy `state` (the replica's state after `step`) into the older slot, in a background thread;
        `wait` before the state changes again (the next optimizer step)."""
        self.wait()
        tensors: list[torch.Tensor] = []
        tree = _pack(state, tensors)
        slot = self._older_slot()
        self._thread = threading.Thread(target=self._copy, args=(slot, tensors, tree, step, info),
                                        name="memory-tier", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the copy in flight; a failed copy is logged once and the tier goes on."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            log.warning("could not copy the state to the memory tier in %s: %s", self.folder, self._error)
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
                with open(path, "ab") as f:
                    f.truncate(nbytes)
                buffer = self._mapped[slot] = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
            with torch.no_grad():
                for entry, tensor in zip(entries, tensors):
                    _view(buffer, entry).copy_(tensor.detach())
            header = {"format": FORMAT, "version": VERSION, "job": self.job, "step": step, "nbytes": nbytes,
                      "tensors": entries, "tree": tree, "host": socket.gethostname(), "written": time.time(), **info}
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
            jobs.add(json.loads(header.read_text()).get("job"))
        except (OSError, ValueError, AttributeError):
            pass
    return jobs


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
    return part.view(getattr(torch, entry["dtype"])).view(entry["shape"])


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

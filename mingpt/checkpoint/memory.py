"""The memory tier: the run state after every step (or every few), kept in shared memory that outlives the workers,
so that a restart resumes from it rather than from the last snapshot (docs/snapshots.md#the-memory-tier).

    <snapshot.memory_dir>/mingpt-<hash of snapshot.dir>-<pid of the launcher>-<shard>of<shards>/
        own-0.*, own-1.*      this process's shard: two buffers (.bin) written in turn, each described (.json)
        peer-0.*, peer-1.*    the shard of a process on another node (mingpt.training.recovery)
        reached               the last step its writer finished, for steps_lost

A description is written only once its buffer is complete, so a copy cut short is never read. /dev/shm is every user's,
so only this user's own folders (0700, no link) and regular files are used, and a buffer only where it and its checked
description match their sha256; anything else is skipped with a warning. A tier that cannot be written turns itself
off, and the job goes on from its snapshots."""

from __future__ import annotations

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
from typing import Any, Callable

import torch
from fsspec.implementations.local import LocalFileSystem

from mingpt.checkpoint.packing import pack, unpack
from mingpt.checkpoint.shm import allocate, available_memory
from mingpt.claim import MachineLock, process_alive
from mingpt.storage import (others_may_replace_in, own_file, parse_json, private_folder, read_own_file,
                            replace_atomically)

log = logging.getLogger(__name__)

_LOCAL = LocalFileSystem()

FORMAT = "mingpt-memory"
VERSION = 4
ALIGN = 64  # bytes: every tensor starts at a multiple, so any dtype can be viewed in place
MAX_HEADER = 64 * 2**20  # bytes: a larger description is not ours
DTYPES = {name: getattr(torch, name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
SLOTS = ("own-0", "own-1", "peer-0", "peer-1")
MEMORY_SHARE = 0.5  # of this machine's available memory, the most a node's tiers take: the rest is the job's


def unusable(root: str) -> str | None:
    """Why this user cannot keep a memory tier in the folder `root` (snapshot.memory_dir), or None: it can."""
    try:
        found = os.stat(root)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if not stat.S_ISDIR(found.st_mode):
        return "it is not a folder"
    if not os.access(root, os.W_OK | os.X_OK):
        return "this user cannot write in it"
    if problem := others_may_replace_in(root):
        return f"{problem}, so another user could replace the tier's folders"
    return None


@dataclass
class Held:
    """A complete shard in a slot: its description and the buffer's path."""

    step: int
    header: dict
    path: Path

    @property
    def shard(self) -> tuple[int, int]:
        """(index, count): which of the state's shards this is."""
        return tuple(self.header["shard"])


class MemoryTier:
    """This node's memory tier for one run (`run`: where its snapshots are), one job, and one shard (index, count)."""

    def __init__(self, run: str, job: str, root: str = "/dev/shm", shard: tuple[int, int] = (0, 1),
                 launcher: int | None = None):
        self.job, self.shard = job, shard
        self.root, self.prefix = Path(root), f"mingpt-{hashlib.sha256(run.encode()).hexdigest()[:16]}"
        # Named after the process it outlives workers with: torchrun's agent, else this one; it goes when that one ends.
        self.launcher = f"{self.prefix}-{launcher or os.getpid()}"
        self.folder = self.root / f"{self.launcher}-{shard[0]}of{shard[1]}"  # what this process writes
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._error: BaseException | None = None
        self._mapped: dict[str, torch.Tensor] = {}  # slot -> its buffer, mapped once (its pages stay resident)
        self._newest: dict[str, str] = {}  # "own"/"peer" -> the slot of the last complete copy this process made
        self.off = False  # turned off (turn_off): reads and writes nothing more
        self._lock: MachineLock | None = None  # the folder's: its holder, the first of its launcher's, writes it
        self._skipped: set[Path] = set()  # what was warned about once
        self.slots = 2  # buffers per kind, written in turn (fit)
        self.copies = 0  # made or tried
        self.copy_seconds = 0.0  # the CPU time of the last finished copy and what followed it, in its thread

    def turn_off(self, why: str) -> None:
        """Stop using the tier, with one warning: the job goes on from its snapshots."""
        if not self.off:
            log.warning("memory tier off: %s; a failure resumes from the last snapshot", why)
        self.off = True

    def folders(self) -> list[Path]:
        """The run's tier folders on this machine: folders of this user's alone."""
        found = []
        for folder in sorted(self.root.glob(f"{self.prefix}-*")) if not self.off else []:
            if private_folder(folder):
                found.append(folder)
            else:
                self._skip(folder, "not a folder of this user's alone (mode 0700, no link): another user may have "
                                   "made it")
        return found

    def shards(self, newer_than: int = -1) -> list[Held]:
        """Described shards of this job and run here after step `newer_than`, newest first (checked when read)."""
        found = [self._read_slot(folder, slot) for folder in self.folders() for slot in SLOTS]
        return sorted((h for h in found if h is not None and h.step > newer_than), key=lambda h: -h.step)

    def read(self, held: Held) -> torch.Tensor | None:
        """`held`'s buffer, copied here (the slot may be overwritten), if it matches its sha256; else None, warned."""
        buffer = _map(held).clone()
        if _digest(buffer, held.header) == held.header["sha256"]:
            return buffer
        self._skip(held.path, "its contents do not match the sha256 they were written with")
        return None

    def _read_slot(self, folder: Path, slot: str) -> Held | None:
        header_path, path = folder / f"{slot}.json", folder / f"{slot}.bin"
        try:
            header = parse_json(read_own_file(header_path, MAX_HEADER))
            size = own_file(path).st_size
        except FileNotFoundError:
            return None  # an empty slot, or one being written
        except (OSError, ValueError) as e:  # a link, a FIFO, another user's file, not JSON
            self._skip(header_path, str(e))
            return None
        if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION \
                or header.get("job") != self.job or header.get("run") != self.prefix:
            return None  # another job's, run's or version's: not ours to read
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
                steps.append(int(read_own_file(folder / "reached", 64)))
            except (OSError, ValueError):
                pass
        return max(steps)

    @staticmethod
    def unpack(buffer: torch.Tensor, header: dict) -> Any:
        """The state (nested containers of tensors, Chunks of sharded ones, plain values) `buffer` and `header` hold."""
        views = [_view(buffer, entry).clone() for entry in header["tensors"]]
        return unpack(header["tree"], views)

    def start(self) -> None:
        """Make this process's folder, once every process has read what it needed, and write it if no other process of
        its launcher does. Other jobs' tiers of this run (they ended: this job holds it) and ended tiers are removed."""
        if self.off:
            return
        remove_ended_tiers(self.root)
        for other in self.root.glob(f"{self.prefix}-*"):  # this run's: one of another job's is of a job that ended
            jobs = _jobs(other) if private_folder(other) else set()  # another user's: never read, never removed
            if jobs and self.job not in jobs:
                log.info("removing %s, the memory tier of a job that ended", other)
                shutil.rmtree(other, ignore_errors=True)
        self._mapped.clear()
        self._newest.clear()
        try:
            self.folder.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            self.turn_off(f"cannot make {self.folder} ({e.strerror or e})")
            return
        if not private_folder(self.folder):  # made before us, by another user: never adopted
            self.turn_off(f"{self.folder} exists and is not a folder of this user's alone (another user may have "
                          "made it)")
            return
        if self._lock is None:  # one writer per folder, whatever the ranks: the lock goes when its holder ends
            self._lock = MachineLock(self.folder, "writing the memory tier in")
            self._lock.acquire(wait=False)

    def mark_reached(self, step: int) -> None:
        if self.off:
            return
        try:
            replace_atomically(_LOCAL, str(self.folder / "reached"), str(step).encode())
        except OSError as e:  # the folder was deleted under the job (systemd's RemoveIPC), or the memory is full
            self.turn_off(f"cannot write in {self.folder} ({e.strerror or e})")

    def fit(self, state: Any, kinds: int, writers: int) -> None:
        """Keep as many copies of `state` per kind (two in turn, else one) as fit the room of `writers` tiers like this
        one on this machine, `kinds` each (its own shard, and another node's); where not even one fits, turn off with
        one warning, rather than let a full /dev/shm (SIGBUS) or the OOM killer end the job."""
        tensors: list[torch.Tensor] = []
        pack(state, tensors)
        nbytes = _layout(tensors)[1]
        try:
            held = sum(path.lstat().st_size for path in self.folder.glob("*.bin"))  # counted as used: ours to reuse
            free = os.statvfs(self.folder)
        except OSError as e:
            self.turn_off(f"cannot read the room left in {self.folder} ({e.strerror or e})")
            return
        room = min(free.f_bavail * free.f_frsize, MEMORY_SHARE * available_memory()) / writers + held
        self.slots = next((slots for slots in (2, 1) if slots * kinds * nbytes <= room), 0)
        need = f"{kinds * nbytes / 2**20:.0f} MiB a copy, {room / 2**20:.0f} MiB of room per tier ({writers} on this " \
               f"machine, at most {MEMORY_SHARE:.0%} of its available memory)"
        if self.slots == 0:
            self.turn_off(f"no room for one copy of the state in {self.root}: {need}")
        elif self.slots == 1:
            for path in self.folder.glob("*-1.*"):  # an earlier start's second buffers: their memory is wanted
                path.unlink(missing_ok=True)
            log.info("memory tier: one copy, not two in turn (%s): a failure during a copy resumes from the snapshot",
                     need)

    def save(self, state: Any, step: int, info: dict,
             then: Callable[[dict | None, torch.Tensor | None], None] | None = None) -> None:
        """Copy `state` (this process's shard after `step`) into the older slot in a background thread; `wait_copied`
        before the state changes again. `then(header, buffer)` runs in that thread after it (None, None: no copy)."""
        self.wait()
        tensors: list[torch.Tensor] = []
        tree = pack(state, tensors)
        self._copied.clear()
        self._thread = threading.Thread(target=self._copy_then, args=(tensors, tree, step, info, then),
                                        name="memory-tier", daemon=True)
        self._thread.start()

    def wait_copied(self) -> None:
        """Wait until the copy in flight has read the state (what `then` does may still run)."""
        if self._thread is not None:
            self._copied.wait()
        self._check_error()

    def wait(self) -> None:
        """Wait for the copy in flight and what follows it; a failed copy turns the tier off."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._check_error()

    def _check_error(self) -> None:
        if self._error is not None:
            self.turn_off(f"could not copy the state to {self.folder} ({self._error})")
            self._error = None

    def _copy_then(self, tensors: list[torch.Tensor], tree: Any, step: int, info: dict, then) -> None:
        started, header, buffer = time.thread_time(), None, None
        try:
            if self.writes and not self.off:
                header, buffer = self._copy(tensors, tree, step, info)
        finally:
            self._copied.set()
        if then is not None:
            then(header, buffer)
        self.copy_seconds = time.thread_time() - started

    def _copy(self, tensors: list[torch.Tensor], tree: Any, step: int, info: dict) -> tuple:
        try:
            entries, nbytes = _layout(tensors)
            slot, buffer = self._open_slot("own", nbytes)
            with torch.no_grad():
                for entry, tensor in zip(entries, tensors):
                    _view(buffer, entry).copy_(tensor.detach())
            header = {"format": FORMAT, "version": VERSION, "job": self.job, "run": self.prefix,
                      "shard": list(self.shard), "step": step, "nbytes": nbytes, "tensors": entries, "tree": tree,
                      "host": socket.gethostname(), "written": time.time(), **info}
            header = json.loads(json.dumps(header))  # as a reader will see it
            header["sha256"] = _digest(buffer, header)
            self._publish(slot, header)
            return header, buffer
        except BaseException as e:  # no space left, a read-only /dev/shm: the durable tier still works
            self._error = e
            return None, None
        finally:
            self.copies += 1

    def receive(self, nbytes: int) -> tuple[str | None, torch.Tensor]:
        """A buffer of `nbytes` for a shard sent from another node: its older peer slot, emptied of its
        description (publish it with `publish`), or (slot None) scratch memory where the tier cannot keep it."""
        if not self.off:
            try:
                return self._open_slot("peer", nbytes)
            except OSError as e:
                self.turn_off(f"cannot keep a copy sent from another node in {self.folder} ({e.strerror or e})")
        return None, torch.empty(nbytes, dtype=torch.uint8)

    def publish(self, slot: str, header: dict) -> None:
        """Describe what `slot` now holds: from here on it is read."""
        try:
            self._publish(slot, header)
        except OSError as e:
            self.turn_off(f"cannot write in {self.folder} ({e.strerror or e})")

    def _open_slot(self, kind: str, nbytes: int) -> tuple[str, torch.Tensor]:
        """The older slot of `kind`, emptied of its description, and its buffer of `nbytes`, mapped."""
        if self.slots == 1:
            slot = f"{kind}-0"
        else:
            slot = f"{kind}-{1 - int(self._newest[kind][-1])}" if kind in self._newest else self._oldest(kind)
        (self.folder / f"{slot}.json").unlink(missing_ok=True)  # from here until the new one, it holds nothing
        buffer = self._mapped.get(slot)
        if buffer is None or buffer.numel() != nbytes:
            path = self.folder / f"{slot}.bin"
            allocate(path, nbytes)
            buffer = self._mapped[slot] = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return slot, buffer

    def _oldest(self, kind: str) -> str:
        held = {slot: self._read_slot(self.folder, slot) for slot in (f"{kind}-0", f"{kind}-1")}
        empty = [slot for slot, h in held.items() if h is None]
        return empty[0] if empty else min(held, key=lambda slot: held[slot].step)

    def _publish(self, slot: str, header: dict) -> None:
        replace_atomically(_LOCAL, str(self.folder / f"{slot}.json"), json.dumps(header).encode())
        self._newest[slot.split("-")[0]] = slot

    def forget_other_layouts(self) -> None:
        """Remove this launcher's folders of another shard count: another world size's, superseded by now."""
        for other in self.root.glob(f"{self.launcher}-*"):
            if other.name.rsplit("of", 1)[-1] != str(self.shard[1]) and private_folder(other):
                shutil.rmtree(other, ignore_errors=True)

    @property
    def writes(self) -> bool:
        """Whether this process writes the folder: it holds its lock (a forked child does not), and the tier is on."""
        return not self.off and self._lock is not None and self._lock.held

    def _forget_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def release(self) -> None:
        """The job ended: the writer frees the memory."""
        self.wait()
        self._mapped.clear()
        if self.writes:
            shutil.rmtree(self.folder, ignore_errors=True)
        self._forget_lock()


def _map(held: Held) -> torch.Tensor:
    """The buffer of `held`, mapped: its pages are read where they lie, not copied."""
    return torch.from_file(str(held.path), shared=False, size=held.header["nbytes"], dtype=torch.uint8)


def _jobs(folder: Path) -> set:
    jobs = set()
    for header in folder.glob("*-?.json"):
        try:
            jobs.add(parse_json(read_own_file(header, MAX_HEADER)).get("job"))
        except (OSError, ValueError, AttributeError, TypeError):
            pass
    return jobs


def _digest(buffer: torch.Tensor, header: dict) -> str:
    """sha256 of a slot: its description of the tensors and of the tree they fill, then its bytes."""
    digest = hashlib.sha256(json.dumps([header["tensors"], header["tree"]], sort_keys=True).encode())
    digest.update(memoryview(buffer.numpy()))
    return digest.hexdigest()


def _well_described(header: dict) -> bool:
    """Whether a description's fields have the types and bounds the tier reads them with."""
    try:
        shard = header["shard"]
        if not (_whole(header["step"]) and _whole(header["nbytes"]) and isinstance(header["sha256"], str)
                and isinstance(header["tensors"], list) and isinstance(shard, list) and len(shard) == 2
                and all(map(_whole, shard)) and shard[0] < shard[1]):
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


def remove_ended_tiers(root: str | Path) -> None:
    """Remove this user's tiers under `root` whose launcher on this machine has ended: a SIGKILLed job's memory, which
    nothing else frees. A job with a tier calls it once its restore read what it needs; one without, as it starts."""
    for folder in Path(root).glob("mingpt-*"):
        if private_folder(folder) and _launcher_gone(folder):
            log.info("removing %s, the memory tier of a job that ended", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _launcher_gone(folder: Path) -> bool:
    parts = folder.name.split("-")  # mingpt, hash, pid, shard (none in a folder of an earlier version)
    return len(parts) in (3, 4) and parts[2].isdigit() and not process_alive(int(parts[2]))


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

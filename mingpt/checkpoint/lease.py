"""Run ownership: one job at a time writes to a snapshot folder.

Two jobs started into the same `snapshot.dir` by mistake would delete each other's saves and
resume from each other's state. So the job that writes there holds a lease on it:

    <dir>/owner/gen-000000007.json    job, host, pids, since, renewed, released, timeout

Claiming the run means creating the next generation file with exclusive create (O_EXCL on local
disk, a conditional PUT on S3), so of two jobs claiming at once exactly one wins. The newest
generation file names the holder. The holder rewrites its own file every `timeout_s / 4` seconds
("renewed") and marks it released when it exits. Another job may take the run over when the
holder released it, stopped renewing it for `timeout_s`, or ran on this machine and is gone.

Every generation of workers of one torchrun job (restarts, nodes leaving or joining) carries the
same job identity, so it takes the run over at once. A worker left over from an older generation
(its agent killed, its peers gone) finds a newer generation file before it commits or deletes
anything, and stops instead: that is the fence `check()` gives the snapshot store.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from mingpt.errors import MinGPTError
from mingpt.rundir import RunDir
from mingpt.storage import create_exclusive, is_local, replace_atomically

log = logging.getLogger(__name__)

_GEN = re.compile(r"^gen-(\d{9})\.json$")


class RunOwnedError(MinGPTError):
    """Another job holds the run: this one must not write to it."""


class LeaseLostError(MinGPTError):
    """A newer generation or another job took the run over: this process must stop writing."""


@dataclass(frozen=True)
class Claim:
    generation: int
    record: dict


def job_identity() -> str:
    """What stays the same across every generation of workers of this job, and differs between jobs.

    Under torchrun it is the rendezvous id (`--rdzv-id`; a fresh uuid with `--standalone`). Without
    `--rdzv-id` torchrun says "none": then the agent process stands for the job, which is right for
    a one-node launch. A plain process is a job of its own."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    if run_id == "none":
        agent = os.getppid()
        return f"torchrun-agent:{socket.gethostname()}:{agent}:{_start_time(agent)}"
    return f"process:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class RunLease:
    """The claim of one process (the leader of its generation) on the run under `path`."""

    def __init__(self, run: RunDir, timeout_s: float, job: str | None = None):
        self.fs, self.url, self.timeout_s = run.fs, run.url, timeout_s
        self.folder = run.owner
        self.job = job or job_identity()
        self.claim: Claim | None = None
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def generation(self) -> int | None:
        return self.claim.generation if self.claim else None

    # -- claiming ------------------------------------------------------------------------------

    def acquire(self) -> Claim:
        """Claim the run, or raise RunOwnedError naming the job that holds it and what to do."""
        if os.environ.get("TORCHELASTIC_RUN_ID") == "none" and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            log.warning("torchrun was started without --rdzv-id: each node's agent then counts as a job of its "
                        "own for run ownership. Give every node the same --rdzv-id=NAME")
        if is_local(self.fs):
            self.fs.makedirs(self.folder, exist_ok=True)
        for _ in range(10):
            current = self.current()
            if current is not None:
                self._check_may_take(current)
            generation = current.generation + 1 if current else 1
            record = self._record(generation, since=time.time())
            try:
                create_exclusive(self.fs, self._path(generation), _encode(record))
            except FileExistsError:
                if self._read(generation) == record:  # our own PUT, retried after a cut connection
                    break
                continue  # another process claimed this generation first: look again
            break
        else:
            raise RunOwnedError(f"could not claim {self.url}: other processes keep claiming it at the same time")
        self.claim = Claim(generation, record)
        log.info("this job holds %s (generation %d)", self.url, generation)
        self._forget_before(generation - 1)
        return self.claim

    def _check_may_take(self, current: Claim) -> None:
        holder = current.record
        if holder.get("job") == self.job:
            return  # a new generation of this very job: restarts never wait
        if holder.get("released"):
            log.info("taking over %s, released by job %s at %s", self.url, holder.get("job"),
                     _when(holder.get("renewed")))
            return
        age = time.time() - float(holder.get("renewed", 0))
        timeout = float(holder.get("timeout_s", self.timeout_s))
        if _same_machine(holder) and not any(_alive(pid, start) for pid, start in holder.get("pids", [])):
            log.warning("taking over %s from job %s: its processes on this machine (%s) are gone", self.url,
                        holder.get("job"), ", ".join(str(p) for p, _ in holder.get("pids", [])))
            return
        if age > timeout:
            log.warning("taking over %s from job %s on %s: it has not renewed its claim for %.0f s "
                        "(its lease timeout is %.0f s)", self.url, holder.get("job"), holder.get("host"), age, timeout)
            return
        pids = ", ".join(str(p) for p, _ in holder.get("pids", []))
        raise RunOwnedError(
            f"{self.url} is in use by another job: {holder.get('job')} on host {holder.get('host')} "
            f"(pid {pids}), holding it since {_when(holder.get('since'))}, last renewed {age:.0f} s ago. "
            "Wait for that job to end or stop it, or give this one another snapshot.dir. If that job is dead, "
            f"its claim expires {max(0.0, timeout - age):.0f} s from now (snapshot.lease_timeout_s={timeout:g} "
            "of the holder); then run this command again. (One torchrun job on several nodes: give every "
            "node the same --rdzv-id.)"
        )

    # -- holding -------------------------------------------------------------------------------

    def check(self) -> None:
        """The fence: LeaseLostError when a newer generation (of this or another job) claimed the run."""
        if self.claim is None:
            return
        newest = self._newest_generation()
        if newest is not None and newest > self.claim.generation:
            self.lost = True
            holder = self._read(newest) or {}
            raise LeaseLostError(
                f"{self.url} was taken over by generation {newest} (job {holder.get('job')} on "
                f"{holder.get('host')}) while this process held generation {self.claim.generation}; "
                "this process stops without writing or deleting anything there"
            )

    def renew(self, released: bool = False) -> None:
        """Say that the holder is alive (or, `released`, done); never writes over a newer generation."""
        self.check()
        record = {**self.claim.record, "renewed": time.time(), "released": released}
        replace_atomically(self.fs, self._path(self.claim.generation), _encode(record))

    def keep_alive(self) -> None:
        """Renew in a background thread every timeout_s / 4 until `release`; a lost lease sets `lost`."""
        interval = max(0.2, self.timeout_s / 4)

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.renew()
                except LeaseLostError as e:
                    log.error("%s", e)
                    return
                except Exception as e:  # a storage hiccup: the next renewal may get through
                    log.warning("could not renew the claim on %s: %s: %s", self.url, type(e).__name__, e)

        self._thread = threading.Thread(target=loop, name="run-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and mark the claim released, so that another job may start at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.claim is None or self.lost:
            return
        try:
            self.renew(released=True)
        except Exception as e:  # the claim then expires by itself after timeout_s
            log.warning("could not release the claim on %s: %s", self.url, e)

    def __enter__(self) -> "RunLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- storage -------------------------------------------------------------------------------

    def _record(self, generation: int, since: float) -> dict:
        pids = [os.getpid()]
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            pids.append(os.getppid())  # the torchrun agent: the job lives while it does
        return {"job": self.job, "generation": generation, "host": socket.gethostname(), "boot_id": _boot_id(),
                "pids": [[pid, _start_time(pid)] for pid in pids], "since": since, "renewed": since,
                "released": False, "timeout_s": self.timeout_s}

    def _path(self, generation: int) -> str:
        return f"{self.folder}/gen-{generation:09d}.json"

    def _generations(self) -> list[int]:
        self.fs.invalidate_cache(self.folder)
        try:
            names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.folder, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(int(m[1]) for m in map(_GEN.match, names) if m)

    def _newest_generation(self) -> int | None:
        generations = self._generations()
        return generations[-1] if generations else None

    def current(self) -> Claim | None:
        """The newest claim on the run (held, expired or released), or None when nobody ever claimed it."""
        generation = self._newest_generation()
        if generation is None:
            return None
        record = self._read(generation)
        # An unreadable claim file (a hand edit, a torn copy) holds nothing: treat it as released.
        return Claim(generation, record if isinstance(record, dict) else {"released": True})

    def _read(self, generation: int) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self._path(generation)))
        except (FileNotFoundError, ValueError):
            return None

    def _forget_before(self, generation: int) -> None:
        """Old generation files are history; the newest two are enough for the fence and for messages."""
        for old in self._generations():
            if old < generation:
                try:
                    self.fs.rm_file(self._path(old))
                except FileNotFoundError:
                    pass


def describe(claim: Claim | None, now: float | None = None) -> str:
    """One line about who holds a run, for `mingpt-snapshot list`."""
    if claim is None:
        return "no job has claimed this run"
    r = claim.record
    state = "released" if r.get("released") else f"last renewed {(now or time.time()) - float(r.get('renewed', 0)):.0f} s ago"
    return f"claimed by job {r.get('job')} on host {r.get('host')} (generation {claim.generation}), {state}"


def _encode(record: dict) -> bytes:
    return json.dumps(record, indent=2).encode()


def _when(epoch) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(epoch)))
    except (TypeError, ValueError):
        return "an unknown time"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _same_machine(record: dict) -> bool:
    return record.get("host") == socket.gethostname() and record.get("boot_id") == _boot_id()


def _start_time(pid: int) -> int:
    """The start time of a process (clock ticks since boot), so that a reused pid is not taken for it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid, start) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # exists, owned by someone else; or we cannot tell: assume alive
    return not start or _start_time(int(pid)) == start

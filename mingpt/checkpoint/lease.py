"""Run ownership: one job at a time writes to a snapshot folder.

Two jobs started into the same `snapshot.dir` by mistake would delete each other's saves and
resume from each other's state. So the job that writes there holds a lease on it:

    <dir>/owner/gen-000000007.json    job, host, pids, since, renewed, beat, released, timeout

Claiming the run means creating the next generation file with exclusive create (O_EXCL on local
disk, a conditional PUT on S3), so of two jobs claiming at once exactly one wins. The newest
generation file names the holder; every manifest names the job and generation that wrote it, so
the run's history survives the loss of the `owner/` folder (a hand, a bucket expiry rule). The
holder rewrites its own file every `timeout_s / 4` seconds (a new "beat") and marks it released
when it exits.

Another job may take the run over when the holder released it, ran on this machine and is gone, or
stopped beating: judged by watching the claim (and the newest commit) not change for the holder's
`timeout_s` on this process's own monotonic clock. Timestamps written by another host are never
compared with ours, so no clock skew lets a live holder be taken over. (Claim, beat, watch and
liveness are mingpt.claim's, which the prepared data's claim shares.)

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
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from mingpt.claim import Beat, ended_here, holder as holder_record, pids, same_machine, start_time, stood_still
from mingpt.errors import MinGPTError
from mingpt.rundir import RunDir
from mingpt.storage import create_exclusive, is_local, redact, replace_atomically

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
        return f"torchrun-agent:{socket.gethostname()}:{agent}:{start_time(agent)}"
    return f"process:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


# A claim file is a small JSON object; anything else in owner/ (a FIFO, a folder, a huge or garbled file) is
# not a claim and is skipped, never read whole or waited on.
_MAX_CLAIM_BYTES = 64 * 1024
# Longest a claimant watches a silent holder, whatever timeout its (possibly hand-edited) claim names.
_MAX_WATCH_S = 3600.0

# The newest commit of the run: its folder name and the `writer` its manifest names (job, generation).
LastCommit = Callable[[], "tuple[str, dict | None] | None"]


class RunLease:
    """The claim of one process (the leader of its generation) on the run under `path`."""

    def __init__(self, run: RunDir, timeout_s: float, job: str | None = None):
        self.fs, self.url, self.timeout_s = run.fs, run.url, timeout_s
        self.folder, self.metrics = run.owner, run.metrics
        self.local = is_local(run.fs)
        self.job = job or job_identity()
        self.claim: Claim | None = None
        self.lost = False
        self._beat = 0
        self._beating: Beat | None = None

    @property
    def generation(self) -> int | None:
        return self.claim.generation if self.claim else None

    @classmethod
    def following(cls, run: RunDir, claim: Claim) -> "RunLease":
        """The holder's `claim` as a process that writes beside the holder (a shard of a snapshot) sees it:
        its `check` fences that process's writes too; it never renews nor releases anything."""
        lease = cls(run, _timeout_of(claim.record, 60.0), claim.record.get("job"))
        lease.claim = claim
        return lease

    # -- claiming ------------------------------------------------------------------------------

    def acquire(self, last_commit: LastCommit = lambda: None) -> Claim:
        """Claim the run, or raise RunOwnedError naming the job that holds it and what to do.

        `last_commit` tells the newest commit and its writer: where the claim files are gone, that
        writer stands for the holder, and a holder that still commits is alive."""
        if os.environ.get("TORCHELASTIC_RUN_ID") == "none" and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            log.warning("torchrun was started without --rdzv-id: each node's agent then counts as a job of its "
                        "own for run ownership. Give every node the same --rdzv-id=NAME")
        if self.local:
            try:
                self.fs.makedirs(self.folder, exist_ok=True)
            except FileExistsError:
                raise RunOwnedError(f"{self.folder} is not a folder: move it away, then run this again") from None
        damaged = 0  # the highest generation whose name is taken by something that is not a claim
        for _ in range(10):
            current = self._holder(last_commit)
            if current is not None:
                self._check_may_take(current, last_commit)
            generation = max(current.generation if current else 0, damaged) + 1
            record = self._record(generation, since=time.time())
            try:
                create_exclusive(self.fs, self._path(generation), _encode(record))
            except FileExistsError:
                existing = self._read(generation)
                if existing == record:  # our own PUT, retried after a cut connection
                    break
                if existing is None:  # a folder, a FIFO, garbage: skipped as damaged, like every such entry
                    log.warning("%s is not a claim; skipping it", self._path(generation))
                    damaged = generation
                continue  # another process claimed this generation first: look again
            break
        else:
            raise RunOwnedError(f"could not claim {self.url}: other processes keep claiming it at the same time")
        self.claim = Claim(generation, record)
        log.info("this job holds %s (generation %d)", self.url, generation)
        self._forget_before(generation - 1)
        return self.claim

    def _holder(self, last_commit: LastCommit) -> Claim | None:
        """The newest claim; or, where the claim files are gone, who stands for the holder (a take-over case,
        never a fresh run): the writer of the newest commit, or, with no commit yet, whoever wrote metrics."""
        current = self.current()
        commit = last_commit()
        if current is None and commit is None and self._has_metrics():
            # A job trained here and its claim file is gone, before its first commit: watch it like any holder.
            log.warning("%s has metrics but no claim and no commit: the claim file of the job training there may "
                        "have been deleted", self.url)
            return Claim(0, {"job": "the job that wrote metrics.jsonl", "generation": 0})
        writer = commit[1] if commit else None
        generation = writer.get("generation") if isinstance(writer, dict) else None
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
            return current
        if current is not None and current.generation >= generation:
            return current
        log.warning("%s was last committed by job %s (generation %d, %s), whose claim file in %s is gone",
                    self.url, writer.get("job"), generation, commit[0], self.folder)
        return Claim(generation, {"job": writer.get("job"), "generation": generation, "timeout_s": writer.get("timeout_s")})

    def _check_may_take(self, current: Claim, last_commit: LastCommit) -> None:
        holder = current.record
        if holder.get("job") == self.job:
            return  # a new generation of this very job: restarts never wait
        if holder.get("released"):
            log.info("continuing %s after job %s, which released it", self.url, holder.get("job"))
            return
        if same_machine(holder):
            if ended_here(holder):  # an ordinary resume
                log.info("continuing %s after job %s, whose processes on this machine (%s) have ended", self.url,
                         holder.get("job"), pids(holder))
                return
            raise self._owned(current, "its processes on this machine are running")
        self._watch(current, last_commit)

    def _watch(self, current: Claim, last_commit: LastCommit) -> None:
        """Return once the holder's claim and the newest commit stood still for the holder's lease timeout,
        on this process's monotonic clock; raise RunOwnedError as soon as either changes (it is alive)."""
        timeout = _timeout_of(current.record, self.timeout_s)
        log.warning("%s is held by job %s on host %s: watching its claim for up to %.0f s (its lease timeout) to "
                    "tell whether it is alive", self.url, current.record.get("job"), current.record.get("host"), timeout)
        if not stood_still(lambda: (self._claim_bytes(), last_commit()), timeout):
            newest = self.current()
            if newest is not None and newest.generation == current.generation and newest.record.get("released"):
                log.info("taking over %s, released by job %s meanwhile", self.url, newest.record.get("job"))
                return
            raise self._owned(current, "it renewed its claim or committed while this job watched")
        log.warning("taking over %s from job %s on host %s: it has not renewed its claim for %.0f s (watched from "
                    "here; its lease timeout is %.0f s)", self.url, current.record.get("job"),
                    current.record.get("host"), timeout, timeout)

    def _owned(self, current: Claim, why: str) -> RunOwnedError:
        holder = current.record
        return RunOwnedError(
            f"{self.url} is in use by another job: {holder.get('job')} on host {holder.get('host', 'unknown')} "
            f"(pid {pids(holder) or 'unknown'}), holding it since {_when(holder.get('since'))}; {why}. "
            "Wait for that job to end or stop it, or give this one another snapshot.dir. (One torchrun job on "
            "several nodes: give every node the same --rdzv-id.)"
        )

    # -- holding -------------------------------------------------------------------------------

    def check(self) -> None:
        """The fence: LeaseLostError when a newer generation (of this or another job) claimed the run."""
        if self.claim is None:
            return
        newest = self.current()
        # Newer, or the same generation claimed by someone else (its file was deleted and claimed anew).
        if newest is not None and (newest.generation > self.claim.generation or
                                   (newest.generation == self.claim.generation and not self._ours(newest.record))):
            self.lost = True
            raise LeaseLostError(
                f"{self.url} was taken over by generation {newest.generation} (job {newest.record.get('job')} on "
                f"{newest.record.get('host')}) while this process held generation {self.claim.generation}; "
                "this process stops without writing or deleting anything there"
            )

    def _ours(self, record: dict) -> bool:
        return record.get("job") == self.job and record.get("since") == self.claim.record["since"]

    def renew(self, released: bool = False) -> None:
        """Say that the holder is alive (or, `released`, done); never writes over a newer generation."""
        self.check()
        self._beat += 1
        record = {**self.claim.record, "renewed": time.time(), "beat": self._beat, "released": released}
        if self.local:
            self.fs.makedirs(self.folder, exist_ok=True)  # owner/ may have been deleted under us
        replace_atomically(self.fs, self._path(self.claim.generation), _encode(record))

    def keep_alive(self) -> None:
        """Renew in a background thread every timeout_s / 4 until `release`; a lost lease sets `lost`."""
        self._beating = Beat(self._renew_quietly, max(0.2, self.timeout_s / 4), "run-lease")
        self._beating.start()

    def _renew_quietly(self) -> bool:
        try:
            self.renew()
        except LeaseLostError as e:
            log.error("%s", e)
            return False
        except Exception as e:  # a storage hiccup: the next renewal may get through
            log.warning("could not renew the claim on %s: %s: %s", self.url, type(e).__name__, redact(e))
        return True

    def release(self) -> None:
        """Stop renewing and mark the claim released, so that another job may start at once."""
        if self._beating is not None:
            self._beating.stop()
        if self.claim is None or self.lost:
            return
        try:
            self.renew(released=True)
        except Exception as e:  # the claim then expires by itself after timeout_s
            log.warning("could not release the claim on %s: %s", self.url, redact(e))

    def __enter__(self) -> "RunLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- storage -------------------------------------------------------------------------------

    def _record(self, generation: int, since: float) -> dict:
        processes = [os.getpid()]
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            processes.append(os.getppid())  # the torchrun agent: the job lives while it does
        return {"job": self.job, "generation": generation, **holder_record(processes), "since": since, "renewed": since,
                "beat": 0, "released": False, "timeout_s": self.timeout_s}

    def _path(self, generation: int) -> str:
        return f"{self.folder}/gen-{generation:09d}.json"

    def _generations(self) -> list[int]:
        self.fs.invalidate_cache(self.folder)
        try:
            names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.folder, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(m[1]) for m in map(_GEN.match, names) if m)

    def current(self) -> Claim | None:
        """The newest valid claim on the run (held, expired or released), or None when there is none.
        Entries of owner/ that are not claims (damaged, foreign, not files) are skipped."""
        for generation in reversed(self._generations()):
            record = self._read(generation)
            if record is not None:
                return Claim(generation, record)
        return None

    def _has_metrics(self) -> bool:
        try:
            info = self.fs.info(self.metrics)
        except OSError:
            return False
        return info.get("type") == "file" and info.get("size", 0) > 0

    def _claim_bytes(self) -> bytes | None:
        """The newest claim as stored, to tell whether it changes."""
        claim = self.current()
        return _encode(claim.record) if claim else None

    def _read(self, generation: int) -> dict | None:
        """The claim of `generation`, or None where there is none or the entry is not a valid claim."""
        path = self._path(generation)
        try:
            info = self.fs.info(path)
            if info.get("type") != "file" or not 0 < info.get("size", 0) <= _MAX_CLAIM_BYTES:
                return None
            record = json.loads(self.fs.cat_file(path))
        except (OSError, ValueError):  # gone meanwhile, unreadable, not JSON
            return None
        valid = isinstance(record, dict) and record.get("generation") == generation and isinstance(record.get("job"), str)
        return record if valid else None

    def _forget_before(self, generation: int) -> None:
        """Old generation files are history; the newest two are enough for the fence and for messages."""
        for old in self._generations():
            if old < generation:
                try:
                    self.fs.rm_file(self._path(old))
                except OSError:  # gone meanwhile, or not a file: left alone
                    pass


def describe(claim: Claim | None) -> str:
    """One line about who holds a run, for `mingpt-snapshot list`."""
    if claim is None:
        return "no job has claimed this run"
    r = claim.record
    state = "released" if r.get("released") else f"last renewed at {_when(r.get('renewed'))} by that host's clock"
    return f"claimed by job {r.get('job')} on host {r.get('host')} (generation {claim.generation}), {state}"


def _encode(record: dict) -> bytes:
    return json.dumps(record, indent=2).encode()


def _when(epoch) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(epoch)))
    except (TypeError, ValueError):
        return "an unknown time"


def _timeout_of(record: dict, default: float) -> float:
    """The holder's lease timeout, as its claim says; `default` where it says none or nonsense; at most
    an hour, or `default` where that is longer (a claim file may be hand-edited)."""
    try:
        timeout = float(record.get("timeout_s"))
    except (TypeError, ValueError):
        return default
    if not timeout >= 1:  # also NaN
        return default
    return min(timeout, max(default, _MAX_WATCH_S))

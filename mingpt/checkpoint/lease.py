"""Run ownership: one job at a time writes to a snapshot folder, so that two jobs started into one `snapshot.dir` by
mistake never delete each other's saves nor resume from each other's state (docs/snapshots.md, "Run ownership").

The claim itself (`<dir>/owner/gen-NNNNNNNNN.json`) is mingpt.claim's; this module decides whom the run may be taken
from, and what a commit says of its writer. Every manifest names the job and generation that wrote it, so the run's
history survives the loss of `owner/`. Every generation of one torchrun job shares its identity and takes over at once,
except in the other mode (restart or `--live`: the two never meet). A worker left over from an older generation finds a
newer generation file before it commits or deletes anything (`check`), and stops."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from mingpt.claim import Claim, Files, GenerationalClaim, ended_here, pids, same_machine, start_time, stood_still
from mingpt.errors import MinGPTError
from mingpt.jobenv import JobEnv
from mingpt.rundir import RunDir
from mingpt.storage import create_exclusive, redact, replace_atomically

log = logging.getLogger(__name__)


class RunOwnedError(MinGPTError):
    """Another job holds the run: this one must not write to it."""


class LeaseLostError(MinGPTError):
    """A newer generation or another job took the run over: this process must stop writing."""


@dataclass(frozen=True)
class Commit:
    """A commit as the lease judges it: folder name, step, and the writer its manifest names (another writer's word)."""

    name: str
    step: int
    writer: Any


def job_identity(job: JobEnv) -> str:
    """The same in every generation of this job's workers, different between jobs: torchrun's `--rdzv-id` (a fresh uuid
    with `--standalone`); its agent where that is "none" (right for one node); else this process."""
    if job.run_id and job.run_id != "none":
        return f"torchrun:{job.run_id}"
    if job.run_id == "none":
        return f"torchrun-agent:{socket.gethostname()}:{job.launcher}:{start_time(job.launcher)}"
    return f"process:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


RESTART, LIVE = "restart", "live"  # a job's modes: workers restarted on a change of membership, or live groups

_MAX_WATCH_S = 3600.0  # longest a claimant watches a silent holder, whatever its (hand-editable) claim names

LastCommit = Callable[[], "Commit | None"]  # the run's newest commit, or None


class RunLease:
    """The claim of one process (the leader of its generation) on the run under `path`."""

    def __init__(self, run: RunDir, timeout_s: float, job: str, mode: str = RESTART, launcher: int | None = None):
        self.run, self.url, self.timeout_s = run, run.url, timeout_s
        self.job, self.mode = job, mode  # job: its job_identity
        # The processes whose life is the claim's: this one, and the agent it lives with.
        self.pids = list(dict.fromkeys([os.getpid(), launcher or os.getpid()]))
        files = Files(run.fs, run.local, create_exclusive, replace_atomically, redact)
        self.claims = GenerationalClaim(files, run.owner, run.url, valid=lambda r: isinstance(r.get("job"), str))
        self._resumed = -1  # the step of the newest commit when this process claimed the run

    @property
    def claim(self) -> Claim | None:
        return self.claims.held

    @property
    def generation(self) -> int | None:
        return self.claim.generation if self.claim else None

    @property
    def lost(self) -> bool:
        return self.claims.lost

    @classmethod
    def following(cls, run: RunDir, claim: Claim) -> "RunLease":
        """The holder's `claim` for a process writing beside it (a shard): `check` fences it; nothing is renewed."""
        lease = cls(run, _timeout_of(claim.record, 60.0), claim.record.get("job"))
        lease.claims.held = claim
        return lease

    def acquire(self, last_commit: LastCommit = lambda: None) -> Claim:
        """Claim the run, or raise RunOwnedError naming its holder and what to do. `last_commit` gives the newest
        commit: where the claim files are gone its writer stands for the holder, and a holder that commits is alive."""
        before = last_commit()  # a commit after this one, at a step this job saves, is checked, never trusted
        try:
            claim = self.claims.take(lambda holder: self._may_take(holder, last_commit),
                                     fields={"job": self.job, "mode": self.mode, "timeout_s": self.timeout_s},
                                     pids=self.pids, newest=lambda: self._holder(last_commit))
        except FileExistsError:  # where owner/ should be
            raise RunOwnedError(f"{self.claims.folder} is not a folder: move it away, then run this again") from None
        if claim is None:
            raise RunOwnedError(f"could not claim {self.url}: other processes keep claiming it at the same time")
        self._resumed = before.step if before else -1
        log.info("this job holds %s (generation %d)", self.url, claim.generation)
        return claim

    def refuse_the_other_mode(self, last_commit: LastCommit = lambda: None) -> None:
        """Raise RunOwnedError where this job's id holds the run in the other mode, alive: a live node and a plain
        one of the same --rdzv-id never meet, so the second to come must not train on the run."""
        current = self._holder(last_commit)
        if current is not None and self._other_mode(current.record):
            self._may_take(current, last_commit)

    def _other_mode(self, holder: dict) -> bool:
        return holder.get("job") == self.job and holder.get("mode", self.mode) != self.mode

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
        writer = commit.writer if commit else None
        generation = writer.get("generation") if isinstance(writer, dict) else None
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
            return current
        if current is not None and current.generation >= generation:
            return current
        log.warning("%s was last committed by job %s (generation %d, %s), whose claim file in %s is gone",
                    self.url, writer.get("job"), generation, commit.name, self.claims.folder)
        return Claim(generation, {"job": writer.get("job"), "generation": generation, "timeout_s": writer.get("timeout_s")})

    def _may_take(self, current: Claim, last_commit: LastCommit) -> bool:
        """True where this job may take the run over from `current`; RunOwnedError where it may not."""
        holder = current.record
        if holder.get("job") == self.job and not self._other_mode(holder):
            return True  # a new generation of this very job: restarts never wait
        if holder.get("released"):
            log.info("continuing %s after job %s, which released it", self.url, holder.get("job"))
            return True
        if same_machine(holder):
            if ended_here(holder):  # an ordinary resume
                log.info("continuing %s after job %s, whose processes on this machine (%s) have ended", self.url,
                         holder.get("job"), pids(holder))
                return True
            raise self._owned(current, "its processes on this machine are running")
        self._watch(current, last_commit)
        return True

    def _watch(self, current: Claim, last_commit: LastCommit) -> None:
        """Return once the holder's claim and the newest commit stood still for the holder's lease timeout,
        on this process's monotonic clock; raise RunOwnedError as soon as either changes (it is alive)."""
        timeout = _timeout_of(current.record, self.timeout_s)
        log.warning("%s is held by job %s on host %s: watching its claim for up to %.0f s (its lease timeout) to "
                    "tell whether it is alive", self.url, current.record.get("job"), current.record.get("host"), timeout)
        state = lambda: (self.current(), last_commit())
        if not stood_still(state, state(), timeout):
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
        if self._other_mode(holder):
            job = self.job.removeprefix("torchrun:")
            start = "with --live" if holder.get("mode") == LIVE else "with --no-live"
            return RunOwnedError(
                f"job {job} runs in the {holder.get('mode')} mode ({self.url} is held by it on host "
                f"{holder.get('host', 'unknown')}, pid {pids(holder) or 'unknown'}; {why}): start this node {start}, "
                "or stop that job first")
        return RunOwnedError(
            f"{self.url} is in use by another job: {holder.get('job')} on host {holder.get('host', 'unknown')} "
            f"(pid {pids(holder) or 'unknown'}), holding it since {_when(holder.get('since'))}; {why}. "
            "Wait for that job to end or stop it, or give this one another snapshot.dir. (One torchrun job on "
            "several nodes: give every node the same --rdzv-id.)"
        )

    def check(self, found: Commit | None = None) -> None:
        """The fence before this process writes or deletes anything: LeaseLostError once a newer generation claimed the
        run, or where `found` (a commit at a step this job saves, newer than the one it resumed from) is another's."""
        if self.claim is None:
            return
        newer = self.claims.overtaken()
        if newer is not None:
            raise self._taken_over(newer)
        writer = found.writer if found is not None and isinstance(found.writer, dict) else {}
        if found is not None and found.step > self._resumed and writer.get("job") != self.job:
            self.claims.lost = True
            who = f"job {writer.get('job')} (generation {writer.get('generation')})" if writer else "an unknown writer"
            raise LeaseLostError(f"{self.run.url_of(found.name)} was committed by {who}, not by this job: another job "
                                 f"writes to {self.url}. This job stops without writing or deleting anything there; "
                                 "give one of the two jobs another snapshot.dir")

    def _taken_over(self, newer: Claim) -> LeaseLostError:
        return LeaseLostError(
            f"{self.url} was taken over by generation {newer.generation} (job {newer.record.get('job')} on "
            f"{newer.record.get('host')}) while this process held generation {self.claim.generation}; "
            "this process stops without writing or deleting anything there"
        )

    def writer(self) -> dict:
        """Who commits, for a manifest: the run's history, should the claim files go."""
        return {"job": self.job, "generation": self.generation, "timeout_s": self.timeout_s}

    def keep_alive(self) -> None:
        """Renew in a background thread every timeout_s / 4 until `release`; a lost lease sets `lost`."""
        self.claims.keep_alive(max(0.2, self.timeout_s / 4), self._say_taken_over)

    def _say_taken_over(self, newer: Claim) -> None:
        if newer.record.get("job") == self.job:  # the live mode's next writer: a hand-over within the job
            log.info("%s: generation %d of this job writes now", self.url, newer.generation)
        else:
            log.error("%s", self._taken_over(newer))

    def release(self) -> None:
        """Stop renewing and mark the claim released, so that another job may start at once."""
        self.claims.release()

    def __enter__(self) -> "RunLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def current(self) -> Claim | None:
        """The newest valid claim (held, expired or released) or None; entries that are not claims are skipped."""
        return self.claims.newest()

    def _has_metrics(self) -> bool:
        try:
            info = self.run.fs.info(self.run.metrics)
        except OSError:
            return False
        return info.get("type") == "file" and info.get("size", 0) > 0


def describe(claim: Claim | None) -> str:
    """One line about who holds a run, for `mingpt-snapshot list`."""
    if claim is None:
        return "no job has claimed this run"
    r = claim.record
    state = "released" if r.get("released") else f"last renewed at {_when(r.get('renewed'))} by that host's clock"
    return f"claimed by job {r.get('job')} on host {r.get('host')} (generation {claim.generation}), {state}"


def _when(epoch) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(epoch)))
    except (TypeError, ValueError):
        return "an unknown time"


def _timeout_of(record: dict, default: float) -> float:
    """The holder's timeout as its claim says (else `default`), at most max(`default`, an hour): claims are editable."""
    try:
        timeout = float(record.get("timeout_s"))
    except (TypeError, ValueError):
        return default
    if not timeout >= 1:  # also NaN
        return default
    return min(timeout, max(default, _MAX_WATCH_S))

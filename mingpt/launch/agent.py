"""torch's elastic agent, kept going through churn: what `mingpt-torchrun` runs on every node (docs/launching.md).

Restarts for a peer (jobenv.PEER_STOPPED, PEER_LOST) are free unless no step was made and the nodes stay the same (else
a script exiting 75 would restart for ever), and so are FREE_HANG_RESTARTS for a hang (mingpt.launch.watchdog). Rank
assignment waits at most RANKS_WAIT_S, and a failed round goes to the next; only a finished job closes the rendezvous
(JobFinished), and a peer node gone from the round restarts this node's workers. A store that answers late, while the
workers train, is waited for. A joining node restarts the workers only once they took a step, or after ADMIT_AFTER_S,
so that a stream of arrivals cannot keep them from ever stepping. Each agent tells its new workers what changed
(jobenv.MEMBERSHIP)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from datetime import timedelta

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousError, RendezvousHandler,
                                                  RendezvousTimeoutError)

from mingpt import torch_internals
from mingpt.errors import one_line
from mingpt.jobenv import MEMBERSHIP, MEMBERSHIP_EXITS, PROGRESS_DIR
from mingpt.launch.watchdog import Watchdog
from mingpt.torch_internals import ElasticAgent

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often an agent waiting in a round asks the store for news (torch: 1 s)
RANKS_WAIT_S = 10.0  # how long an agent waits for the ranks of a closed round (torch: the store's 60 s)
RANKS_SLICE_S = 2.0  # how often it checks, meanwhile, that every node of the round is still alive
LEAVE_S = 5.0  # how long a leaving agent tries to take itself out of the rendezvous
FREE_HANG_RESTARTS = 3  # restarts after a hang that do not use up --max-restarts
ADMIT_AFTER_S = 10.0  # how long a waiting node lets a new generation's workers try to take their first step


class JobFinished(Exception):
    """The job this node came to join has finished: its rendezvous is closed."""


class RestartsUsedUp(Exception):
    """Workers said another process had left or died, and none had: a failure, with no restart left."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def install() -> None:
    """Make torchrun's launcher start `Agent`, its rendezvous polling every POLL_S, once torch has their names."""
    torch_internals.check(sharded=False)
    torch_internals.launch_with_agent(Agent)
    torch_internals.poll_rendezvous_every(POLL_S)


STORE_RETRY_S = 5.0  # how often a rendezvous store that stopped answering is asked again


class Rendezvous:
    """torch's rendezvous handler, which only a finished job closes, and which can say who is in the round."""

    def __init__(self, handler: RendezvousHandler):
        self.handler = handler
        self.finished = False  # this node's workers all ended well: the job is done
        self.silent_since: float | None = None  # when the store stopped answering (monotonic), while it does not
        self.asked = 0.0
        self.may_admit = lambda: True  # whether a waiting node may restart the workers now (the agent's say)

    def __getattr__(self, name: str):  # the rest is torch's handler's
        return getattr(self.handler, name)

    def shutdown(self) -> bool:
        """torch's launcher calls this when its agent ends other than by a signal, closing the rendezvous for every
        node. A node that failed for good leaves it instead, and the others go on."""
        if self.finished:
            return self.handler.shutdown()
        self.leave()
        return False

    def num_nodes_waiting(self) -> int:
        """torch's agent asks this every monitor interval, and a store that does not answer would end it. The workers
        need the store only at the next restart, so they train on (said once, asked again every STORE_RETRY_S)."""
        now = time.monotonic()
        if self.silent_since is not None and now - self.asked < STORE_RETRY_S:
            return 0
        self.asked = now
        try:
            waiting = self.handler.num_nodes_waiting()
        except Exception as e:
            if self.silent_since is None:
                self.silent_since = now
                log.warning("mingpt-torchrun: the rendezvous store does not answer (%s); training goes on, but a "
                            "restart or a change of membership needs it back", one_line(e))
            return 0
        if self.silent_since is not None:
            log.warning("mingpt-torchrun: the rendezvous store answers again (after %.0f s)", now - self.silent_since)
            self.silent_since = None
        return waiting if waiting and self.may_admit() else 0

    def members(self) -> set[str] | None:
        """The nodes of the current round ("host_pid_n") still beating; None where the store does not answer."""
        try:
            return torch_internals.round_members(self.handler)
        except (RendezvousError, DistError) as e:  # no opinion
            log.debug("the rendezvous's members could not be read: %s", e)
            return None

    def leave(self) -> None:
        """Take this node out of the round (or the wait list) now, rather than when its heartbeats expire."""
        try:
            torch_internals.leave_round(self.handler, LEAVE_S)
        except (RendezvousError, DistError) as e:  # the others notice when the heartbeats expire
            log.debug("could not leave the rendezvous: %s", e)


class Agent(ElasticAgent):
    """torch's LocalElasticAgent that survives churn (see the module's description)."""

    def __init__(self, spec: WorkerSpec, *args, **kwargs):
        self.rdzv = spec.rdzv_handler = Rendezvous(spec.rdzv_handler)
        super().__init__(spec, *args, **kwargs)
        self._members: set[str] = set()  # the nodes of the round this node's workers run in
        self._cause: str | None = None  # why they are being restarted, and since when
        self._noticed = 0.0
        self.watchdog = Watchdog()
        os.environ[PROGRESS_DIR] = str(self.watchdog.folder)  # the workers inherit the agent's environment
        self._hung: set[int] = set()  # workers the watchdog ended
        self._free_hangs = FREE_HANG_RESTARTS
        self._unproven: int | None = None  # the exit status of a membership restart after no step, until a round
        self.rdzv.may_admit = self._may_admit
        self._started = 0.0  # when this generation's workers started (monotonic)
        self._stepped = False  # whether they took a step
        self._deferred = False  # whether a waiting node was told to wait for that

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super().run(role)
        except SignalException:  # this node leaves (its workers have saved): the others need not wait for it
            self.rdzv.leave()
            raise
        finally:
            self.watchdog.close()

    def monitor(self, worker_group: WorkerGroup) -> RunResult:
        result = super().monitor(worker_group)
        if result.state == WorkerState.SUCCEEDED:
            self.rdzv.finished = True
        elif result.state == WorkerState.FAILED:
            codes = sorted({failure.exitcode for failure in result.failures.values()})
            if self._hung & {failure.pid for failure in result.failures.values()} and self._free_hangs > 0:
                self._free_hangs -= 1  # the watchdog ended one (and torch the others): the hang is the cause
                self.give_back_a_restart()
                self._notice(self.watchdog.finding)
            elif set(codes) <= MEMBERSHIP_EXITS.keys():
                self.give_back_a_restart()  # a membership change is free
                self._notice(MEMBERSHIP_EXITS[codes[0]])
                pids = {failure.pid for failure in result.failures.values()} | set(self.worker_pids())
                if not any(mark.progressed for mark in self.watchdog.marks(sorted(pids)).values()):
                    self._unproven = codes[0]  # and no step since: the next round must show the change
            else:
                self._notice("failed: " + "; ".join(_failure(f) for f in sorted(result.failures.values(),
                                                                              key=lambda f: f.local_rank)))
        elif result.state == WorkerState.HEALTHY:
            self._hung |= set(self.watchdog.check(self.worker_pids()))
        if result.state == WorkerState.HEALTHY and self._members:
            gone = self._members - (self.rdzv.members() or self._members)
            if gone:
                self.give_back_a_restart()
                self._notice("gone from the rendezvous")
                log.info("mingpt-torchrun: %s left the rendezvous: restarting this node's workers",
                         ", ".join(_hosts(gone)))
                return RunResult(state=WorkerState.UNHEALTHY)
        return result

    def restart(self, worker_group: WorkerGroup) -> None:
        self._notice("a node is waiting to join")  # the one reason torch restarts healthy workers
        super().restart(worker_group)

    def rendezvous(self, worker_group: WorkerGroup) -> None:
        log.info("mingpt-torchrun: entering the rendezvous of job %s", self.rdzv.get_run_id())
        before = self._members or self.rdzv.members() or set()  # a newcomer: the round it comes to join
        while True:
            try:
                super().rendezvous(worker_group)
                break
            except RendezvousClosedError:
                raise JobFinished(f"job {self.rdzv.get_run_id()} has finished (its rendezvous is closed): there is "
                                  "nothing left to join. To start a new job, give it another --rdzv-id") from None
            except RendezvousTimeoutError:
                raise  # nobody came within join_timeout
            except (RendezvousError, DistError) as e:  # a node died in the middle of the round, say
                log.warning("mingpt-torchrun: a rendezvous round failed (%s); joining the next one", one_line(e))
        self._members = self.rdzv.members() or set()
        self._charge_an_unproven_restart(before)
        self._tell_workers(before)
        self.watchdog.new_generation()
        self._hung.clear()
        self._started, self._stepped, self._deferred = time.monotonic(), False, False
        log.info("mingpt-torchrun: this node is node %d of %d; starting its workers", worker_group.group_rank,
                 worker_group.group_world_size)

    def assign_ranks(self, store, group_rank: int, group_world_size: int, spec: WorkerSpec):
        # One agent dying here would make the others wait the store's whole timeout, then exit: wait in short slices
        # while every node is alive, at most RANKS_WAIT_S; then the error sends this agent into the next round.
        previous, deadline = store.timeout, time.monotonic() + RANKS_WAIT_S
        store.set_timeout(timedelta(seconds=RANKS_SLICE_S))
        try:
            while True:
                try:
                    return super().assign_ranks(store, group_rank, group_world_size, spec)
                except DistError:  # torch sets its keys again on each try: the same values
                    members = self.rdzv.members()
                    if time.monotonic() > deadline or (members is not None and len(members) < group_world_size):
                        raise
        finally:
            store.set_timeout(previous)

    def _may_admit(self) -> bool:
        """A node waits to join: restart the workers for it once they took a step, or after ADMIT_AFTER_S."""
        if not self._stepped:
            marks = self.watchdog.marks(self.worker_pids()).values()
            self._stepped = any(mark.progressed for mark in marks)
        if self._stepped or time.monotonic() - self._started > ADMIT_AFTER_S:
            return True
        if not self._deferred:
            self._deferred = True
            log.info("mingpt-torchrun: a node waits to join; it is let in once this generation's workers took a step "
                     "(at most %.0f s after they started)", ADMIT_AFTER_S)
        return False

    def _charge_an_unproven_restart(self, before: set[str]) -> None:
        """A membership restart after no step, into a round of the same nodes, uses up one of --max-restarts."""
        status, self._unproven = self._unproven, None
        if status is None or self._members != before:
            return
        if self.restarts_left == 0:
            raise RestartsUsedUp(f"the workers exited {status}, which says another process was "
                                 f"{MEMBERSHIP_EXITS[status].split(' (')[0]}, but they did no step and no node left "
                                 f"or joined: a failure, and --max-restarts={self._worker_group.spec.max_restarts} "
                                 "is used up", status)
        self.use_a_restart()
        self._cause = f"exited {status} with no step done and no change of membership: a failure"

    def _notice(self, cause: str) -> None:
        if self._cause is None:
            self._cause, self._noticed = cause, time.time()

    def _tell_workers(self, before: set[str]) -> None:
        now = self._members
        change = {"left": _hosts(before - now), "joined": _hosts(now - before) if before else [],
                  "members": _hosts(now), "cause": self._cause, "noticed": self._noticed or time.time()}
        os.environ[MEMBERSHIP] = json.dumps(change)  # the workers inherit the agent's environment
        self._cause, self._noticed = None, 0.0


def _failure(failure) -> str:
    """A worker's end in words: host, pid, signal or exit status, and its error file's first line."""
    how = f"exit {failure.exitcode}"
    if failure.exitcode < 0:
        try:
            how = signal.Signals(-failure.exitcode).name
        except ValueError:
            pass
    said = (failure.message or "").strip().splitlines() if os.path.isfile(failure.error_file) else []
    return f"{socket.gethostname()} pid {failure.pid} ({how}{': ' + said[0] if said else ''})"


def _hosts(nodes: set[str]) -> list[str]:
    """torch's node names ("host_pid_n") as "host (agent pid)"."""
    named = []
    for node in sorted(nodes):
        host, pid, _ = (node.rsplit("_", 2) + ["", ""])[:3]
        named.append(f"{host} (agent {pid})" if pid else node)
    return named

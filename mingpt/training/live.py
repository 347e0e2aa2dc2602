"""The live mode (`mingpt-torchrun --live`): a node's death or arrival restarts nobody else.

Each node is one torchft replica group: its own torchrun with K workers, which hold the whole model
(ddp) or shard it among themselves (hsdp); across groups the model is replicated, each worker exchanging
with the worker of its place in every other group (so every node runs as many). torchft's Manager, in
every worker, forms a quorum of the groups at every step through the Lighthouse that mingpt-rendezvous
serves, reconfigures the cross-group process group in place when the quorum changes, heals a group
that is behind from a live peer (mingpt.training.healing), and votes on every step: a step that failed
anywhere (a group died mid-collective) is not committed, and is done again with the same samples by the
quorum that follows.

The step's protocol, as `LiveAgreement` (the live counterpart of agreement.StepAgreement):
1. quorum (`begin`): who takes part in this step, and this process's place among them. The global batch
   is split by that place (the group's position in the quorum, then the worker's within its group), so
   step s trains the same samples whichever groups commit it;
2. exchange: the gradients, averaged over every process of the step (within the group, by FSDP's
   reduce-scatter where sharded, then across groups on torchft's process group), and the step's numbers:
   its loss, this group's stops (a group asked to stop leaves; the others go on), whether the writer's
   saves keep failing, and the writer's lease generation (which marks the memory tiers' copies);
3. commit (`should_commit`): only a committed step updates the weights and advances the data.

The group in the quorum's first position writes the snapshots and metrics (the writer). Groups are
named by the order they joined the job (a counter in the rendezvous store), and torchft orders the
quorum by name, so the writer changes when the writer's group leaves (or, for a while, when the quorum
forms anew without it), and the writer of the moment holds the run's lease.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from mingpt.errors import ConfigError, DataError, TrainingError, one_line
from mingpt.training.agreement import Outcome, Share
from mingpt.training.distributed import World, peer_lost

if TYPE_CHECKING:  # FSDP's modules: the launcher, which reads this module's names, need not import them
    from mingpt.training.parallel import Topology

log = logging.getLogger(__name__)

# Every timeout of the live mode, in one place.
HEARTBEAT_TIMEOUT_MS = 1000  # Lighthouse: a group silent this long is left out of the next quorum
JOIN_TIMEOUT_MS = 1000  # Lighthouse: how long a quorum waits for live groups that have not asked yet
QUORUM_TICK_MS = 100  # Lighthouse: how often it looks whether a quorum can form
COLLECTIVE_TIMEOUT_S = 10.0  # a cross-group collective, a heal's transfer (Manager's timeout)
# The commit vote, which waits for every process of the group. Longer than a collective's timeout: when a group
# dies mid-step, one process may learn it at once (a refused connection) and another only when its collective
# times out, so they reach the vote up to a collective's timeout apart.
COMMIT_TIMEOUT_S = 3 * COLLECTIVE_TIMEOUT_S
# Forming a quorum: past it, the Lighthouse is taken for lost, and the group meets it again under a new Manager.
# Longer than a collective's timeout: a live group may still be in a collective that times out on the dead one,
# and a group that left for a new Manager meanwhile leaves the quorum an address that no longer answers.
QUORUM_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 10.0  # reaching the Lighthouse or another group's manager
LIGHTHOUSE_WAIT_S = 300.0  # how long a lost Lighthouse is waited for (mingpt-rendezvous restarting)

# What mingpt-torchrun --live tells the workers of its node.
LIGHTHOUSE = "MINGPT_LIVE_LIGHTHOUSE"  # the Lighthouse's address (http://host:port)
RENDEZVOUS = "MINGPT_LIVE_RENDEZVOUS"  # the store of mingpt-rendezvous (host:port), which numbers the groups
HOST = "MINGPT_LIVE_HOST"  # the address other nodes reach this one at
MIN_NODES = "MINGPT_LIVE_MIN_NODES"  # the fewest groups that may commit a step (--nnodes's MIN)

LIGHTHOUSE_KEY = "mingpt/lighthouse"  # the key under which mingpt-rendezvous publishes the Lighthouse's address
STATE_KEY = "mingpt"  # the name of the run's state among what torchft sends a healing group
JOINS_KEY = "mingpt/live/joins/"  # + job id: the counter that names groups in the order they join
HEALERS_KEY = "mingpt/live/healers/"  # + job id / local rank: the addresses groups serve their state at
DATA_KEY = "mingpt/live/data/"  # + job id: the fingerprint of the prepared data of the job's first group
LAYOUT_KEY = "mingpt/live/layout/"  # + job id: the workers per group and the parallelism of the job's first group


def enabled() -> bool:
    return bool(os.environ.get(LIGHTHOUSE))


@dataclass
class Settings:
    lighthouse: str
    rendezvous: str
    host: str
    min_nodes: int

    @classmethod
    def from_environment(cls) -> "Settings":
        try:
            return cls(os.environ[LIGHTHOUSE], os.environ[RENDEZVOUS], os.environ[HOST], int(os.environ[MIN_NODES]))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"the live mode's variables are incomplete ({e}): start live jobs with "
                              "mingpt-torchrun --live") from None


def group_name(world: World, rendezvous: dist.Store) -> str:
    """This group's name in the quorum, the same in each of its workers: its place in the order in which the
    job's groups (and their restarts) met torchft, then its host and agent. torchft orders a quorum by name,
    so the first position, the writer's, stays with the oldest group until it leaves."""
    name = None
    if world.rank == 0:
        joined = rendezvous.add(JOINS_KEY + os.environ.get("TORCHELASTIC_RUN_ID", ""), 1)
        name = f"{joined:09d}-{socket.gethostname()}-{os.getppid()}"
    if world.distributed:
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return name


class LiveAgreement:
    """This process's part in the live step protocol (see the module's description)."""

    def __init__(self, topology: Topology, replica, checkpointer, global_batch_size: int,
                 state: Callable[[], dict], load: Callable[[dict], None]):
        # torchft logs each failed collective with its traceback, and each reconfiguration; this module says
        # in a line when steps stop and start counting.
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        self.settings = Settings.from_environment()
        world, self.sharded = topology.world, topology.sharded
        self.world, self.replica, self.checkpointer = world, replica, checkpointer
        self.global_batch_size, self.state, self.load = global_batch_size, state, load
        host, port = self.settings.rendezvous.rsplit(":", 1)
        self.rendezvous = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                        timeout=timedelta(seconds=CONNECT_TIMEOUT_S))
        self.healers = f"{HEALERS_KEY}{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{world.rank}"
        self._check_data(checkpointer.data_fingerprint)
        self._check_layout(f"{world.world_size} worker(s) per node, {topology.mode}")
        self.name = group_name(world, self.rendezvous)
        self.manager = self._new_manager()
        self.min_groups = self.settings.min_nodes
        self.position: int | None = None  # this group's place in the step's quorum
        self.groups = 0  # groups in the step's quorum
        self.failed_since: float | None = None  # when steps stopped being committed (monotonic), while they are
        self.counted = 0  # the groups of the last committed step (0: none yet)

    def _check_data(self, fingerprint: str) -> None:
        """Every group trains on the job's data, the first group's: a group that comes with other data (a node
        started with another corpus) is refused in one line."""
        job_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        job = self.rendezvous.compare_set(DATA_KEY + job_id, "", fingerprint).decode()
        if job != fingerprint:
            raise DataError(f"this node's prepared data (fingerprint {fingerprint[:12]}) is not that of live job "
                            f"{job_id} (fingerprint {job[:12]}, as its first node prepared it): start every node of a "
                            "job with the same data settings and corpus; to train on other data, start another job "
                            "(another --rdzv-id)")

    def _check_layout(self, layout: str) -> None:
        """Each process exchanges gradients with, and heals from, the process of its place in the other groups:
        a group with another number of workers, or that splits the model otherwise, is refused in one line."""
        job_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        job = self.rendezvous.compare_set(LAYOUT_KEY + job_id, "", layout).decode()
        if job != layout:
            raise ConfigError(f"this node runs {layout}, where live job {job_id} runs {job} (as its first node "
                              "started): start every node of a job with the same --nproc-per-node and "
                              "trainer.parallelism")

    def _new_manager(self):
        """torchft's Manager for this worker, on a store of the group's own that its first worker hosts: a new
        one for each Manager, so that no key an earlier quorum left there is read again."""
        # Imported in live jobs only: torchft takes a second to import, and starts threads of its own.
        from torchft import Manager, ProcessGroupGloo

        from mingpt.training.healing import VerifiedTransport

        port = None
        if self.world.rank == 0:
            self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            port = self._store.port
        if self.world.distributed:
            box = [port]
            dist.broadcast_object_list(box, src=0)
            port = box[0]
        timeout, settings = timedelta(seconds=COLLECTIVE_TIMEOUT_S), self.settings
        self.transport = VerifiedTransport(settings.host, timeout, self._peers)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=settings.min_nodes, use_async_quorum=False, timeout=timeout,
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S), connect_timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
            rank=self.world.rank, world_size=self.world.world_size, store_addr=settings.host, store_port=port,
            lighthouse_addr=settings.lighthouse, replica_id=self.name, hostname=settings.host,
            init_sync=False,  # every group starts from the same seeded weights: nothing to send at step 0
            checkpoint_transport=self.transport)
        manager.register_state_dict_fn(STATE_KEY, self.load, self.state)
        try:  # where a healer whose source sent a damaged state finds this one
            self.rendezvous.append(self.healers, self.transport.metadata() + " ")
        except Exception as e:  # mingpt-rendezvous restarting: healers ask the source torchft chose only
            log.debug("could not publish this group's healing address: %s", e)
        return manager

    def _peers(self) -> list[str]:
        """The addresses every group of the job (that of this worker's local rank) has served its state at."""
        try:
            return self.rendezvous.get(self.healers).decode().split()
        except Exception:  # none published yet, or mingpt-rendezvous restarting
            return []

    @property
    def writes(self) -> bool:
        """Whether this group writes the run's snapshots and metrics: the first in the quorum."""
        return self.position == 0

    def resumed_at(self, step: int, samples_seen: int) -> None:
        """The state loaded at start (a memory tier, a snapshot) is at `step`: the quorum heals whoever is behind."""
        self.manager.load_state_dict({"step": step, "batches_committed": samples_seen})

    def begin(self) -> Share:
        """The step's quorum: heals this group where it is behind, then says where this process stands."""
        while True:
            try:
                self.manager.start_quorum()
                break
            except Exception as e:  # the Lighthouse stopped answering (TimeoutError, or a refused connection)
                self._meet_again(e)
        # Until the vote, this group's state is that of the step: a healer whose source failed it may ask here.
        # Made here, on the training thread, and read by the transport's: FSDP's state-dict hooks swap the
        # model's parameters, which a forward pass must not see. Not before the first step: no group heals
        # to step 0, and the state-dict API would make the optimizer's state by taking a step.
        step = self.manager.current_step()
        if step > 0:
            offered = {"user": {STATE_KEY: self.state()}, "torchft": self.manager.state_dict()}
            self.transport.offer(step, lambda: offered)
        self.position, self.groups = self.manager.participating_rank(), self.manager.num_participants()
        if self.position is None or self.groups < self.min_groups:  # a step that cannot count: nothing to compute
            return Share(0, 0)
        per_group = self.world.world_size
        return Share(self.position * per_group + self.world.rank, self.groups * per_group)

    def exchange(self, loss_sum: float, stop_requested: bool) -> Outcome:
        """The gradients, averaged over every process of the step, and the step's numbers; then the vote.
        A stop concerns this group alone: it leaves, and the others go on."""
        params = [p for p in self.replica.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # no share of this step: nothing to add, but the exchange needs every process
                p.grad = torch.zeros_like(p)
        # hsdp: this process's shard of each gradient, which FSDP has averaged over the group already.
        grads = [p.grad.to_local() if self.sharded else p.grad for p in params]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        # A lease lost to another group of the job is taken back by the writer (Checkpointer.hold_the_run); one
        # lost to another job stops the writer's group there, when it claims the run again.
        saves_failing, _ = self.checkpointer.problems()
        numbers = torch.tensor([loss_sum, float(stop_requested), float(saves_failing)], dtype=torch.float64)
        generation = torch.tensor([float(self.checkpointer.lease_generation() or 0)], dtype=torch.float64)
        if self.world.distributed:  # within the group first
            if not self.sharded:
                dist.all_reduce(flat)
                flat /= self.world.world_size
            dist.all_reduce(numbers)
            dist.all_reduce(generation, op=dist.ReduceOp.MAX)
        stops = int(numbers[1])
        self.manager.allreduce(flat).wait()  # the mean over the step's groups
        self.manager.allreduce(numbers, reduce_op=dist.ReduceOp.SUM).wait()
        # The newest lease (while the writer changes hands, the old one may not have let go yet).
        self.manager.allreduce(generation, reduce_op=dist.ReduceOp.MAX).wait()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        committed = self._vote()
        self._say_what_changed(committed)
        loss, _, failing = numbers.tolist()
        return Outcome(loss / self.global_batch_size, stops, failing > 0, False, committed, int(generation))

    def _vote(self) -> bool:
        """Whether the step is committed: every process of every group of the step succeeded."""
        try:
            return self.manager.should_commit(timeout=timedelta(seconds=COMMIT_TIMEOUT_S))
        except TimeoutError as e:  # a process of this group never voted: it died or hangs
            raise peer_lost(e) from e

    def _meet_again(self, error: Exception) -> None:
        """The Lighthouse did not answer for a quorum: it stopped, or restarts. Meet it again, as the same group
        under a new Manager (torchft keeps no quorum of the Lighthouse it lost), for up to LIGHTHOUSE_WAIT_S."""
        log.warning("live: the Lighthouse at %s does not answer (%s); meeting it again", self.settings.lighthouse,
                    one_line(error))
        self.manager.shutdown(wait=False)
        deadline = time.monotonic() + LIGHTHOUSE_WAIT_S
        while True:
            try:
                self.manager = self._new_manager()
                break
            except Exception as e:
                if time.monotonic() > deadline:
                    raise TrainingError(
                        f"the Lighthouse at {self.settings.lighthouse} has not answered for {LIGHTHOUSE_WAIT_S:.0f} "
                        f"s ({one_line(e)}); start mingpt-rendezvous again with the same ports, then this command "
                        "resumes the job") from None
                time.sleep(1)
        state = self.replica.state
        self.resumed_at(state.step, state.samples_seen)
        log.info("live: met the Lighthouse again")

    def _say_what_changed(self, committed: bool) -> None:
        """One line (from the first worker of each group) when this group takes part for the first time, when
        the number of groups changes, when steps stop being committed (why), and when they are again."""
        if self.world.rank != 0:
            return
        step = self.manager.current_step()  # after a commit: the step just committed
        if committed and self.counted == 0:
            log.info("live: this group takes part from step %d, at position %d of %d group(s)", step, self.position,
                     self.groups)
        elif committed and self.groups != self.counted:
            log.info("live: %d group(s) from step %d (were %d); this one at position %d", self.groups, step,
                     self.counted, self.position)
        if committed:
            self.counted = self.groups
        now = time.monotonic()
        if not committed and self.failed_since is None:
            self.failed_since = now
            error = self.manager.errored()
            why = f"{self.groups} group(s), fewer than --nnodes's {self.min_groups}" if self.groups < self.min_groups \
                else one_line(error.original_exception) if error else "another group could not take part"
            log.warning("live: step %d was not committed (%s); it is done again with the next quorum",
                        self.manager.current_step() + 1, why)
        elif committed and self.failed_since is not None:
            log.info("live: steps are committed again, by %d group(s), after %.1f s", self.groups,
                     now - self.failed_since)
            self.failed_since = None

    def enforce(self, outcome: Outcome) -> None:
        self.checkpointer.stop_on(outcome.saves_failing, outcome.run_lost)

    def close(self) -> None:
        self.manager.shutdown(wait=False)

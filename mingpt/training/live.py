"""The live mode (mingpt-torchrun's, wherever mingpt-rendezvous serves the job): a node's death or arrival restarts
nobody else.

Each replica of the model is one torchft replica group: under ddp each process (so a node of any size holds as many),
under hsdp each node (its own torchrun, sharding within). torchft's Manager forms a quorum of the groups at every step
through the Lighthouse that mingpt-rendezvous serves, heals a group that is behind from a live peer
(mingpt.training.healing), and votes: a step that failed anywhere is not committed, and is done again with the same
samples (the global batch is split by each process's place in the quorum). `LiveAgreement` is the step's protocol;
docs/ARCHITECTURE.md walks through it. The job's checks and the choice of the writer (the node of the group that has
taken part longest) live in every quorum, not in mingpt-rendezvous's store, which keeps nothing when it restarts."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import DistError

from mingpt.errors import ConfigError, DataError, MinGPTError, TrainingError, one_line
from mingpt.training.agreement import Outcome, Share
from mingpt.training.config import OPTIMIZERS
from mingpt.training.distributed import World, peer_lost
from mingpt.training.parallel import Topology

log = logging.getLogger(__name__)

# Every timeout of the live mode (the Lighthouse's own are in mingpt.jobenv).
COLLECTIVE_TIMEOUT_S = 10.0  # a cross-group collective, a heal's transfer (Manager's timeout)
# The commit vote, which waits for every process of the group. Longer than a collective's timeout: when a group dies
# mid-step, one process may learn it at once and another only when its collective times out.
COMMIT_TIMEOUT_S = 3 * COLLECTIVE_TIMEOUT_S
# Forming a quorum: past it, the Lighthouse is taken for lost and met again under a new Manager. Longer than a
# collective's timeout: a live group may still be in a collective that times out on the dead one.
QUORUM_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 10.0  # reaching the Lighthouse or another group's manager
LIGHTHOUSE_WAIT_S = 300.0  # how long a lost Lighthouse is waited for (mingpt-rendezvous restarting)

STATE_KEY = "mingpt"  # the name of the run's state among what torchft sends a healing group
HEALERS_KEY = "mingpt/live/healers/"  # + job id / rank in the group: the addresses groups serve their state at


def node_name(world: World) -> str:
    """This node's name: its host and agent, as its first process sees them."""
    name = f"{socket.gethostname()}-{os.getppid()}"
    if world.distributed:
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return name


def number(text: str) -> int:
    """`text` as a number of the step's table: 48 bits of its sha256 (exact in float64)."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)


# The step's table: one row per group of the quorum, in float64 (whole numbers below 2**53 stay exact in a sum).
LOSS, STOPS, FAILING, LEASE = range(4)  # the step's numbers (LEASE: the writer's lease generation, 0 elsewhere)
CREDENTIALS = slice(4, 7)  # what makes the group one of the job (`credentials`)
SINCE = 7  # the first step the group committed (NEVER: none yet)
KEEPS_THE_RUN = 8  # 1 where the group's data is that of the snapshot it resumed from (or it resumed from none)
SPLIT_HELD = 9  # 1 where the group split the step's samples by the quorum that formed
NODE = 10  # the group's node (`number` of its name): the writer's node writes, and --nnodes's minimum counts nodes
COLUMNS = 11
NEVER = float(2**52)
MODES = ("ddp", "hsdp")  # the layouts' modes, by their number


def credentials(job_id: str, data_fingerprint: str, workers: int, mode: str, optimizer: str = "adamw") \
        -> tuple[int, int, int]:
    """What every group of a live job shares: its job's id, its data's fingerprint (48 bits each), its layout (its
    processes, the mode, and the optimizer: groups that stepped with different ones would hold different weights, and
    never say so)."""
    layout = (workers * len(MODES) + MODES.index(mode)) * len(OPTIMIZERS) + OPTIMIZERS.index(optimizer)
    return number(job_id), int(data_fingerprint[:12], 16), layout


def describe_layout(number: int) -> str:
    placement, optimizer = divmod(number, len(OPTIMIZERS))
    workers, mode = divmod(placement, len(MODES))
    per_node = f"{workers} worker(s) per node, " if MODES[mode] == "hsdp" else ""  # (ddp: any)
    return f"{per_node}{MODES[mode]}, {OPTIMIZERS[optimizer]}"


def misfit(mine: Sequence[float], job: Sequence[float], job_id: str) -> MinGPTError | None:
    """Why a group of credentials `mine` is not of live job `job_id`, whose longest member's are `job`; None: it is."""
    (my_job, my_data, my_layout), (its_job, its_data, its_layout) = (map(int, mine), map(int, job))
    if my_job != its_job:
        return ConfigError(f"another live job trains on the Lighthouse this node met, not job {job_id}: one "
                           "mingpt-rendezvous serves one live job; start another one (other --port and "
                           "--lighthouse-port) for this job")
    if my_data != its_data:
        return DataError(f"this node's prepared data (fingerprint {my_data:012x}) is not that of live job {job_id} "
                         f"(fingerprint {its_data:012x}, as the node longest in the job prepared it): start every node "
                         "of a job with the same data settings and corpus; to train on other data, start another job "
                         "(another --rdzv-id)")
    if my_layout != its_layout:
        return ConfigError(f"this node runs {describe_layout(my_layout)}, where live job {job_id} runs "
                           f"{describe_layout(its_layout)} (as the node longest in the job does): start every node of "
                           "a job with the same trainer.parallelism and trainer.optimizer, and under hsdp the same "
                           "--nproc-per-node")
    return None


class QuorumMoved(RuntimeError):
    """A group split the step's samples by a quorum that no longer held once the step's quorum formed."""


class TooFewNodes(RuntimeError):
    """The step's groups are on fewer nodes than --nnodes's minimum."""


def eldest(table: list[list[float]]) -> int:
    """The position of the group the job's credentials are taken from: the one that has committed steps the longest;
    else one whose data is the run's (not one of another corpus that resumed from the run's snapshot); ties: by node
    (so that the writing stays on one node while its groups come and go), then first."""
    return min(range(len(table)), key=lambda position: (table[position][SINCE], -table[position][KEEPS_THE_RUN],
                                                         table[position][NODE], position))


class LiveAgreement:
    """This process's part in the live step protocol (see the module's description)."""

    def __init__(self, topology: Topology, replica, checkpointer, global_batch_size: int,
                 state: Callable[[], dict], load: Callable[[dict], None]):
        """`start` joins the job."""
        world, self.mode = topology.world, topology.mode
        # A group holds one replica: under hsdp a node's processes share one; under ddp each process holds its own.
        self.group_rank, self.group_size = (world.rank, world.world_size) if self.mode == "hsdp" else (0, 1)
        self.settings = world.job.live
        self.world, self.replica, self.checkpointer = world, replica, checkpointer
        self.global_batch_size, self.state, self.load = global_batch_size, state, load
        self.job_id = world.job.run_id or ""
        self.healers = f"{HEALERS_KEY}{self.job_id}/{self.group_rank}"
        self.min_nodes = self.settings.min_nodes
        self.position: int | None = None  # this group's place in the step's quorum
        self.groups = 0  # groups in the step's quorum
        self.split: tuple[int | None, int] | None = None  # the (position, groups) the step's samples were split by
        self.committed_quorum: tuple[int | None, int] | None = None  # the last step's, where it was committed
        self.quorum_error: Exception | None = None  # why the step's quorum failed to form (the Lighthouse is lost)
        self.offered: dict | None = None  # what a healer receives from this group during the step (`begin`)
        self.since: int | None = None  # the first step this group committed
        self.keeps_the_run = True  # its data is that of the snapshot it resumed from (resumed_at)
        self.writes = False  # whether this group writes the run's snapshots and metrics (as of the last table)
        self.failed_since: float | None = None  # when steps stopped being committed (monotonic), while they are
        self.counted = 0  # the groups of the last committed step (0: none yet)

    def start(self) -> LiveAgreement:
        # torchft logs each failed collective with its traceback; this module says in a line when steps stop counting.
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        host, port = self.settings.rendezvous.rsplit(":", 1)
        self.rendezvous = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                        timeout=timedelta(seconds=CONNECT_TIMEOUT_S))
        # Checked in every step's table, and against the state a peer sends this group to heal.
        self.credentials = credentials(self.job_id, self.checkpointer.data_fingerprint, self.group_size,
                                       self.mode, self.checkpointer.cfg.trainer.optimizer)
        # A group's name: its node's, and under ddp its process's (torchft adds a uuid: a restarted group is a new one).
        node = node_name(self.world)
        self.name = node if self.group_size > 1 else f"{node}-{os.getpid()}"
        self.node = float(number(node))
        self.manager = self._new_manager()
        return self

    def _new_manager(self):
        """torchft's Manager, on a new store of the group's own, so that no key an earlier quorum left is read again."""
        # Imported in live jobs only: torchft takes a second to import, and starts threads of its own.
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        from mingpt.training.healing import VerifiedTransport

        port = None
        if self.group_rank == 0:
            self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            port = self._store.port
        if self.group_size > 1:
            box = [port]
            dist.broadcast_object_list(box, src=0)
            port = box[0]
        timeout, settings = timedelta(seconds=COLLECTIVE_TIMEOUT_S), self.settings
        self.transport = VerifiedTransport(settings.host, timeout, self._peers)
        # The groups' process group, which every quorum reconfigures; `average` and the table use it directly.
        cuda = self.world.device.type == "cuda"
        self.process_group = (ProcessGroupNCCL if cuda else ProcessGroupGloo)(timeout=timeout)
        manager = Manager(
            pg=self.process_group,
            load_state_dict=None, state_dict=None,
            min_replica_size=settings.min_nodes, use_async_quorum=True, timeout=timeout,
            quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S), connect_timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
            rank=self.group_rank, world_size=self.group_size, store_addr=settings.host, store_port=port,
            lighthouse_addr=settings.lighthouse, replica_id=self.name, hostname=settings.host,
            init_sync=False,  # every group starts from the same seeded weights: nothing to send at step 0
            checkpoint_transport=self.transport)
        if self.group_size == 1:
            manager._client = LoneVoter(manager._client)
        manager.register_state_dict_fn(STATE_KEY, self._heal, lambda: self.offered)
        try:  # where a healer whose source sent a damaged state finds this one
            self.rendezvous.append(self.healers, self.transport.metadata() + " ")
        except (DistError, OSError) as e:  # mingpt-rendezvous restarting: healers ask the source torchft chose only
            log.warning("live: this group's healing address is not published (mingpt-rendezvous's store: %s): a "
                        "group that heals asks only the source torchft chose", one_line(e))
        return manager

    def _peers(self) -> list[str]:
        """The addresses the job's groups serve their state at; none where mingpt-rendezvous's store cannot say."""
        try:
            if self.rendezvous.check([self.healers]):
                return self.rendezvous.get(self.healers).decode().split()
            why = "none has published its address (mingpt-rendezvous restarted since)"
        except (DistError, OSError) as e:  # mingpt-rendezvous stopped or restarting
            why = f"mingpt-rendezvous's store does not answer ({one_line(e)})"
        log.warning("healing: no other group is asked for a sound state: %s", why)
        return []

    def _heal(self, received: dict) -> None:
        """Load what a live peer sent once its credentials show this job's; else this group leaves before they mix."""
        theirs = received.pop("credentials")
        if (why := misfit(self.credentials, theirs, self.job_id)) is not None:
            raise why
        self.load(received)

    def resumed_at(self, step: int, samples_seen: int) -> None:
        """The state loaded at start (a memory tier, a snapshot) is at `step`: the quorum heals whoever is behind."""
        self.manager.load_state_dict({"step": step, "batches_committed": samples_seen})
        self.keeps_the_run = self.checkpointer.resumed_data in (None, self.checkpointer.data_fingerprint)

    def begin(self) -> Share:
        """Starts the step's quorum, and says where this process stands: by the last committed step's quorum, or where
        there is none (the first step, or one after a step that was not committed) by this one, once formed."""
        if self.quorum_error is not None:
            error, self.quorum_error = self.quorum_error, None
            self._meet_again(error)
        # What a group that heals from this one receives until the vote. Made here, on the training thread: FSDP's
        # state-dict hooks swap the model's parameters, which a forward pass must not see. Not at step 0: no group heals
        # to it, and the state-dict API would make the optimizer's state by taking a step.
        step = self.manager.current_step()
        if step > 0:
            self.offered = {**self.state(), "credentials": list(self.credentials)}
            offered = {"user": {STATE_KEY: self.offered}, "torchft": self.manager.state_dict()}
            self.transport.offer(step, lambda: offered)
        while True:
            try:
                self.manager.start_quorum()
                if self.committed_quorum is None:
                    self.manager.wait_quorum()
                break
            except Exception as e:  # the Lighthouse stopped answering (TimeoutError, or a refused connection)
                self._meet_again(e)
        self.split = self.committed_quorum or (self.manager.participating_rank(), self.manager.num_participants())
        position, groups = self.split
        if position is None or groups < self.min_nodes:  # a step that cannot count: nothing to add to it
            return Share(0, 0)
        return Share(position * self.group_size + self.group_rank, groups * self.group_size)

    def _quorum_formed(self) -> bool:
        """Waits for the step's quorum; where it failed to form, the step fails (the next meets the Lighthouse anew)."""
        if self.quorum_error is None:
            try:
                self.manager.wait_quorum()
                return True
            except Exception as e:
                self.quorum_error = e
                self.manager.report_error(e)
        return False

    def average(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """`tensor` averaged across the step's groups in place, in flight while this thread goes on: ddp's buckets of
        gradients as the backward pass hands them over (DDP waits for them all before the optimizer runs), hsdp's
        gradient shards once FSDP's reduce-scatter averaged them over the group. A group that heals adds nothing, and
        receives the average. Once the step failed anywhere, `tensor` as it is: the step is not committed."""
        if not self._quorum_formed() or self.manager.errored() is not None:
            return _done(tensor)
        if not self.manager.is_participating():
            tensor.zero_()
        groups = self.manager.num_participants()
        return self._sum(tensor, lambda summed: summed.div_(groups))

    def _sum(self, tensor: torch.Tensor, then: Callable[[torch.Tensor], torch.Tensor] = lambda summed: summed) \
            -> torch.futures.Future[torch.Tensor]:
        """`tensor` summed across the step's groups, then `then`. A failure (a group left since the quorum formed) fails
        the step, and leaves `tensor` as it was. Not torchft's Manager.allreduce: it times each collective on a thread
        of its own, where the process group times out on its own (Gloo's timeout; torchft's NCCL aborts)."""
        def settled(summed: torch.futures.Future) -> torch.Tensor:
            try:
                summed.value()
            except Exception as e:
                self.manager.report_error(e)
                return tensor
            return then(tensor)

        try:
            return self.process_group.allreduce([tensor], dist.AllreduceOptions()).get_future().then(settled)
        except Exception as e:
            self.manager.report_error(e)
            return _done(tensor)

    def exchange(self, loss_sum: float, stop_requested: bool) -> Outcome:
        """The step's table, then the vote (the backward pass reduced the gradients). A stop concerns this group."""
        # A lease lost to another group of the job is taken back by the writer (Checkpointer.hold_the_run); one lost to
        # another job stops the writer's group when it claims the run again.
        saves_failing, _ = self.checkpointer.problems()
        lease = self.checkpointer.lease_generation() or 0  # its leader's alone: the group's sum is its value
        numbers = torch.tensor([loss_sum, float(stop_requested), float(saves_failing), float(lease)],
                               dtype=torch.float64)
        if self.group_size > 1:  # within the group first
            dist.all_reduce(numbers)
        rows = self._table(numbers.tolist())
        committed = self._vote()
        self.committed_quorum = (self.position, self.groups) if committed else None
        self._say_what_changed(committed)
        if committed:  # (a step that cannot count may lack the group longest in the job)
            if self.since is None and self.position is not None:  # (one that healed at the vote takes part next)
                self.since = self.manager.current_step()
            self.writes = rows[eldest(rows)][NODE] == self.node  # its first process writes (Trainer)
        loss, stops, failing, lease = numbers.tolist()
        if rows:  # every group's loss, and the newest lease (while the writer changes hands, the old one may hold on)
            loss = sum(row[LOSS] for row in rows)
            failing, lease = max(row[FAILING] for row in rows), max(row[LEASE] for row in rows)
        # A group is stopping: where the whole job is (a time limit), the others' SIGTERMs may come a step later.
        leaving = committed and any(row[STOPS] for row in rows)
        return Outcome(loss / self.global_batch_size, int(stops), failing > 0, False, committed, int(lease) or None,
                       leaving)

    def _table(self, numbers: list[float]) -> list[list[float]] | None:
        """Every group's row of the step; None where the step cannot count: the exchange failed, or a group of the
        quorum is not of this job (this one raises, where it is that group)."""
        if not self._quorum_formed():
            return None
        self.position, self.groups = self.manager.participating_rank(), self.manager.num_participants()
        since = NEVER if self.since is None else self.since
        table = torch.zeros(max(self.groups, 1), COLUMNS, dtype=torch.float64, device=self.world.device)
        if self.position is not None:
            table[self.position] = torch.tensor([*numbers, *self.credentials, since, float(self.keeps_the_run),
                                                 float(self.split == (self.position, self.groups)), self.node],
                                                dtype=torch.float64)
        self._sum(table).wait()
        if self.manager.errored() is not None:
            return None
        rows = table.tolist()
        job = rows[eldest(rows)][CREDENTIALS]
        if self.position is not None and (why := misfit(rows[self.position][CREDENTIALS], job, self.job_id)):
            raise why
        strangers = [position for position, row in enumerate(rows) if misfit(row[CREDENTIALS], job, self.job_id)]
        if strangers:  # it leaves with its own line: the step is done again without it
            self.manager.report_error(ConfigError(f"the group at position {strangers[0]} is not of this job"))
            return None
        if not all(row[SPLIT_HELD] for row in rows):  # some samples were trained twice, others not at all
            self.manager.report_error(QuorumMoved("the groups changed while the step computed"))
            return None
        nodes = len({row[NODE] for row in rows})
        if nodes < self.min_nodes:  # (torchft counts groups, and a node may hold several)
            self.manager.report_error(TooFewNodes(f"{nodes} node(s), fewer than --nnodes's {self.min_nodes}"))
            return None
        return rows

    def _vote(self) -> bool:
        """Whether the step is committed: every process of every group of the step succeeded. Not where the step's
        quorum failed to form: torchft's vote would wait on the Lighthouse's timeout again."""
        if self.quorum_error is not None:
            return False
        try:
            return self.manager.should_commit(timeout=timedelta(seconds=COMMIT_TIMEOUT_S))
        except TimeoutError as e:  # a process of this group never voted: it died or hangs
            raise peer_lost(e) from e

    def _meet_again(self, error: Exception) -> None:
        """Meet the lost Lighthouse again under a new Manager (torchft keeps no quorum of the Lighthouse it lost)."""
        log.warning("live: the Lighthouse at %s does not answer (%s); meeting it again", self.settings.lighthouse,
                    one_line(error))
        self.manager.shutdown(wait=False)
        self.committed_quorum = None  # the new Manager's first quorum is waited for
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
        """One line (from each group's first worker) when this group joins, groups change, or commits stop or resume."""
        if self.world.rank != 0:
            return
        step = self.manager.current_step()  # after a commit: the step just committed
        took_part = committed and self.position is not None  # (a group that healed at the vote takes part next)
        if took_part and self.counted == 0:
            log.info("live: this group takes part from step %d, at position %d of %d group(s)", step, self.position,
                     self.groups)
        elif took_part and self.groups != self.counted:
            log.info("live: %d group(s) from step %d (were %d); this one at position %d", self.groups, step,
                     self.counted, self.position)
        if took_part:
            self.counted = self.groups
        now = time.monotonic()
        if not committed and self.failed_since is None:
            self.failed_since = now
            error = self.manager.errored()
            why = f"{self.groups} group(s), fewer than --nnodes's {self.min_nodes}" if self.groups < self.min_nodes \
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


class LoneVoter:
    """torchft's client of its ManagerServer, for a group of one process: the server's vote returns a lone voter's own
    verdict, so this one does without the round trip at every step."""

    def __init__(self, client):
        self.client = client

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        return should_commit

    def __getattr__(self, name: str):
        return getattr(self.client, name)


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future = torch.futures.Future()
    future.set_result(tensor)
    return future

"""The process group of the current generation of workers.

torchrun may restart any worker with a new RANK, LOCAL_RANK and WORLD_SIZE. This module reads
them afresh each start and uses them for two things only: device placement (LOCAL_RANK) and
picking one process to log and to write snapshots (rank 0 of this generation). Nothing derived
from them is ever stored. It also checks, before any work, that the launch cannot deadlock
(`check_store_sharing`).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from mingpt.errors import ConfigError, PeerLeft
from mingpt.training.launcher import PEER_LOST

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    per_node: int = 1  # processes the launcher started on this node (LOCAL_WORLD_SIZE)

    @property
    def distributed(self) -> bool:
        return dist.is_initialized()

    @property
    def is_leader(self) -> bool:
        """The one process of this generation that logs and writes snapshots."""
        return self.rank == 0


@dataclass(frozen=True)
class Launch:
    """What the launcher (torchrun, SLURM, a hand-made environment) says about this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 1


def check_launch() -> Launch:
    """Read RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* and refuse inconsistent values with one line each,
    before the lease or any data work: a wrong value otherwise surfaces much later, as a hang or a
    misleading error. Unset means a single process."""
    world_size = _env_int("WORLD_SIZE", 1, minimum=1)
    rank = _env_int("RANK", 0, minimum=0)
    local_rank = _env_int("LOCAL_RANK", 0, minimum=0)
    if rank >= world_size:
        raise ConfigError(f"RANK={rank} with WORLD_SIZE={world_size}: a rank must be below the world size. "
                          "Let torchrun set both (or set WORLD_SIZE to the number of processes, RANK to 0 .. WORLD_SIZE-1)")
    # LOCAL_RANK serves device placement only (gpu_of); it must at least fit the node's process count.
    local_size = _env_int("LOCAL_WORLD_SIZE", local_rank + 1, minimum=1)  # torchrun sets it; by hand, often not
    if local_rank >= local_size:
        raise ConfigError(f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_size}: a local rank must be below "
                          "the number of processes on this node. Let torchrun set both")
    if world_size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name, "").strip():
                raise ConfigError(f"WORLD_SIZE={world_size} but {name} is not set: start several processes with "
                                  "torchrun (or mingpt-torchrun), which sets it")
        port = _env_int("MASTER_PORT", 0, minimum=1)
        if port > 65535:
            raise ConfigError(f"MASTER_PORT={port} is not a TCP port: use one in 1-65535")
    return Launch(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_size)


def _env_int(name: str, default: int, minimum: int) -> int:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer: it is set by torchrun; unset it or fix the launch") \
            from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}: it is set by torchrun; unset it or fix the launch")
    return value


class Meeting:
    """Where the processes of a generation meet before they form the process group: the launcher's
    key-value store (torch's TCPStore at MASTER_ADDR:MASTER_PORT, hosted by rank 0 or by torchrun's
    agent). Opened first thing, so that a process that is still preparing data can say so: its peers
    then wait for it as long as it takes (torchrun ends them all if it dies) instead of timing out in
    init_process_group, and the leader names whom it waits for. A process that never shows up at all
    is still an error after trainer.dist_timeout_s."""

    def __init__(self, launch: Launch, timeout_s: float):
        self.launch, self.timeout_s = launch, timeout_s
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        self.opened = time.monotonic()
        # Rank 0 hosts a fresh store for each generation. torchrun's own store (shared by the agent, one
        # agent only: see check_store_sharing) outlives restarts: there the restart count keeps the keys of
        # earlier generations apart. (It differs between agents, so it is not used where there are several.)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent_store else "-"
        self.prefix = f"mingpt/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{generation}"
        try:
            with sigterm_ends_at_once():  # connecting waits in torch's C++ for a store that may never come
                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           launch.world_size, is_master=launch.rank == 0 and not agent_store,
                                           timeout=timedelta(seconds=timeout_s), multi_tenant=not agent_store,
                                           wait_for_workers=False)
        except dist.DistError as e:
            raise self._error(e) from None
        self.store.set(self._key("joined", launch.rank), socket.gethostname())

    def ready(self) -> None:
        """Say that this process has prepared its data; wait until every process has."""
        self.store.set(self._key("ready", self.launch.rank), socket.gethostname())
        said = time.monotonic() - WAIT_LOG_S + 1  # the first report after a second, then every WAIT_LOG_S
        while True:
            missing = [rank for rank in range(self.launch.world_size) if not self._has("ready", rank)]
            if not missing:
                return
            absent = [rank for rank in missing if not self._has("joined", rank)]
            if absent and time.monotonic() - self.opened > self.timeout_s:
                raise self._error(f"rank(s) {_ranks(absent)} never started")
            if self.launch.rank == 0 and time.monotonic() - said >= WAIT_LOG_S:
                log.info("waiting for %d process(es) to prepare their data: %s", len(missing), self._describe(missing))
                said = time.monotonic()
            time.sleep(0.2)

    def _describe(self, ranks: list[int]) -> str:
        by_host: dict[str, list[int]] = {}
        for rank in ranks:
            host = self.store.get(self._key("joined", rank)).decode() if self._has("joined", rank) else "not started"
            by_host.setdefault(host, []).append(rank)
        return "; ".join(f"rank {_ranks(r)} on {host}" for host, r in by_host.items())

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _has(self, kind: str, rank: int) -> bool:
        return self.store.check([self._key(kind, rank)])

    def _error(self, cause) -> Exception:
        if isinstance(cause, dist.DistError) and os.environ.get("TORCHELASTIC_RUN_ID"):
            # torchrun formed this generation and set MASTER_*: a peer (the one hosting the store, say) has gone
            return peer_lost(cause)
        return ConfigError(f"rank {self.launch.rank} of {self.launch.world_size} could not meet its peers at "
                           f"{self.address} within {self.timeout_s:.0f} s (trainer.dist_timeout_s): start all "
                           f"WORLD_SIZE processes, or check MASTER_ADDR and MASTER_PORT ({one_line(cause)})")


WAIT_LOG_S = 30.0  # how often the leader says whom it waits for


def meet(timeout_s: float) -> Meeting | None:
    """The generation's meeting point (None when this process is alone)."""
    launch = check_launch()
    return Meeting(launch, timeout_s) if launch.world_size > 1 else None


def start(timeout_s: float, meeting: Meeting | None = None) -> World:
    """Join the process group torchrun describes (if any): NCCL on GPUs, gloo on CPUs; with `meeting`,
    once every process is ready.

    The finite timeout turns a hung collective (a peer that died mid-step) into an error,
    which torchrun answers by restarting the workers.
    """
    launch = meeting.launch if meeting else check_launch()
    if torch.cuda.is_available():
        device = torch.device("cuda", gpu_of(launch.local_rank))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launch.world_size > 1:
        _join(meeting or Meeting(launch, timeout_s), device)
    return World(rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank, device=device,
                 per_node=launch.local_world_size)


def _join(meeting: Meeting, device: torch.device) -> None:
    launch, timeout_s = meeting.launch, meeting.timeout_s
    # Under torchrun the peers were started together and the wait is short; in an environment made by
    # hand a missing peer would otherwise make this process wait silently for the whole timeout.
    say = log.info if os.environ.get("TORCHELASTIC_RUN_ID") else log.warning
    say("rank %d of %d: joining the process group at %s, waiting up to %.0f s (trainer.dist_timeout_s) for the "
        "other %d process(es) to start", launch.rank, launch.world_size, meeting.address, timeout_s,
        launch.world_size - 1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    meeting.store.set_timeout(timedelta(seconds=timeout_s))
    try:
        with sigterm_ends_at_once():  # forming the group waits in torch's C++ for every peer
            meeting.ready()
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"{meeting.prefix}/pg", meeting.store),
                                    rank=launch.rank, world_size=launch.world_size,
                                    timeout=timedelta(seconds=timeout_s), device_id=device_id)
    except dist.DistError as e:  # a peer that died between the meeting and here
        raise meeting._error(e) from None
    log.debug("joined process group: rank %d of %d, %s on %s", launch.rank, launch.world_size, backend, device)


@contextmanager
def sigterm_ends_at_once() -> Iterator[None]:
    """Within: SIGTERM ends the process at once (its default action). For torch's blocking calls while a
    generation forms (connecting to its store, forming the process group), which no Python handler can
    interrupt: with a peer gone, the process would wait there until trainer.dist_timeout_s, and torchrun's
    agent, restarting it for a membership change, would kill it only after its shutdown timeout (30 s).
    Nothing is lost: the process has not trained yet."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def one_line(cause) -> str:
    """An error (or a text) in one line: its type and the first line of its message."""
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return str(cause)


def check_store_sharing() -> None:
    """Stop before any work where torchrun's agents share their rendezvous store with the workers and
    the launch spans several agents: with torch 2.13 that job deadlocks (see mingpt.training.launcher). On one
    agent (standalone), where restarts were measured to work, warn instead."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    advice = ("launch with mingpt-torchrun (same arguments), or export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
              "on every node before torchrun")
    agents = max(int(os.environ.get("GROUP_WORLD_SIZE", "1")), _max_nodes_of_agent())
    if agents > 1:
        raise ConfigError(f"torchrun's agents share their rendezvous store with the workers, which deadlocks "
                          f"jobs on several nodes (up to {agents} here) with torch 2.13: {advice}")
    if leads_this_generation():
        log.warning("torchrun's agent shares its rendezvous store with the workers (restarted workers may hang "
                    "with torch 2.13): %s", advice)


def _max_nodes_of_agent() -> int:
    """The most nodes the agent that started us allows (torchrun's --nnodes, "2" or "1:4"), read from
    its command line (torchrun gives workers no variable for it); 1 where that cannot be read."""
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return 1
    return max_nodes(args, os.environ.get("PET_NNODES", "1"))  # torchrun also reads options from PET_* variables


def max_nodes(args: list[str], nnodes: str = "1") -> int:
    """The most nodes torchrun's command line `args` allows (its --nnodes, else `nnodes`); 1 where unreadable."""
    for arg, following in zip(args, args[1:] + [""]):
        name, equals, value = arg.partition("=")
        if len(name) > len("--n") and "--nnodes".startswith(name):  # torchrun's argparse takes --nnode, --nn too
            nnodes = value if equals else following
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        return 1


def gpu_of(local_rank: int) -> int:
    """The GPU of the worker with this LOCAL_RANK: its own. More workers than GPUs would share one,
    slowly or until memory runs out (and NCCL refuses two ranks on one GPU), so that is an error."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this node has {count} visible GPU(s): start at most one worker per GPU "
            f"(torchrun --nproc-per-node=gpu or at most {count}), or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return local_rank


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` is a collective's failure because another process died, hung or was cut off: torch's
    DistError (NCCL, the stores), or gloo's transport error (a RuntimeError naming gloo's tcp pair)."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "/gloo/transport/" in str(error))


def peer_lost(error: BaseException) -> PeerLeft:
    """The end of this generation because of `error`, another process's loss (see `lost_a_peer`)."""
    return PeerLeft(f"another process was lost ({one_line(error)}); this process goes on in the next round of the "
                    "job", PEER_LOST)


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def stop() -> None:
    """Leave the process group. Objects still holding it (DDP's reducer lives in reference cycles)
    are collected first: destroyed after the group, they abort the process now and then (torch 2.13)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], world: World) -> list[float]:
    """Sum a few floats over all processes (identity when alone)."""
    if not world.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return t.tolist()


def all_gather(values: list[float], world: World) -> list[list[float]]:
    """Each process's few floats, by rank, on every process."""
    if not world.distributed:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=world.device)
    everyone = [torch.empty_like(mine) for _ in range(world.world_size)]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def all_gather_object(obj, world: World) -> list:
    """Each process's `obj` (picklable, made by this program), by rank, on every process."""
    if not world.distributed:
        return [obj]
    everyone = [None] * world.world_size
    dist.all_gather_object(everyone, obj)
    return everyone


def broadcast_object(obj, world: World, src: int = 0):
    """`obj` as process `src` (by default the leader) has it, on every process."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=world.device)
    return box[0]


def broadcast_tensor(tensor: torch.Tensor, world: World, src: int) -> None:
    """Process `src`'s CPU `tensor`, in place on every process (through the GPU where NCCL carries it)."""
    if not world.distributed:
        return
    if dist.get_backend() == "nccl":
        on_device = tensor.to(world.device)
        dist.broadcast(on_device, src=src)
        tensor.copy_(on_device.cpu())
    else:
        dist.broadcast(tensor, src=src)


def first_on_its_node() -> bool:
    """Whether this process is the first of its node (local rank 0): it reports the node's own work,
    such as preparing its data, which the leader cannot see."""
    try:
        return _env_int("LOCAL_RANK", 0, minimum=0) == 0
    except ConfigError:
        return False  # check_launch refuses it


def leads_this_generation() -> bool:
    """Whether this process will lead its generation (rank 0), known before joining the process group."""
    try:
        return _env_int("RANK", 0, minimum=0) == 0  # as check_launch reads it: "00", " 0" and "" lead too
    except ConfigError:
        return False  # check_launch refuses it, as the first thing train() does

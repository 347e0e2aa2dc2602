"""The current generation of workers: who this process is in it, and its collectives. torchrun may restart any worker
with a new RANK, LOCAL_RANK and WORLD_SIZE, so they serve only device placement and picking the leader, and nothing
derived from them is stored. The generation forms in mingpt.training.generation."""

from __future__ import annotations

import gc
import logging
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from mingpt.errors import ConfigError, PeerLeft, one_line
from mingpt.jobenv import PEER_LOST, JobEnv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    per_node: int = 1  # processes the launcher started on this node (LOCAL_WORLD_SIZE)
    job: JobEnv = field(default_factory=JobEnv)  # what the launcher says about this process and its job

    @property
    def distributed(self) -> bool:
        return dist.is_initialized()

    @property
    def is_leader(self) -> bool:
        """The one process of this generation that logs and writes snapshots."""
        return self.rank == 0


@contextmanager
def sigterm_ends_at_once() -> Iterator[None]:
    """Within: SIGTERM ends the process at once. For torch's blocking calls while a generation forms, which no Python
    handler can interrupt: with a peer gone, the process would wait until trainer.dist_timeout_s, and torchrun's
    agent would kill it only after its shutdown timeout. Nothing is lost: the process has not trained yet."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_store_sharing(job: JobEnv) -> None:
    """Stop before any work where torchrun's agents share their rendezvous store with the workers and the launch
    spans several agents: with torch 2.13 that job deadlocks (see mingpt.launch.node). On one agent, warn instead."""
    if not job.agent_store:
        return
    advice = ("launch with mingpt-torchrun (same arguments), or export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
              "on every node before torchrun")
    agents = job.max_nodes
    if agents > 1:
        raise ConfigError(f"torchrun's agents share their rendezvous store with the workers, which deadlocks "
                          f"jobs on several nodes (up to {agents} here) with torch 2.13: {advice}")
    if job.rank == 0:
        log.warning("torchrun's agent shares its rendezvous store with the workers (restarted workers may hang "
                    "with torch 2.13): %s", advice)


def gpu_of(local_rank: int) -> int:
    """The worker's own GPU: more workers than GPUs would share one (NCCL refuses two ranks on one GPU)."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this node has {count} visible GPU(s): start at most one worker per GPU "
            f"(torchrun --nproc-per-node=gpu or at most {count}), or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return local_rank


def lost_a_peer(error: BaseException) -> bool:
    """Whether `error` is a collective's failure because another process died, hung or was cut off."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "/gloo/transport/" in str(error))


def peer_lost(error: BaseException) -> PeerLeft:
    """The end of this generation because of `error`, another process's loss (see `lost_a_peer`)."""
    return PeerLeft(f"another process was lost ({one_line(error)}); this process goes on in the next round of the "
                    "job", PEER_LOST)


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def stop() -> None:
    """Leave the process group. Objects still holding it (DDP's reducer lives in reference cycles) are collected
    first: destroyed after the group, they abort the process now and then (torch 2.13)."""
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



"""How the replica is spread over the processes (`trainer.parallelism`): ddp (whole everywhere), fsdp (1/N each:
FSDP2's `fully_shard` per block, then the root), hsdp (sharded within a node, replicated across, so the all-gathers
stay on the fast links), auto (ddp while the state fits comfortably, fsdp beyond; always ddp with Muon). Data order and
loss weighting are the same in every mode, so a run may change mode at a restart."""

from __future__ import annotations

import ctypes
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt.checkpoint.shm import available_memory
from mingpt.errors import ConfigError
from mingpt.model import GPT
from mingpt.training.distributed import World

STATE_BYTES_PER_PARAM = 16  # fp32 weights and gradients, AdamW's two moments
AUTO_SHARE = 0.5  # auto: ddp while the state takes at most this share of a process's memory
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


@dataclass(frozen=True)
class Topology:
    """Where this generation's processes are and how the replica is spread over them."""

    world: World
    mode: str  # ddp, fsdp or hsdp

    @property
    def sharded(self) -> bool:
        return self.mode != "ddp"

    @property
    def per_node(self) -> int:
        return self.world.per_node

    @property
    def shard(self) -> tuple[int, int]:
        """(index, count) of this process's shard of the state; (0, 1) where it holds all of it."""
        if self.mode == "fsdp":
            return self.world.rank, self.world.world_size
        if self.mode == "hsdp":
            return self.world.rank % self.per_node, self.per_node
        return 0, 1

    @property
    def neighbours(self) -> tuple[int, int]:
        """The processes of this one's local index on the next and on the previous node."""
        rank, size = self.world.rank, self.world.world_size
        return (rank + self.per_node) % size, (rank - self.per_node) % size


def choose(wanted: str, params: int, world: World, live: bool = False, optimizer: str = "adamw") -> tuple[str, str]:
    """The mode to train in and why; `live`: one node of a live job, whose nodes replicate the model. Muon
    (`optimizer`) orthogonalises whole matrices: auto is ddp for it, and a model too large for ddp is refused."""
    if live and wanted == "fsdp":
        raise ConfigError("mingpt-torchrun --live replicates the model across nodes, so it cannot shard it over "
                          "all of them (trainer.parallelism=fsdp): use trainer.parallelism=hsdp, which shards it "
                          "within each node")
    if optimizer == "muon":
        return _unsharded(wanted, params, world)
    mode, why = _choose(wanted, params, world)
    if live and mode == "fsdp":  # auto
        return "hsdp", f"{why}, within the node (--live: replicated across nodes)"
    return mode, why


def _choose(wanted: str, params: int, world: World) -> tuple[str, str]:
    need, room = params * STATE_BYTES_PER_PARAM, memory_per_process(world)
    fits = _fits(need, room)
    if not world.distributed:
        return "ddp", "one process: nothing to shard or replicate"
    if wanted == "auto":
        if need <= AUTO_SHARE * room:
            return "ddp", f"auto: {fits}"
        return "fsdp", f"auto: {fits}, more than {AUTO_SHARE:.0%}: sharded over {world.world_size} processes"
    if wanted == "ddp" and need > room:
        raise ConfigError(
            f"trainer.parallelism=ddp keeps every parameter's state in every process: {params / 1e6:.0f}M "
            f"parameters take {fits}. Use trainer.parallelism=fsdp, which shards it over the "
            f"{world.world_size} processes ({_gb(need / world.world_size)} each)")
    if wanted == "hsdp" and world.world_size % world.per_node != 0:
        raise ConfigError(f"trainer.parallelism=hsdp needs the same number of processes on every node; "
                          f"{world.world_size} processes do not divide into nodes of {world.per_node}")
    return wanted, "as configured"


def _unsharded(wanted: str, params: int, world: World) -> tuple[str, str]:
    """Muon's mode: ddp (auto too), where every process has room for the whole state."""
    if not world.distributed:
        return "ddp", "one process: nothing to shard or replicate"
    need, room = params * STATE_BYTES_PER_PARAM, memory_per_process(world)
    if need > room:
        raise ConfigError(f"trainer.optimizer=muon orthogonalises whole matrices, so every process holds the whole "
                          f"state (ddp): {params / 1e6:.0f}M parameters take {_fits(need, room)}. Use "
                          "trainer.optimizer=adamw, whose state trainer.parallelism=fsdp can shard")
    return "ddp", "as configured" if wanted == "ddp" else "auto: trainer.optimizer=muon needs whole matrices"


def _fits(need: float, room: float) -> str:
    return f"{_gb(need)} of weights, gradients and optimizer state against {_gb(room)} per process"


def memory_per_process(world: World) -> float:
    """Bytes one process may fill: its GPU's memory, or the machine's available memory shared by its processes."""
    if world.device.type == "cuda":
        return torch.cuda.get_device_properties(world.device).total_memory
    return available_memory() / world.per_node


def place(model: GPT, topology: Topology, compute_dtype: torch.dtype) -> None:
    """Put `model` on this process's device, whole or sharded: before its optimizer (sharding replaces parameters)."""
    if not topology.sharded:
        model.to(topology.world.device)
        return
    if topology.world.device.type == "cpu":
        _return_large_frees_to_the_system()
    # Weights are gathered in the compute precision; gradients are reduced in fp32, as DDP does.
    policy = MixedPrecisionPolicy() if compute_dtype == torch.float32 else \
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    mesh = _mesh(topology)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the rest: embeddings (tied with lm_head as one), ln_f


def _return_large_frees_to_the_system() -> None:
    """Sharding's large short-lived buffers make glibc raise its mmap threshold, so later ones come from a heap that
    fragments and grows past DDP's; a fixed threshold sends them to mmap, back at once (docs/benchmarks.md)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 4 << 20)
    except (OSError, AttributeError):
        pass


def replicate(model: GPT, topology: Topology, live: bool = False) -> DDP | None:
    """The DDP wrapper to train an unsharded `model` through, where there are several processes (`live`: a node of a
    live job, whose gradients the live agreement's communication hook reduces, whatever the node's size)."""
    world = topology.world
    devices = [world.device] if world.device.type == "cuda" else None
    if topology.sharded or not (world.distributed or live):
        return None
    if not live:
        return DDP(model, device_ids=devices)
    from torchft.process_group import ProcessGroupDummy  # a live job's only: torchft takes a second to import

    # The live agreement's hook makes every exchange, so DDP gets a group of one: no broadcast at the start, which a
    # live job needs not (its nodes start from the same seeded weights, or heal). Its buckets stay as first made (as
    # in torchft's DDP): DDP rebuilds them after a step, and a node that joins late must pair its buckets with ours.
    return DDP(model, device_ids=devices, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)


def reduce_across_nodes(model: GPT, reduce: Callable[[torch.Tensor], None]) -> None:
    """hsdp in a live job: `reduce` averages each block's gradient shard across nodes, after FSDP's reduce-scatter."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(reduce)


def no_sync(model: GPT, ddp: DDP | None) -> AbstractContextManager:
    """Within it, backward accumulates gradients locally, without averaging them across processes."""
    if ddp is not None:
        return ddp.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    return nullcontext()


@contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _mesh(topology: Topology) -> DeviceMesh:
    world = topology.world
    if topology.mode == "fsdp" or world.world_size == topology.per_node:  # (hsdp on one node is fsdp)
        return init_device_mesh(world.device.type, (world.world_size,))
    return init_device_mesh(world.device.type, (world.world_size // topology.per_node, topology.per_node),
                            mesh_dim_names=("replicate", "shard"))


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"

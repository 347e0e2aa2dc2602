"""The memory tiers of every node, used together, so that a failure costs at most the step in flight, under every
parallelism (docs/snapshots.md, The memory tier). Each process keeps its shard (mingpt.checkpoint.memory); where no
other node holds it (fsdp across nodes), it also sends it to the next node. After a restart the processes load the
newest step whose shards the surviving tiers all hold."""

from __future__ import annotations

import json
import logging
import math
import time

import torch
import torch.distributed as dist

from mingpt.checkpoint.lease import job_identity
from mingpt.checkpoint.memory import Held, MemoryTier, unusable
from mingpt.checkpoint.packing import assemble
from mingpt.errors import ConfigError
from mingpt.training import distributed
from mingpt.training.config import SnapshotConfig
from mingpt.training.parallel import Topology
from mingpt.training.state import Replica

log = logging.getLogger(__name__)

OVERHEAD = 0.03  # the share of the throughput that the copies may take (snapshot.memory_every=0)
MEASURED_AT = 4  # the step of a generation at which snapshot.memory_every=0 is chosen, from the copies before


def check_memory_dir(cfg: SnapshotConfig) -> None:
    """snapshot.memory=on: refuse a snapshot.memory_dir that cannot hold a tier (auto turns the tier off instead)."""
    problem = unusable(cfg.memory_dir) if cfg.memory == "on" else None
    if problem:
        raise ConfigError(f"snapshot.memory=on keeps the state in snapshot.memory_dir={cfg.memory_dir}, but {problem} "
                          "on this machine; give a folder this user can write (/dev/shm), or use snapshot.memory=auto "
                          "or off")


class MemoryCopies:
    """This process's part in the memory tiers of a generation: made by every process or none (they are collective)."""

    def __init__(self, cfg: SnapshotConfig, topology: Topology, run: str, replica: Replica):
        self.world, self.replica = topology.world, replica
        self.tier = MemoryTier(run, job_identity(self.world.job), cfg.memory_dir, topology.shard,
                               self.world.job.launcher)
        problem = unusable(cfg.memory_dir)  # (snapshot.memory=on was refused for it before any work: check_memory_dir)
        if problem:
            self.tier.turn_off(f"snapshot.memory_dir={cfg.memory_dir}: {problem}")
        # fsdp across nodes: no other node holds this process's shard. Send it to the next node.
        self.peers = topology.neighbours
        self.group = dist.new_group(backend="gloo") if topology.shard[1] > topology.per_node else None
        self.every = cfg.memory_every
        self.generation: int | None = None  # of the run's lease, known to every process
        self.reached = 0  # the furthest step any node recorded before this start (0: unknown)
        self._steps = 0  # of this generation
        self._room_checked = False  # whether the tier's room for the state was looked at
        self._last_step_at: float | None = None
        self._step_seconds = 0.0
        self._waited = 0.0  # by the training thread, for the copy before the last optimizer step

    def restore(self, durable_step: int, durable_generation: int | None) -> dict | None:
        """Every process: restore the newest step the tiers hold whole, newer than `durable_step` and written by its
        generation or a later one (never a tier of a generation another followed); a shard's header, or None."""
        usable = lambda held: (held.header.get("generation") or 0) >= (durable_generation or 0)
        held = [h for h in self.tier.shards(newer_than=durable_step) if usable(h)]
        everyone = distributed.all_gather_object(([_key(h) for h in held], self.tier.reached()), self.world)
        self.reached = max(reached for _, reached in everyone)
        offers = {(process, *offer) for process, (offered, _) in enumerate(everyone) for offer in offered}
        header = None
        while header is None and (choice := _newest_complete(offers)):
            header = self._load(choice, held, offers)
        self.tier.start()  # read by all: stale tiers may go, and one process per launcher and shard writes
        return header

    def _load(self, choice: list[tuple], held: list[Held], offers: set) -> dict | None:
        """Load the shards `choice` names, each from its holder; None where a holder found its shard damaged."""
        trees, header, hosts = [], None, set()
        for offer in choice:
            process = offer[0]
            mine = next((h for h in held if _key(h) == offer[1:]), None) if self.world.rank == process else None
            buffer = self.tier.read(mine) if mine is not None else None
            header = distributed.broadcast_object(mine.header if buffer is not None else None, self.world, process)
            if header is None:
                offers.discard(offer)
                return None
            if buffer is None:
                buffer = torch.empty(header["nbytes"], dtype=torch.uint8)
            distributed.broadcast_tensor(buffer, self.world, process)  # returns once every process has it
            trees.append(MemoryTier.unpack(buffer, header))
            hosts.add(header["host"])
        changed = self.replica.load(assemble(trees), True, header)
        if self.world.is_leader and changed:
            log.info("%s", "; ".join(changed))
        return {**header, "hosts": sorted(hosts)}

    def after_step(self) -> None:
        """Copy this process's shard to its tier in the background, and send it to the next node where it must."""
        step, now = self.replica.state.step, time.monotonic()
        if self._last_step_at is not None:
            self._step_seconds = now - self._last_step_at
        self._last_step_at = now
        self._steps += 1
        if self.tier.writes:
            self.tier.mark_reached(step)
        if step % self._every() != 0 or not (self.tier.writes or self.group):
            return
        state = self.replica.state_dict()
        if not self._room_checked and self.tier.writes:
            self.tier.fit(state, 2 if self.group else 1, min(self.world.per_node, self.tier.shard[1]))
        self._room_checked = True
        started = time.monotonic()
        self.tier.save(state, step, {**self.replica.state.saved(), "world_size": self.world.world_size,
                                     "generation": self.generation}, then=self._send if self.group else None)
        self._waited = time.monotonic() - started  # for the copy and the send before

    def before_update(self) -> None:
        """The optimizer is about to change the state: the copy in flight must have read it."""
        started = time.monotonic()
        self.tier.wait_copied()
        self._waited += time.monotonic() - started
        if self.tier.copies == 1 and self.tier.writes:
            self.tier.forget_other_layouts()

    def _every(self) -> int:
        """snapshot.memory_every, or (0) the fewest steps between copies that keep their cost within OVERHEAD of the
        step, chosen by all processes together (sending shards between nodes needs all to copy alike). A copy costs
        its wait, and where training runs on the CPU its own CPU time (its memcpy and sha256 use the training cores)."""
        if self.every or self._steps < MEASURED_AT:
            return self.every or 1
        work = self.tier.copy_seconds if self.world.device.type == "cpu" else 0.0
        measured = distributed.all_gather([self._waited, work, self._step_seconds], self.world)
        waited, work, step = (max(column) for column in zip(*measured))
        self.every = max(1, math.ceil((waited + work) / (OVERHEAD * step))) if step > 0 else 1
        if self.world.is_leader:
            log.info("memory tier: a copy every %d step(s) (a copy costs the step %.1f ms: %.1f ms waited for, %.1f "
                     "ms of the training cores' time; a step takes %.0f ms)%s", self.every, 1000 * (waited + work),
                     1000 * waited, 1000 * work, 1000 * step, ", sent to the next node" if self.group else "")
        return self.every

    def _send(self, header: dict | None, buffer: torch.Tensor | None) -> None:
        """In the copy's thread: send this shard to the next node, keep the previous node's (all take part)."""
        to, source = self.peers
        try:
            description = json.dumps(header).encode() if header else b""
            sizes = torch.tensor([len(description), buffer.numel() if header else 0], dtype=torch.int64)
            theirs = torch.empty(2, dtype=torch.int64)
            self._swap(sizes, theirs)
            incoming = torch.empty(int(theirs[0]), dtype=torch.uint8)
            self._swap(torch.frombuffer(bytearray(description), dtype=torch.uint8) if description else
                       torch.empty(0, dtype=torch.uint8), incoming)
            slot, target = self.tier.receive(int(theirs[1])) if theirs[1] else (None, torch.empty(0))
            self._swap(buffer if header else torch.empty(0, dtype=torch.uint8), target)
            if slot is not None:
                self.tier.publish(slot, json.loads(incoming.numpy().tobytes()))
        except Exception as e:  # the peer is gone: the step's collective reports it
            log.debug("could not exchange memory copies with processes %d and %d: %s", to, source, e)

    def _swap(self, send: torch.Tensor, receive: torch.Tensor) -> None:
        to, source = self.peers
        ops = [dist.P2POp(dist.isend, send, to, self.group)] if send.numel() else []
        ops += [dist.P2POp(dist.irecv, receive, source, self.group)] if receive.numel() else []
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    def finish(self, release: bool) -> None:
        """Wait for the copy in flight and its exchange; with `release`, free the memory."""
        self.tier.wait()
        if release:
            self.tier.release()


def _key(held: Held) -> tuple:
    """Shards of one step fit together only where one generation wrote them all, with one layout."""
    return held.step, held.header.get("generation") or 0, *held.shard


def _newest_complete(offers: set) -> list[tuple] | None:
    """Of offers (process, step, generation, index, count), one per shard of the newest complete step; else None."""
    for written in sorted({(step, gen, count) for _, step, gen, _, count in offers}, reverse=True):
        holders = {}
        for offer in sorted(o for o in offers if (o[1], o[2], o[4]) == written):
            holders.setdefault(offer[3], offer)
        if len(holders) == written[2]:
            return [holders[index] for index in sorted(holders)]
    return None

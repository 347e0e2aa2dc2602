"""The trainer's snapshots: which state to resume from, when to save it, and the rescue of a failed step. A run's state
has three homes: the durable store (mingpt.checkpoint.store), each node's memory tier and its copy on another node
(mingpt.training.recovery); this component decides which to read and when to write."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Callable

import torch.distributed as dist

import mingpt
from mingpt.checkpoint.lease import LIVE, LeaseLostError, RunLease
from mingpt.checkpoint.memory import remove_ended_tiers
from mingpt.checkpoint.sharded import write_shards
from mingpt.checkpoint.store import Snapshot, SnapshotError, SnapshotStore, snapshot_name
from mingpt.checkpoint.writer import SnapshotWriter
from mingpt.storage import explain_storage_error
from mingpt.tokenizers import Tokenizer
from mingpt.training import distributed
from mingpt.training.config import Config
from mingpt.training.parallel import Topology
from mingpt.training.recovery import MemoryCopies
from mingpt.training.state import Replica, changed_settings, check_compatible, to_cpu

log = logging.getLogger(__name__)


class Checkpointer:
    """Resume, saves, the memory copies and the rescue save of a failed step, for one generation. ddp saves by the
    leader alone, fsdp and hsdp by every process, its shard (mingpt.checkpoint.sharded); either loads into either."""

    def __init__(self, cfg: Config, topology: Topology, store: SnapshotStore, tokenizer: Tokenizer,
                 data_fingerprint: str, replica: Replica):
        self.cfg, self.world, self.store, self.tokenizer = cfg, topology.world, store, tokenizer
        self.data_fingerprint = data_fingerprint  # of the prepared tokens: a replaced corpus changes it
        self.resumed_data: str | None = None  # the fingerprint of the data the snapshot resumed from was trained on
        self.sharded = topology.sharded
        self.writer = SnapshotWriter(store, cfg.snapshot.async_save, cfg.snapshot.max_failures)
        self._held: RunLease | None = None  # live mode: the lease this process claimed as the writer
        if self.sharded:
            # Saves are collectives of their own group: in the writer's thread, beside the training's.
            self.save_group = dist.new_group(backend="gloo")
            self.fence = self._follow_lease()
        # Named after where the run is (a local snapshot.dir by its absolute path), so two jobs on one machine never
        # share a tier. Without torchrun no restart continues the job: there (auto) the memory would never be read.
        wanted = cfg.snapshot.memory == "on" or (cfg.snapshot.memory == "auto" and topology.world.job.under_torchrun)
        self.memory = MemoryCopies(cfg.snapshot, topology, os.path.abspath(store.run.path) if store.local else
                                   store.url, replica) if wanted else None
        if not wanted:  # (a tier's own start does it, once the restore has read what it needs)
            remove_ended_tiers(cfg.snapshot.memory_dir)  # a killed job's memory: the next job frees it, tier or not

    @property
    def reached(self) -> int:
        """The furthest step any node's memory tier recorded before this start (0: unknown)."""
        return self.memory.reached if self.memory else 0

    def latest(self) -> Snapshot | None:
        """The newest verified snapshot, chosen by the leader: every process loads that same one."""
        self._check_shared()
        latest, choice = None, ("none", None)
        if self.world.is_leader:
            try:
                latest = self.store.latest()
                choice = ("snapshot", latest.name) if latest else ("none", None)
            except Exception as e:  # tell the others, or they would wait for the broadcast in vain
                choice = ("error", f"cannot read snapshots from {self.store.url}: "
                                   f"{explain_storage_error(e, self.store.local)}")
        kind, value = distributed.broadcast_object(choice, self.world)
        if kind == "error":
            raise SnapshotError(value)
        if kind == "none" or latest is not None:
            return latest  # the leader keeps the bytes it verified, so it reads them once
        return self.store.get(value)

    def check_fits(self, snapshot: Snapshot, replica: Replica) -> None:
        """SnapshotError unless the run's model, tokenizer and optimizer can train on from `snapshot`."""
        check_compatible(snapshot, replica.model.config, self.tokenizer, self.cfg.trainer.optimizer)

    def load(self, snapshot: Snapshot, replica: Replica) -> None:
        """Restore `replica` from `snapshot` (which fits it: check_fits)."""
        manifest = snapshot.manifest
        state, whole = replica.read(snapshot)
        changed = replica.load(state, whole, manifest)
        changed += changed_settings(manifest.get("config", {}), self.cfg.to_dict())
        if changed:
            self._log("settings changed since that snapshot: %s", ", ".join(changed))
        saved = self.resumed_data = manifest.get("data_fingerprint")
        if saved and saved != self.data_fingerprint and self.world.is_leader:
            log.warning("the data changed since that snapshot: its prepared tokens had fingerprint %s, now %s (the "
                        "corpus or its preparation is not what the run trained on so far); training goes on with "
                        "the data as it is now", saved[:12], self.data_fingerprint[:12])

    def load_newer_from_memory(self, snapshot: Snapshot | None) -> dict | None:
        """Restore from the memory tiers where newer than `snapshot`; what was loaded, or None. Every process calls."""
        if self.memory is None:  # the same everywhere: snapshot.memory and the launch decide it
            return None
        lease = self.store.lease
        self.memory.generation = distributed.broadcast_object(lease.generation if lease else None, self.world)
        writer = snapshot.manifest.get("writer") if snapshot else None
        return self.memory.restore(snapshot.step if snapshot else 0,
                                   writer.get("generation") if isinstance(writer, dict) else None)

    def _check_shared(self) -> None:
        """Every process must see what the leader writes (any may lead the next generation): else a run restarts."""
        world, store = self.world, self.store
        if not world.distributed:
            return
        probe = f"{store.path}/.shared-check-{uuid.uuid4().hex}"
        if world.is_leader:
            store.fs.pipe_file(probe, b"ok")
        probe = distributed.broadcast_object(probe, world)
        store.fs.invalidate_cache(store.path)
        visible = distributed.all_reduce_sum([float(store.fs.exists(probe))], world)[0]
        distributed.barrier(world)
        if world.is_leader:
            store.fs.rm_file(probe)
        if visible < world.world_size:
            raise SnapshotError(
                f"snapshot.dir {store.url} is not shared: {world.world_size - int(visible)} of {world.world_size} "
                "processes cannot see the files the first one writes there. Use storage every node reaches "
                "(s3://, NFS)"
            )

    def save(self, replica: Replica, metrics: dict) -> None:
        """Snapshot the replica while training goes on."""
        if not (self.sharded or self.world.is_leader):
            return
        self.writer.wait()
        state = to_cpu(replica.state_dict())  # copied now: the training goes on changing the replica
        step, info = replica.state.step, self._info(replica, metrics)
        if self.sharded:
            del state["scaler"]  # fp16 is never sharded
            self.writer.submit(step, lambda: self._commit_shards(step, state, info))
        else:
            tensors = {key: value for key, value in state.items() if value is not None}
            self.writer.submit(step, lambda: self.store.save(step, tensors, self._files(), info))

    def _files(self) -> dict[str, bytes]:
        return {"tokenizer.json": self.tokenizer.to_json().encode()}

    def _info(self, replica: Replica, metrics: dict) -> dict:
        return {
            "samples_seen": replica.state.samples_seen,
            "model_config": replica.model.config.to_dict(),
            "optimizer": self.cfg.trainer.optimizer,  # a run resumes with its own (check_compatible)
            "config": self.cfg.to_dict(),
            "world_size": self.world.world_size,
            "data_fingerprint": self.data_fingerprint,
            "metrics": metrics,
            "library_version": mingpt.__version__,
        }

    def _commit_shards(self, step: int, state: dict, info: dict) -> None:
        """In every writer thread: the leader clears the way (or keeps a commit), all write shards, it commits."""
        store, group, leader = self.store, self.save_group, self.world.is_leader
        decision = [None]
        if leader:
            try:
                decision = ["keep" if store.begin(step) is not None else "write"]
            except Exception as e:  # tell the others, or they would wait for the decision in vain
                decision = [f"the leader could not start it: {explain_storage_error(e, store.local)}"]
                dist.broadcast_object_list(decision, src=0, group=group)
                raise
        dist.broadcast_object_list(decision, src=0, group=group)
        if decision[0] == "keep":
            return
        if decision[0] != "write":
            raise SnapshotError(decision[0])
        entries = write_shards(state, store.fs, f"{store.path}/{snapshot_name(step)}", self.fence, group)
        everyone = [None] * self.world.world_size if leader else None
        dist.gather_object(entries, everyone, dst=0, group=group)
        if leader:
            written = {name: entry for shares in everyone for name, entry in shares.items()}
            store.commit(step, written | store.write(step, self._files()), info)

    def _follow_lease(self) -> Callable[[], None]:
        """The fence of every process's shard writes: the leader's lease, as the leader claimed it."""
        lease = self.store.lease
        claim = distributed.broadcast_object(lease.claim if lease else None, self.world)
        if lease is not None:
            return lease.check
        return RunLease.following(self.store.run, claim).check if claim else (lambda: None)

    def after_step(self, generation: int | None = None) -> None:
        """Into the memory tiers. Live mode: the writer's lease `generation` marks the copies."""
        if self.memory is not None:
            if generation is not None:
                self.memory.generation = generation
            self.memory.after_step()

    def lease_generation(self) -> int | None:
        """The generation of the run's lease that this process holds (None: it holds none)."""
        return self.store.lease.generation if self.store.lease is not None else None

    def hold_the_run(self, writes: bool) -> None:
        """Live mode: whether this process writes the run's snapshots now. A new writer claims the run's lease at once
        (every group is one job); an old one lets it go once its snapshot in flight is committed or fenced off (by the
        new writer: not a failure of this one)."""
        if self._held is not None and (self._held.lost or not writes):
            self.writer.wait()
            self.writer.failures = 0
            self._held.release()
            self._held = self.store.lease = None
        if writes and self._held is None:
            self._held = self.store.claim(self.cfg.snapshot.lease_timeout_s, self.world.job, LIVE)

    def before_update(self) -> None:
        """The optimizer is about to change the state: the memory copy in flight must have read it."""
        if self.memory is not None:
            self.memory.before_update()

    def problems(self) -> tuple[bool, bool]:
        """(saves keep failing, the run was taken over): what only the leader knows, for the step's collective."""
        leader = self.world.is_leader
        lease = self.store.lease
        return leader and self.writer.failed_too_often, leader and lease is not None and lease.lost

    def stop_on(self, failing: float, lost: float) -> None:
        """Stop every process together when the leader lost the run or cannot write snapshots."""
        if lost:
            raise LeaseLostError("another job or a newer generation of this one took over snapshot.dir; this "
                                 "generation stops without writing anything more (the leader's log says who)")
        if failing:
            self.writer.check()
            raise SnapshotError("the process writing snapshots could not write them; see its log")

    def finish(self, release_memory: bool = True) -> None:
        """Wait for the snapshot in flight (no job ends "done" before it is committed); every process exits alike."""
        self.writer.wait()
        failed = float(self.world.is_leader and self.writer.failures > 0)
        failed, lost = distributed.all_reduce_sum([failed, float(self.problems()[1])], self.world)
        self.stop_on(0.0, lost)
        if failed:
            self.writer.check(final=True)
            raise SnapshotError("the process writing snapshots could not write the last one; see its log")
        if self.memory is not None:
            self.memory.finish(release_memory)
        if self._held is not None:
            self._held.release()

    def rescue(self, replica: Replica, metrics: dict) -> None:
        """A step failed (most often: a peer died mid-collective), yet this replica is consistent (the optimizer had not
        stepped, or the state counts the step): the leader snapshots it without collectives, unless a newer generation's
        lease fences it off. Only with gloo (NCCL reports a death late, maybe after a step on partly reduced gradients),
        unsharded (a dead process cannot join a sharded save; the memory tiers hold its step), and by the lease's holder
        (a group that never wrote, such as one of other data, leaves nothing behind)."""
        if not self.world.is_leader or (self.world.distributed and dist.get_backend() != "gloo") or self.sharded \
                or self.store.lease is None:
            return
        try:
            self.writer.wait()
            if replica.state.step > 0:
                log.warning("step failed; saving step %d from this process before exiting", replica.state.step)
                self.save(replica, metrics)
                self.writer.wait()
        except Exception as e:
            log.error("could not save a rescue snapshot: %s", e)

    def _log(self, message: str, *args) -> None:
        if self.world.is_leader:
            log.info(message, *args)

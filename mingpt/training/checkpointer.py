"""The trainer's snapshots: which one to resume from, what a snapshot holds, and writing it.

The state of a run is the replica's state alone (weights, optimizer, step, examples consumed),
so the leader of any generation can snapshot it and any number of processes can resume it.
The store (mingpt.checkpoint) knows how snapshots are kept; this component knows what a
training snapshot must contain and when it may be trusted to train on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

import mingpt
from mingpt.checkpoint.lease import LeaseLostError, RunLease, job_identity
from mingpt.checkpoint.memory import MemoryTier
from mingpt.checkpoint.sharded import read_shards, write_shards
from mingpt.checkpoint.store import Snapshot, SnapshotError, SnapshotStore, snapshot_name
from mingpt.checkpoint.writer import SnapshotWriter
from mingpt.errors import ConfigError
from mingpt.model import GPTConfig
from mingpt.storage import explain_storage_error
from mingpt.tokenizers import Tokenizer, tokenizer_from_dict
from mingpt.training import distributed
from mingpt.training.config import Config, SnapshotConfig
from mingpt.training.distributed import World

log = logging.getLogger(__name__)

MEMORY_OVERHEAD = 0.03  # the share of the step time that the memory tier may take (snapshot.memory_every=0)

# The parts of GPTConfig that decide the shape of the weights.
SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "tie_weights")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    samples_seen: int = 0  # the data cursor: examples consumed from the global stream (mingpt.data.sampler)


@dataclass
class Replica:
    """What a snapshot saves and restores: the same in every process of a generation."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None  # fp16 only: the loss scale it found is part of the state
    state: TrainState


class Checkpointer:
    """Resume, periodic and final saves, and the rescue save of a failed step, for one generation.

    An unsharded replica (ddp) is saved by the leader alone, as model.pt and optimizer.pt; a sharded
    one (fsdp, hsdp) by every process, each its shard (mingpt.checkpoint.sharded). Either kind loads
    into either kind of replica, at any world size."""

    def __init__(self, cfg: Config, world: World, store: SnapshotStore, tokenizer: Tokenizer, data_fingerprint: str,
                 sharded: bool = False):
        self.cfg, self.world, self.store, self.tokenizer = cfg, world, store, tokenizer
        self.data_fingerprint = data_fingerprint  # of the prepared tokens: a replaced corpus changes it
        self.sharded = sharded
        self.writer = SnapshotWriter(store, cfg.snapshot.async_save, cfg.snapshot.max_failures)
        if sharded and cfg.snapshot.memory == "on":
            raise ConfigError("snapshot.memory=on keeps whole replicas in memory; a sharded one "
                              "(trainer.parallelism=fsdp or hsdp) resumes from its snapshots: use snapshot.memory=auto")
        if sharded:
            # Saves are collectives of their own group: in the writer's thread, beside the training's.
            self.save_group = dist.new_group(backend="gloo")
            self.fence = self._follow_lease()
        # Every process reads it; one process per node writes it. Named after where the run is: a local
        # snapshot.dir by its absolute path, so that two jobs on one machine never share a tier.
        self.memory = None if sharded else \
            _memory_tier(cfg.snapshot, os.path.abspath(store.run.path) if store.local else store.url)
        self.memory_every = cfg.snapshot.memory_every
        self.reached = 0  # the furthest step any node recorded before this start (0: unknown)
        self._last_step_at: float | None = None
        self._step_seconds: float | None = None
        self._waited = 0.0  # by the last optimizer step, for the memory tier's copy
        self.generation: int | None = None  # of the run's lease (mingpt.checkpoint.lease), known to every process

    # -- resuming ------------------------------------------------------------------------------

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

    def load(self, snapshot: Snapshot, replica: Replica) -> None:
        """Restore `replica` from `snapshot`, after checking that the run's model and data fit it."""
        _check_compatible(snapshot, replica.model.config, self.tokenizer)
        device, manifest = self.world.device, snapshot.manifest
        if snapshot.sharded or self.sharded:
            self._load_through_state_dicts(snapshot, replica)
        else:
            scaler = snapshot.load_tensors("scaler.pt") if "scaler.pt" in manifest["files"] else None
            self._restore(replica, snapshot.load_tensors("model.pt", device),
                          snapshot.load_tensors("optimizer.pt", device), scaler, manifest["step"],
                          manifest["samples_seen"])
        changed = _changed_settings(manifest.get("config", {}), self.cfg.to_dict())
        if changed:
            self._log("settings changed since that snapshot: %s", ", ".join(changed))
        saved = manifest.get("data_fingerprint")
        if saved and saved != self.data_fingerprint and self.world.is_leader:
            log.warning("the data changed since that snapshot: its prepared tokens had fingerprint %s, now %s (the "
                        "corpus or its preparation is not what the run trained on so far); training goes on with "
                        "the data as it is now", saved[:12], self.data_fingerprint[:12])

    def load_newer_from_memory(self, replica: Replica, snapshot: Snapshot | None) -> dict | None:
        """Restore `replica` from the newest state that any node's memory tier holds, when it is newer than
        `snapshot` and was written by its generation or a later one (a tier left by a generation that
        another generation followed is never used); the description of what was loaded (step, host,
        world_size), or None. Every process calls it: they agree on the newest step, and the process
        that holds it sends it to the others."""
        lease = self.store.lease
        self.generation = distributed.broadcast_object(lease.generation if lease else None, self.world)
        durable_step = snapshot.manifest["step"] if snapshot else 0
        writer = snapshot.manifest.get("writer") if snapshot else None
        durable_generation = writer.get("generation") if isinstance(writer, dict) else None
        held = self.memory.newest(newer_than=durable_step) if self.memory else None
        usable = held is not None and held.step > durable_step and \
            (durable_generation is None or (held.header.get("generation") or 0) >= durable_generation)
        mine = held.step if usable else -1
        reached = self.memory.reached() if self.memory else 0
        everyone = distributed.all_gather([float(mine), float(reached)], self.world)
        steps = [int(step) for step, _ in everyone]
        self.reached = max(int(step) for _, step in everyone)
        header = None
        if max(steps) >= 0:
            holder = steps.index(max(steps))
            header = distributed.broadcast_object(held.header if self.world.rank == holder else None, self.world,
                                                  holder)
            buffer = MemoryTier.load(held) if self.world.rank == holder else \
                torch.empty(header["nbytes"], dtype=torch.uint8)
            distributed.broadcast_tensor(buffer, self.world, holder)  # returns once every process has it
            state = MemoryTier.unpack(buffer, header)
            self._restore(replica, state["model"], state["optimizer"], state["scaler"], header["step"],
                          header["samples_seen"])
        if self.memory is not None:
            self.memory.start()  # read by all: stale tiers may go, and one process per launcher writes
        return header

    def _load_through_state_dicts(self, snapshot: Snapshot, replica: Replica) -> None:
        """A sharded snapshot into any replica, or any snapshot into a sharded replica: through torch's
        state-dict API, which knows both layouts. Shards are read where they are needed (DCP plans it);
        model.pt and optimizer.pt are read whole by every process, which keeps its share."""
        model, optimizer = replica.model, replica.optimizer
        configured = [_hyperparameters(group) for group in optimizer.param_groups]
        if snapshot.sharded:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            read_shards(snapshot, state)
            options = StateDictOptions()
        else:
            state = {"model": snapshot.load_tensors("model.pt"),
                     "optimizer": _keyed_by_name(snapshot.load_tensors("optimizer.pt"), model, optimizer)}
            options = StateDictOptions(full_state_dict=True)
        # Model and optimizer one at a time: set_state_dict with both hung in one case (see DESIGN.md).
        set_model_state_dict(model, state["model"], options=options)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
        self._apply_configured(optimizer, configured)
        replica.state.step, replica.state.samples_seen = snapshot.step, snapshot.manifest["samples_seen"]

    def _restore(self, replica: Replica, model: dict, optimizer: dict, scaler: dict | None, step: int,
                 samples_seen: int) -> None:
        replica.model.load_state_dict(model)
        configured = [_hyperparameters(group) for group in replica.optimizer.param_groups]
        replica.optimizer.load_state_dict(optimizer)
        self._apply_configured(replica.optimizer, configured)
        if replica.scaler is not None and scaler is not None:
            replica.scaler.load_state_dict(scaler)
        replica.state.step, replica.state.samples_seen = step, samples_seen

    def _apply_configured(self, optimizer: torch.optim.Optimizer, configured: list[dict]) -> None:
        """`load_state_dict` brings back the saved betas, weight decay, ...; this run's config wins."""
        for group, wanted in zip(optimizer.param_groups, configured):
            for key, value in wanted.items():
                if key != "lr" and group.get(key) != value:  # lr is set every step from the schedule
                    self._log("optimizer %s: %s in the snapshot, %s in the config: using the config",
                              key, group.get(key), value)
                    group[key] = value

    def _check_shared(self) -> None:
        """With several processes, every one must see what the leader writes: any of them may lead the
        next generation. A local folder that is not shared between nodes would silently restart a run."""
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

    # -- saving --------------------------------------------------------------------------------

    def save(self, replica: Replica, metrics: dict) -> None:
        """Snapshot the replica while training goes on: the leader alone where every process holds all of
        it; every process its own shard where it is sharded."""
        if self.sharded:
            self._save_shards(replica, metrics)
            return
        if not self.world.is_leader:
            return
        tensors = {"model": _to_cpu(replica.model.state_dict()), "optimizer": _to_cpu(replica.optimizer.state_dict())}
        if replica.scaler is not None:
            tensors["scaler"] = replica.scaler.state_dict()
        self.writer.save(replica.state.step, tensors, self._files(), self._info(replica, metrics))

    def _files(self) -> dict[str, bytes]:
        return {"tokenizer.json": self.tokenizer.to_json().encode()}

    def _info(self, replica: Replica, metrics: dict) -> dict:
        return {
            "samples_seen": replica.state.samples_seen,
            "model_config": replica.model.config.to_dict(),
            "config": self.cfg.to_dict(),
            "world_size": self.world.world_size,
            "data_fingerprint": self.data_fingerprint,
            "metrics": metrics,
            "library_version": mingpt.__version__,
        }

    def _save_shards(self, replica: Replica, metrics: dict) -> None:
        """Every process copies its shard off the training state now and writes it in the background."""
        self.writer.wait()
        model_state, optimizer_state = get_state_dict(replica.model, replica.optimizer)
        state = _to_cpu({"model": model_state, "optimizer": optimizer_state})
        step, info = replica.state.step, self._info(replica, metrics)
        self.writer.submit(step, lambda: self._commit_shards(step, state, info))

    def _commit_shards(self, step: int, state: dict, info: dict) -> None:
        """In every process's writer thread, over the save group: the leader clears the way (or finds this
        step committed already), every process writes its shard, the leader commits the hashes of all."""
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

    def after_step(self, replica: Replica) -> None:
        """The step is done everywhere: one process of each node copies the state to its memory tier
        (every snapshot.memory_every steps), in the background until `before_update`."""
        if self.memory is None or not self.memory.writes:
            return
        step, now = replica.state.step, time.monotonic()
        if self._last_step_at is not None:
            self._step_seconds = now - self._last_step_at
        self._last_step_at = now
        self.memory.mark_reached(step)
        if step % self._memory_every() != 0:
            return
        state = {"model": replica.model.state_dict(), "optimizer": replica.optimizer.state_dict(),
                 "scaler": replica.scaler.state_dict() if replica.scaler is not None else None}
        if self.memory.copy_seconds is None and not self.memory.has_room(state):  # checked at the first copy
            log.warning("memory tier off: %s has no room for two copies of the state; a failure resumes from the "
                        "last snapshot", self.memory.folder.parent)
            self.memory = None
            return
        self.memory.save(state, step, {"samples_seen": replica.state.samples_seen, "world_size": self.world.world_size,
                                       "generation": self.generation})

    def before_update(self) -> None:
        """The optimizer is about to change the state: the copy in flight must have read it."""
        if self.memory is not None:
            started = time.monotonic()
            self.memory.wait()
            self._waited = time.monotonic() - started

    def _memory_every(self) -> int:
        """snapshot.memory_every, or (0) the fewest steps between copies that keep what the training
        thread waits for them within MEMORY_OVERHEAD of the step time, once both are measured. (The copy
        runs while the next step computes: only what is left of it at the optimizer step costs time.)"""
        if self.memory_every:
            return self.memory_every
        step = self._step_seconds
        if self.memory.copies < 2 or step is None:  # the first copy also maps the buffers: not the usual cost
            return 1
        self.memory_every = max(1, math.ceil(self._waited / (MEMORY_OVERHEAD * step)))
        log.info("memory tier: a copy every %d step(s) (a copy takes %.0f ms, of which the step waits %.1f ms; a "
                 "step %.0f ms) in %s", self.memory_every, 1000 * self.memory.copy_seconds, 1000 * self._waited,
                 1000 * step, self.memory.folder)
        return self.memory_every

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
        """Wait for the snapshot in flight: the job must not end before it is committed, nor end
        "done" when it was not. Every process learns the outcome, so all exit alike. Then free the
        memory tier, unless the next generation may read it."""
        self.writer.wait()
        failed = float(self.world.is_leader and self.writer.failures > 0)
        failed, lost = distributed.all_reduce_sum([failed, float(self.problems()[1])], self.world)
        self.stop_on(0.0, lost)
        if failed:
            self.writer.check(final=True)
            raise SnapshotError("the process writing snapshots could not write the last one; see its log")
        if self.memory is not None and release_memory:
            self.memory.release()  # the last step is in a snapshot: the memory is needed no more

    def rescue(self, replica: Replica, metrics: dict) -> None:
        """A step failed (most often: a peer died mid-collective). The optimizer had not stepped, or the
        state already counts the step, so this replica is consistent: the leader snapshots it, no
        collectives involved, before the error ends the process and torchrun restarts the group.
        If a newer generation holds the run already, the store's fence refuses the save.

        Only with gloo, and unsharded: NCCL reports a peer's death late, possibly after the optimizer
        stepped on partly reduced gradients, so there the last periodic snapshot is the safe one; and a
        sharded replica is saved by all processes together, which a dead one cannot join."""
        if not self.world.is_leader or (self.world.distributed and dist.get_backend() != "gloo") or self.sharded:
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


def _memory_tier(cfg: SnapshotConfig, run: str) -> MemoryTier | None:
    """This node's memory tier for the run, unless snapshot.memory is off, or (auto) it cannot be had or
    would never be read: a process that torchrun did not start is a job of its own, which no restart continues."""
    if cfg.memory == "off" or (cfg.memory == "auto" and "TORCHELASTIC_RUN_ID" not in os.environ):
        return None
    if not os.access(cfg.memory_dir, os.W_OK):
        if cfg.memory == "on":
            raise ConfigError(f"snapshot.memory=on keeps the state in snapshot.memory_dir={cfg.memory_dir}, which "
                              "this machine lacks or this user cannot write; use snapshot.memory=auto or off, or "
                              "another snapshot.memory_dir")
        return None
    return MemoryTier(run, job_identity(), cfg.memory_dir)


def _check_compatible(snapshot: Snapshot, model_config: GPTConfig, tokenizer: Tokenizer) -> None:
    saved_tokenizer = tokenizer_from_dict(json.loads(snapshot.read("tokenizer.json")))
    if saved_tokenizer.eot_id is None and tokenizer.eot_id is not None:
        raise SnapshotError(
            f"snapshot {snapshot.url} was made before tokenizers reserved an end-of-text token, which prepared "
            f"data now ends every document with ({saved_tokenizer.vocab_size} ids then, {tokenizer.vocab_size} now), "
            "so it cannot train on: sample it with mingpt-sample, or start a new run in another snapshot.dir"
        )
    saved = snapshot.manifest["model_config"]
    wanted = model_config.to_dict()
    diffs = [f"{k}={saved.get(k)!r} (config asks for {wanted[k]!r})" for k in SHAPE_KEYS if saved.get(k) != wanted[k]]
    if diffs:
        raise SnapshotError(
            f"snapshot {snapshot.url} was made with a different model: {', '.join(diffs)}. "
            "Use the settings of that run, or a new snapshot.dir to start a new run"
        )
    if saved_tokenizer.to_dict() != tokenizer.to_dict():
        raise SnapshotError(
            f"snapshot {snapshot.url} was made with another tokenizer ({saved_tokenizer.describe()}) than "
            f"the data now gives ({tokenizer.describe()}); use the data settings of that run, or a new snapshot.dir"
        )


def _hyperparameters(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def _changed_settings(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for each setting that differs between two `Config.to_dict()` trees."""
    changed = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed += _changed_settings(old, new, f"{prefix}{key}.")
        elif old != new:
            changed.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changed


def _keyed_by_name(saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state dict keyed by parameter index (`Optimizer.state_dict`), keyed by parameter name
    (as torch's state-dict API wants it): indices count the parameters of the groups in order."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[index]: state for index, state in saved["state"].items()},
            "param_groups": [{**group, "params": [order[index] for index in group["params"]]}
                             for group in saved["param_groups"]]}


def _to_cpu(obj):
    if isinstance(obj, DTensor):  # this process's shard, still placed in the whole
        return DTensor.from_local(_to_cpu(obj.to_local()), obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj

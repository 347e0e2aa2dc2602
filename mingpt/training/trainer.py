"""The elastic training loop. Every start (the first, a restart after a crash, or after nodes left or joined) runs the
same steps: prepare (or reuse) the data, join the process group, load the newest complete snapshot, and train from its
step to `max_steps`. The state of a run is the replica's state alone, so any single process can snapshot it and any
number of processes can resume it (see checkpointer)."""

from __future__ import annotations

import hashlib
import logging
import math
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt import torch_internals
from mingpt.checkpoint.lease import LIVE
from mingpt.checkpoint.load import snapshot_store
from mingpt.checkpoint.packing import placed_like
from mingpt.checkpoint.shm import remove_ended_agents_folders
from mingpt.checkpoint.store import SnapshotStore
from mingpt.data.prepared import PreparedData, TokenBlocks
from mingpt.data.sampler import WindowOrder, micro_batches, shard, window_order
from mingpt.errors import ConfigError, PeerLeft, TrainingError, forget_stops, raise_stopped
from mingpt.interop.pretrained import Pretrained, open_pretrained
from mingpt.jobenv import PEER_STOPPED, JobEnv
from mingpt.model import GPT, GPTConfig
from mingpt.processes import end_with_parent
from mingpt.storage import redact
from mingpt.training import distributed, generation, live, parallel
from mingpt.training.agreement import Agreement, Outcome, Share, StepAgreement
from mingpt.training.benchmark import HellaSwag, agree, load_hellaswag, read_hellaswag
from mingpt.training.checkpointer import Checkpointer
from mingpt.training.compile_cache import CompileCache, describe
from mingpt.training.config import Config
from mingpt.training.distributed import World
from mingpt.training.precision import autocast_for, choose_compile, choose_precision, compute_dtype, dtype_name
from mingpt.training.preparation import prepare_data
from mingpt.training.progress import Progress
from mingpt.training.recovery import check_memory_dir
from mingpt.training.report import Report, describe_windows
from mingpt.training.resume import resume
from mingpt.training.optimizer import build_optimizer
from mingpt.training.schedule import set_lr
from mingpt.training.state import Replica, TrainState
from mingpt.training.stopflag import StopFlag

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step: int
    train_loss: float | None
    val_loss: float | None
    peer_stopped: bool = False  # stopped because a process on another node was asked to, not this one


def train(cfg: Config) -> TrainResult:
    """Run (or resume) the job `cfg` describes; returns when `max_steps` is reached or a stop was requested."""
    job = JobEnv.from_environ()  # first: a launch that is inconsistent or would deadlock fails before any work
    if job.under_torchrun:  # its agent dies (SIGKILL, the OOM killer): save the step and leave, as when it stops us
        end_with_parent(signal.SIGTERM)
    torch_internals.check(launcher=False)  # DCP's private names, which snapshots rely on
    _check_batch(cfg, job.world_size)
    distributed.check_store_sharing(job)
    # SIGTERM (torchrun's, at every membership change) stops preparation at once, through its cleanups.
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    forget_stops()
    try:
        return _train(cfg, job)
    finally:
        signal.signal(signal.SIGTERM, previous)
        forget_stops()


def _train(cfg: Config, job: JobEnv) -> TrainResult:
    meeting = generation.meet(job, cfg.trainer.dist_timeout_s)  # first: peers wait for this process while it prepares
    store = snapshot_store(cfg.snapshot.dir, keep=cfg.snapshot.keep, storage_options=cfg.snapshot.storage_options)
    store.check_writable()
    check_memory_dir(cfg.snapshot)
    remove_ended_agents_folders()  # what this user's killed agents left in /tmp: the next job removes it, agent or not
    # The leader claims the run before any data work: a second job in the same snapshot.dir stops here, and a worker of
    # an older generation can no longer commit (mingpt.checkpoint.lease). Live mode: the writer's group claims it.
    leads, timeout = job.rank == 0, cfg.snapshot.lease_timeout_s
    if leads and job.live:
        store.refuse_the_other_mode(timeout, job, LIVE)
    with store.claim(timeout, job) if leads and not job.live else nullcontext():
        examples = read_hellaswag(cfg.trainer, job)  # before the data work: a file that is not HellaSwag's stops it
        pretrained = open_pretrained(cfg.model.init_from, cfg.data.block_size) if cfg.model.init_from else None
        _check_architecture(cfg, pretrained)
        data = PreparedData(prepare_data(cfg, pretrained))
        model_config = _model_config(cfg, data, pretrained, job)
        hellaswag = load_hellaswag(cfg.trainer, examples, data.tokenizer, model_config.block_size, job)
        world = generation.start(job, cfg.trainer.dist_timeout_s, meeting)
        try:
            with StopFlag() as stop, _a_lost_peer_ends_the_generation():
                result = Trainer(cfg, world, store, data, model_config, pretrained, hellaswag).run(stop)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the last snapshot is committed: only leaving is left
            distributed.barrier(world)  # leave together: a process torn down while a peer still talks to it aborts
        finally:
            distributed.stop()
    if result.peer_stopped:  # the job goes on: the agent restarts this process in the next round, for free
        raise PeerLeft(f"another process was asked to stop: step {result.step} is saved; this process goes on in "
                       "the next round of the job", PEER_STOPPED)
    return result


@contextmanager
def _a_lost_peer_ends_the_generation() -> Iterator[None]:
    """A collective that fails because another process died, hung or was cut off ends this generation (PeerLeft):
    it is no failure of this process, whose rescue snapshot is written by then."""
    try:
        yield
    except Exception as e:
        if distributed.lost_a_peer(e):
            raise distributed.peer_lost(e) from e
        raise


def _check_architecture(cfg: Config, pretrained: Pretrained | None) -> None:
    """model.init_from's weights come with their architecture: another model.arch (or part) is refused, not ignored."""
    if pretrained is None or not cfg.model.sets_parts():
        return
    ours = cfg.model.parts()
    differ = [f"model.{cfg.model.PART_FIELDS[name]}={value}" for name, value in ours.items()
              if getattr(pretrained.config, name) != value]
    if differ:
        raise ConfigError(f"model.init_from={redact(pretrained.url)} has the {pretrained.config.arch} architecture, "
                          f"and {', '.join(differ)} asks for another: its weights cannot be loaded into it; leave "
                          "model.arch and its parts unset to train on the weights' own, or start without "
                          "model.init_from")


def _model_config(cfg: Config, data: PreparedData, pretrained: Pretrained | None, job: JobEnv) -> GPTConfig:
    if pretrained is None:
        return cfg.model.build(data.vocab_size, cfg.data.block_size)
    if pretrained.config.vocab_size != data.vocab_size:
        raise ConfigError(
            f"model.init_from={redact(pretrained.url)} has a vocabulary of {pretrained.config.vocab_size}, the data's "
            f"tokenizer ({data.tokenizer.describe()}) one of {data.vocab_size}; leave data.tokenizer at its default "
            "to use the tokenizer that came with the weights")
    if job.rank == 0:  # before the process group exists: the future leader
        log.info("model.init_from=%s: %s (instead of model=%s)", redact(pretrained.url), pretrained.describe(),
                 cfg.model.name)
    return replace(pretrained.config, dropout=cfg.model.dropout)


class Trainer:
    """The replica, the loop that advances it, and its components: checkpointer, agreement, report."""

    def __init__(self, cfg: Config, world: World, store: SnapshotStore, data: PreparedData, model_config: GPTConfig,
                 pretrained: Pretrained | None = None, hellaswag: HellaSwag | None = None):
        t = cfg.trainer
        self.cfg, self.data, self.pretrained = cfg, data, pretrained
        self.train_blocks = data.split("train", cfg.data.block_size)
        self.val_blocks = data.split("val", cfg.data.block_size)
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        model = GPT(model_config)  # in host memory: to the device whole (ddp), or shard by shard (fsdp)
        precision, self.precision_reason = choose_precision(t.precision, world.device, model_config.n_embd)
        self.autocast, scaler = autocast_for(precision, world.device)
        self.live = world.job.live is not None
        mode, self.parallelism_reason = parallel.choose(t.parallelism, model.num_params(False), world, self.live,
                                                        t.optimizer)
        if scaler is not None and mode != "ddp":
            raise ConfigError(f"trainer.precision=fp16 works with trainer.parallelism=ddp only (it needs a loss "
                              f"scaler across shards); use bf16 with {mode}")
        self.topology = parallel.Topology(world, mode)
        parallel.place(model, self.topology, compute_dtype(self.autocast))
        self.replica = Replica(model, build_optimizer(model, t, compute_dtype(self.autocast)), scaler, TrainState())
        self.ddp: DDP | None = None
        self.compile_cache: CompileCache | None = None
        self.checkpointer = Checkpointer(cfg, self.topology, store, data.tokenizer, data.fingerprint, self.replica)
        self.agreement: Agreement
        if self.live:
            self.agreement = live.LiveAgreement(self.topology, self.replica, self.checkpointer, t.global_batch_size,
                                                self._state_for_a_peer, self._heal).start()
        else:
            self.agreement = StepAgreement(world, self.checkpointer, t.global_batch_size)
        self.report = Report(cfg, world, store.run, model, compute_dtype(self.autocast),
                             speaks=world.is_leader and not self.live)
        self.progress = Progress(world.job.progress_dir, t.hang_timeout_s, t.dist_timeout_s)  # for its agent's watchdog
        self.hellaswag = agree(hellaswag, world, self.report.speaks) if t.hellaswag_every else None
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self._split = (0.0, 0.0)  # the last step's seconds waiting for data and computing on its own
        self._own_end = 0.0  # when this process's own work in the step ended

    @property
    def world(self) -> World:
        return self.topology.world

    @property
    def model(self) -> GPT:
        return self.replica.model

    def run(self, stop: StopFlag) -> TrainResult:
        cfg, t, state = self.cfg, self.cfg.trainer, self.replica.state
        resumed = resume(self.checkpointer, self.replica, self.world, self.pretrained, stop)
        self.agreement.resumed_at(state.step, state.samples_seen)
        if state.step >= t.max_steps:
            self.report.say("the run is already complete: step %d of trainer.max_steps=%d; nothing to do",
                            state.step, t.max_steps)
            self.finish()  # (the memory tier the resume started goes)
            return TrainResult(state.step, None, None)
        self._wrap_model()
        self.report.start(state.step, resumed, self._describe())
        self.report.log_again(state.ledger)  # what a memory tier held: its writer may have died before logging it
        # Window offsets are a function of (seed, position) only: any world size reads the same examples.
        order = window_order(cfg.data.windows, len(self.train_blocks.tokens), cfg.data.block_size, cfg.seed)
        while state.step < t.max_steps:
            started = time.perf_counter()
            outcome, share, samples = self.step(order, stop)
            last = state.step == t.max_steps or outcome.stops > 0
            if outcome.committed:  # (live mode: else the same step comes again, with the next quorum)
                self.report.step(state.step, outcome.loss, self.replica.optimizer.param_groups[0]["lr"], samples,
                                 share.count or self.world.world_size,  # (0: a live group that healed at the vote)
                                 self._split, time.perf_counter() - started, last)
                # On a stop request, skip evaluation: the snapshot must land inside the shutdown window.
                if (t.eval_every and state.step % t.eval_every == 0) or (last and not outcome.stops):
                    self.evaluate()
                if self.hellaswag and not outcome.stops and (state.step % t.hellaswag_every == 0 or last):
                    self.score_hellaswag()  # not on a stop request: it takes longer than a val loss
            periodic = outcome.committed and state.step % cfg.snapshot.every == 0
            if self.compile_cache is not None and outcome.committed:  # the lease's holder saves them
                self.compile_cache.after_step(self.checkpointer.store.lease, periodic or last)
            if (periodic or last or outcome.leaving) and self.agreement.writes:
                self.save()
            if outcome.stops:
                return self._stop(stop, outcome.stops)
        self.finish()
        self.report.say("done: step %d, train loss %.4f, val loss %.4f", state.step, self.train_loss, self.val_loss)
        return TrainResult(state.step, self.train_loss, self.val_loss)

    def step(self, order: WindowOrder, stop: StopFlag) -> tuple[Outcome, Share, str]:
        """One optimizer step over the next global batch, and the agreement on it. A failed step is rescued into a
        snapshot where it can be, then raised; an uncommitted step changes nothing."""
        t, state = self.cfg.trainer, self.replica.state
        self.progress.mark(state.step, "starting")  # live mode: the quorum waits for the Lighthouse's timeouts
        share = self.agreement.begin()  # live mode: the quorum, which heals this replica where it is behind
        self.progress.mark(state.step, "computing")
        starts = order.starts(state.samples_seen, t.global_batch_size)
        try:
            loss_sum = self._gradients(starts, share)
            outcome = self.agreement.exchange(loss_sum, stop.requested)
        except Exception:
            self.checkpointer.rescue(self.replica, self._snapshot_metrics())
            raise
        if self.live:
            self._follow_the_writer()
        self.agreement.enforce(outcome)
        if not outcome.committed:
            return outcome, share, ""
        self._update()
        if self.live:  # the vote may have healed this replica to the step the others trained
            starts = order.starts(state.samples_seen, t.global_batch_size)
        state.advance(t.global_batch_size, hashlib.sha256(starts.astype("<i8").tobytes()).hexdigest()[:16])
        self.checkpointer.after_step(outcome.generation)  # into the memory tier
        self.train_loss = outcome.loss
        if not math.isfinite(outcome.loss):
            self.finish()
            raise TrainingError(f"loss is {outcome.loss} at step {state.step}; lower trainer.lr or raise "
                                "trainer.warmup_steps, then run again to resume from the last snapshot")
        return outcome, share, state.ledger[-1][1]

    def _follow_the_writer(self) -> None:
        """Live mode: the group longest in the job writes the snapshots and metrics; its leader holds the lease."""
        writes = self.agreement.writes and self.world.is_leader
        self.checkpointer.hold_the_run(writes)  # before its first record: a run with metrics and no claim is watched
        self.report.speak(writes, self.replica.state)

    def _state_for_a_peer(self) -> dict:
        return {**self.replica.state_dict(), "train": self.replica.state.saved()}

    def _heal(self, received: dict) -> None:
        train = received.pop("train")
        # The peer's shards where sharded (a process heals from the process of its place in another node).
        state = placed_like(received, self.replica.state_dict())
        self.replica.load(state, False, train)
        log.info("healed from a live peer: step %d, %d examples seen", train["step"], train["samples_seen"])
        self.report.log_again(self.replica.state.ledger)

    def _wrap_model(self) -> None:
        self.compiled, self.compile_reason = choose_compile(self.cfg.trainer.compile, self.world.device)
        if self.compiled and self.cfg.trainer.compile_cache:  # the run's caches, before the first compile
            self.compile_cache = CompileCache(self.checkpointer.store.run, describe(
                self.model.config, self.world.device, compute_dtype(self.autocast), self.topology.mode),
                announce=self.world.job.local_rank == 0)  # each node: its machine may have other caches
            self.compile_cache.load()
        if self.compiled:
            self.progress.watch_compiles()  # a compile at any step is work, not a hang (training.watchdog)
            # In place, so state-dict keys keep their names (no _orig_mod. prefix).
            self.model.compile()
        self.ddp = parallel.replicate(self.model, self.topology, self.live)
        if self.ddp is not None:  # to time this process's own backward pass, for stragglers
            self.ddp.register_comm_hook(None, self._gradients_ready)
        if self.live and self.topology.sharded:
            parallel.reduce_across_nodes(self.model, lambda shard: self.agreement.average(shard).wait())

    def _describe(self) -> list[str]:
        cfg, t, world = self.cfg, self.cfg.trainer, self.world
        return [f"torch.compile {'on' if self.compiled else 'off'} ({self.compile_reason})",
                f"training {cfg.model.name} ({self.model.num_params() / 1e6:.2f}M parameters, {t.optimizer}) on "
                f"{self.data.tokenizer.describe()}: {t.global_batch_size} examples/step over {world.world_size} "
                f"process(es), {dtype_name(compute_dtype(self.autocast))} ({self.precision_reason}), "
                f"{world.device.type}, {self.topology.mode} ({self.parallelism_reason})",
                describe_windows(cfg, self.train_blocks)]

    def _stop(self, stop: StopFlag, stops: int) -> TrainResult:
        """Processes were asked to stop: every process saved the step, and this generation ends."""
        step = self.replica.state.step
        self.finish(release_memory=stop.requested)  # where the job goes on, the next round may read it
        if stop.requested:
            self.report.say("stopped at step %d on request; run the same command to resume", step)
        else:
            self.report.say("%d other process(es) were asked to stop: step %d is saved; the job goes on without "
                            "them", stops, step)
        return TrainResult(step, self.train_loss, self.val_loss, peer_stopped=not stop.requested)

    def _gradients(self, starts: np.ndarray, share: Share) -> float:
        """Forward and backward over this process's share of the windows at `starts`; returns sum(loss * examples)."""
        t, world = self.cfg.trainer, self.world
        self.replica.optimizer.zero_grad(set_to_none=True)
        if share.count == 0 and not self.live:
            return 0.0
        # Live mode: a process with no share still takes part in the backward pass's exchanges, adding nothing.
        mine, batches = (slice(0, 0), [None]) if share.count == 0 else \
            _my_micro_batches(len(starts), t.micro_batch_size, share, self.topology.sharded)
        # Gradients are averaged over processes; scaling each micro-batch's mean loss by (its examples * processes /
        # global batch) makes the result the full-batch gradient, also when the batch does not split evenly.
        scale = share.count / t.global_batch_size
        loss_sum = torch.zeros((), device=world.device)
        started, waited = time.perf_counter(), 0.0
        # Dropout masks are a function of the data position, not of the process or its history, seeded on the device's
        # own generator: torch.manual_seed also formats a stack trace, at every call, for each accelerator not started.
        generator = torch.default_generator if world.device.type == "cpu" else torch.get_device_module(world.device)
        for i, batch in enumerate(batches):
            first = mine.start + (batch.start if batch else 0)
            count = batch.stop - batch.start if batch else 0  # a padding micro-batch: run, but weigh nothing
            fetched = time.perf_counter()
            x, y = self.train_blocks.windows(starts[first : first + max(count, 1)])
            x, y = x.to(world.device, non_blocking=True), y.to(world.device, non_blocking=True)
            waited += time.perf_counter() - fetched
            generator.manual_seed((self.cfg.seed * 1_000_003 + self.replica.state.samples_seen + first) % 2**63)
            sync = i == len(batches) - 1
            with (nullcontext() if sync else parallel.no_sync(self.model, self.ddp)), self.autocast:
                _, loss = (self.ddp or self.replica.model)(x, y)
            weighted = loss * (count * scale)
            if sync:  # where the gradients are not exchanged bucket by bucket, its own work ends here
                self._own_end = time.perf_counter()
            (self.replica.scaler.scale(weighted) if self.replica.scaler else weighted).backward()
            loss_sum += loss.detach().float() * count
        self._split = (waited, self._own_end - started - waited)
        return loss_sum.item()

    def _update(self) -> None:
        t, updating = self.cfg.trainer, time.perf_counter()
        set_lr(self.replica.optimizer, t, self.replica.state.step)  # (live mode: of the step this replica healed to)
        self.checkpointer.before_update()  # the memory tier's copy of the last step must be complete
        if self.replica.scaler:
            self.replica.scaler.unscale_(self.replica.optimizer)  # clip the true gradients, not the scaled ones
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.replica.model.parameters(), t.grad_clip)
        if self.replica.scaler:
            self.replica.scaler.step(self.replica.optimizer)
            self.replica.scaler.update()
        else:
            self.replica.optimizer.step()
        self._split = (self._split[0], self._split[1] + time.perf_counter() - updating)

    def _gradients_ready(self, group, bucket):  # no annotation: DDP checks it, and ours are strings
        """DDP hands each bucket to this hook once computed: the last ends this process's own work in the step."""
        self._own_end = time.perf_counter()
        # Live mode: averaged across the step's groups (a process each under ddp), in flight while backward goes on.
        return self.agreement.average(bucket.buffer()) if self.live else allreduce_hook(group, bucket)

    def evaluate(self) -> None:
        step = self.replica.state.step
        with self.report.excluding():
            self.val_loss = evaluate(self.model, self.val_blocks, self.cfg, self.topology, self.autocast,
                                     lambda: self.progress.mark(step, "evaluating"))
        self.report.evaluation(step, self.val_loss)

    def score_hellaswag(self) -> None:
        step = self.replica.state.step
        with self.report.excluding():
            tally = self.hellaswag.score(self.model, self.topology, self.autocast,
                                         lambda: self.progress.mark(step, "evaluating"))
        self.report.hellaswag(step, tally)

    def save(self) -> None:
        self.progress.mark(self.replica.state.step, "saving")
        if self.world.is_leader:
            self.report.metrics.flush()  # what the dashboards show survives as long as the snapshot
        with self.report.excluding():
            self.checkpointer.save(self.replica, self._snapshot_metrics())

    def finish(self, release_memory: bool = True) -> None:
        self.progress.mark(self.replica.state.step, "saving")
        self.report.metrics.close()
        if self.compile_cache is not None:  # while this process still holds the lease it saves them under
            self.compile_cache.finish()
        self.checkpointer.finish(release_memory)
        self.progress.close()
        self.agreement.close()

    def _snapshot_metrics(self) -> dict:
        return {"train_loss": self.train_loss, "val_loss": self.val_loss}


@torch.no_grad()
def evaluate(model: GPT, blocks: TokenBlocks, cfg: Config, topology: parallel.Topology, autocast,
             tick=lambda: None) -> float:
    """Mean loss over the first `eval_samples` validation blocks, whatever `data.windows` says, so that runs compare."""
    count = min(cfg.trainer.eval_samples, len(blocks))
    world = topology.world
    mine, batches = _my_micro_batches(count, cfg.trainer.micro_batch_size, Share(world.rank, world.world_size),
                              topology.sharded)
    model.eval()
    loss_sum = 0.0
    for batch in batches:
        start, size = (mine.start + batch.start, batch.stop - batch.start) if batch else (0, 0)
        x, y = blocks.batch(range(start, start + max(size, 1)))
        with autocast:
            _, loss = model(x.to(world.device), y.to(world.device))
        loss_sum += loss.item() * size
        tick()
    model.train()
    return distributed.all_reduce_sum([loss_sum], world)[0] / count


def _my_micro_batches(total: int, micro_batch_size: int, share: Share, sharded: bool) -> tuple[slice, list]:
    """This process's part of `total` examples, and its micro-batches. A sharded model's forward is a collective, so
    there every process runs as many as the one with the largest part: None pads the list (run, weigh zero)."""
    mine = shard(total, share.count, share.index)
    batches = micro_batches(mine.stop - mine.start, micro_batch_size)
    if sharded:
        largest = math.ceil(total / share.count)
        batches += [None] * (len(micro_batches(largest, micro_batch_size)) - len(batches))
    return mine, batches


def _check_batch(cfg: Config, world_size: int) -> None:
    if cfg.trainer.global_batch_size < world_size:
        raise ConfigError(
            f"trainer.global_batch_size={cfg.trainer.global_batch_size} cannot be served by "
            f"{world_size} processes: each needs at least one example per step. Raise "
            "trainer.global_batch_size to at least the number of processes, or start fewer"
        )

"""The elastic training loop.

Every start, whether the first, a torchrun restart after a crash, or a restart after nodes
left or joined, runs the same steps: prepare (or reuse) the data, join the process group,
load the newest complete snapshot, and train from its step to `max_steps`. The state of a
run is the replica's state alone (weights, optimizer, step, examples consumed), so any
single process can snapshot it and any number of processes can resume it (see checkpointer).
"""

from __future__ import annotations

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

from mingpt.checkpoint.load import snapshot_store
from mingpt.checkpoint.store import SnapshotStore
from mingpt.data.prepared import PreparedData, TokenBlocks
from mingpt.data.sampler import micro_batches, shard, window_order
from mingpt.errors import ConfigError, PeerLeft, TrainingError, forget_stops, raise_stopped
from mingpt.interop.pretrained import Pretrained, open_pretrained
from mingpt.metrics.loggers import Loggers
from mingpt.model import GPT, GPTConfig
from mingpt.storage import redact
from mingpt.training import distributed, parallel
from mingpt.training.checkpointer import Checkpointer
from mingpt.training.config import Config
from mingpt.training.distributed import World
from mingpt.training.launcher import PEER_STOPPED, membership_change
from mingpt.training.performance import Throughput, flops_per_token, mfu, peak_flops, peak_memory_bytes
from mingpt.training.precision import autocast_for, choose_compile, choose_precision, compute_dtype, dtype_name
from mingpt.training.preparation import prepare_data
from mingpt.training.progress import Progress
from mingpt.training.schedule import set_lr
from mingpt.training.state import Replica, TrainState
from mingpt.training.stragglers import StepTimes

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step: int
    train_loss: float | None
    val_loss: float | None
    stopped_early: bool = False
    peer_stopped: bool = False  # stopped because a process on another node was asked to, not this one


class StopFlag:
    """Set by SIGTERM (torchrun and SLURM send it before killing) or Ctrl-C: finish the step,
    snapshot, exit. A second Ctrl-C aborts at once. No collectives here: only a flag."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @contextmanager
    def at_once(self) -> Iterator[None]:
        """Within, SIGTERM and Ctrl-C stop at once (Stopped), as they do before training: for a long wait
        before the first step (model.init_from's weights downloading), which has no step to finish."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, raise_stopped)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("%s received: stopping after this step with a snapshot", signal.Signals(signum).name)


def train(cfg: Config) -> TrainResult:
    """Run (or resume) the job `cfg` describes; returns when `max_steps` is reached or a stop was requested."""
    launch = distributed.check_launch()  # first: a launch that is inconsistent or would deadlock fails before any work
    _check_batch(cfg, launch.world_size)
    distributed.check_store_sharing()
    # SIGTERM (torchrun's at every membership change) before the training loop stops preparation at once,
    # through its cleanups (worker processes, temporary folders, the lease); the loop has its own StopFlag.
    previous = signal.signal(signal.SIGTERM, raise_stopped)
    forget_stops()
    try:
        return _train(cfg)
    finally:
        signal.signal(signal.SIGTERM, previous)
        forget_stops()


def _train(cfg: Config) -> TrainResult:
    meeting = distributed.meet(cfg.trainer.dist_timeout_s)  # first: peers wait for this process while it prepares
    store = snapshot_store(cfg.snapshot.dir, keep=cfg.snapshot.keep, storage_options=cfg.snapshot.storage_options)
    store.check_writable()
    # The leader of this generation claims the run before any data work: a second job started
    # into the same snapshot.dir by mistake stops here, and a worker left from an older generation
    # can no longer commit (see mingpt.checkpoint.lease).
    with store.claim(cfg.snapshot.lease_timeout_s) if distributed.leads_this_generation() else nullcontext():
        pretrained = open_pretrained(cfg.model.init_from, cfg.data.block_size) if cfg.model.init_from else None
        data = PreparedData(prepare_data(cfg, pretrained))
        model_config = _model_config(cfg, data, pretrained)
        world = distributed.start(cfg.trainer.dist_timeout_s, meeting)
        try:
            with StopFlag() as stop, _a_lost_peer_ends_the_generation():
                result = Trainer(cfg, world, store, data, model_config, pretrained).run(stop)
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
    """A collective that fails because another process died, hung or was cut off ends this generation
    (PeerLeft): it is no failure of this process, whose rescue snapshot is written by then."""
    try:
        yield
    except Exception as e:
        if distributed.lost_a_peer(e):
            raise distributed.peer_lost(e) from e
        raise


def _model_config(cfg: Config, data: PreparedData, pretrained: Pretrained | None) -> GPTConfig:
    if pretrained is None:
        return cfg.model.build(data.vocab_size, cfg.data.block_size)
    if pretrained.config.vocab_size != data.vocab_size:
        raise ConfigError(
            f"model.init_from={redact(pretrained.url)} has a vocabulary of {pretrained.config.vocab_size}, the data's "
            f"tokenizer ({data.tokenizer.describe()}) one of {data.vocab_size}; leave data.tokenizer at its default "
            "to use the tokenizer that came with the weights")
    _log_if_leading("model.init_from=%s: %s (instead of model=%s)", redact(pretrained.url), pretrained.describe(),
                    cfg.model.name)
    return replace(pretrained.config, dropout=cfg.model.dropout)


class Trainer:
    """The replica (model, optimizer, TrainState), the loop that advances it, and its components."""

    def __init__(self, cfg: Config, world: World, store: SnapshotStore, data: PreparedData, model_config: GPTConfig,
                 pretrained: Pretrained | None = None):
        t = cfg.trainer
        self.cfg, self.world, self.data, self.pretrained = cfg, world, data, pretrained
        self.train_blocks = data.split("train", cfg.data.block_size)
        self.val_blocks = data.split("val", cfg.data.block_size)
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        model = GPT(model_config)  # in host memory: to the device whole (ddp), or shard by shard (fsdp)
        precision, self.precision_reason = choose_precision(t.precision, world.device, model_config.n_embd)
        self.autocast, scaler = autocast_for(precision, world.device)
        self.parallelism, self.parallelism_reason = parallel.choose(t.parallelism, model.num_params(False), world)
        if scaler is not None and self.parallelism != "ddp":
            raise ConfigError(f"trainer.precision=fp16 works with trainer.parallelism=ddp only (it needs a loss "
                              f"scaler across shards); use bf16 with {self.parallelism}")
        parallel.shard(model, self.parallelism, world, compute_dtype(self.autocast))  # moves each shard
        if not parallel.is_sharded(model):
            model.to(world.device)
        optimizer = torch.optim.AdamW(model.param_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                      fused=True)  # one kernel for all parameters: 2.9 -> 1.2 ms on CPU
        self.replica = Replica(model, optimizer, scaler, TrainState())
        self.ddp: DDP | None = None
        self.checkpointer = Checkpointer(cfg, world, store, data.tokenizer, data.fingerprint, self.replica)
        self.metrics = Loggers(t.loggers, store.run, cfg.to_dict(), world.is_leader)  # trainer.loggers
        self.events: list[tuple[str, str]] = []  # (kind, text): what resume found, marked on the dashboards
        self.steps_lost: int | None = None  # at a resume: steps reached before it and not in the state loaded
        # What changed in the job's membership before this generation, as mingpt-torchrun's agent saw it.
        self.change = membership_change() if world.is_leader else None
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self.peak: float | None = None  # FLOP/s of one process, for MFU (known to the leader)
        self.flops_per_token = flops_per_token(model_config, model.num_params())
        self.progress = Progress(t.hang_timeout_s)  # for the agent's watchdog (mingpt.training.watchdog)
        self._split = (0.0, 0.0)  # the last step's seconds waiting for data and computing on its own
        self._own_end = 0.0  # when this process's own work in the step ended

    @property
    def model(self) -> GPT:
        return self.replica.model

    def resume(self, stop: StopFlag) -> None:
        """Load the newest state: in a node's memory tier, or else the newest verified snapshot; the same
        in every process. Or start a new run."""
        snapshot = self.checkpointer.latest()
        memory = self.checkpointer.load_newer_from_memory(snapshot)
        if snapshot is None and memory is None:
            if self.pretrained:  # a new run: its weights, a fresh optimizer, step 0
                with stop.at_once():  # a download may take minutes
                    weights = self.pretrained.load()
                self.model.load_state_dict(weights)
                _log(self.world, "initialised from model.init_from=%s", redact(self.pretrained.url))
            return
        if self.pretrained:
            _log(self.world, "model.init_from=%s is not read: this run resumes from its own snapshot",
                 redact(self.pretrained.url))
        state = self.replica.state
        if memory is None:
            self.checkpointer.load(snapshot, self.replica)
            source, before = snapshot.url, snapshot.manifest.get("world_size")
        else:
            durable = f"step {snapshot.manifest['step']}" if snapshot else "none"
            source = f"the memory tier of {', '.join(memory['hosts'])} (the last snapshot: {durable})"
            before = memory["world_size"]
        _log(self.world, "resumed from %s: step %d, %d examples seen, now %d process(es)",
             source, state.step, state.samples_seen, self.world.world_size)
        if self.checkpointer.reached:  # known where a memory tier recorded the steps
            self.steps_lost = max(0, self.checkpointer.reached - state.step)
            _log(self.world, "steps lost: %d (step %d was reached before the restart)", self.steps_lost,
                 self.checkpointer.reached)
        now = self.world.world_size
        self.events.append(("restart", f"resumed from step {state.step} with {now} process(es)"))
        if before is not None and before != now:
            self.events.append(("world_size_change", f"{before} -> {now} processes at step {state.step}"))

    def run(self, stop: StopFlag) -> TrainResult:
        cfg, t, world = self.cfg, self.cfg.trainer, self.world
        self.resume(stop)
        state = self.replica.state
        if state.step >= t.max_steps:
            _log(world, "the run is already complete: step %d of trainer.max_steps=%d; nothing to do",
                 state.step, t.max_steps)
            return TrainResult(state.step, None, None)
        self.metrics.start(state.step)
        for kind, text in self.events:
            self.metrics.mark(state.step, kind, text)
        if self.steps_lost is not None:
            self.metrics.log(state.step, {"steps_lost": self.steps_lost})
        use_compile, compile_reason = choose_compile(t.compile, world.device)
        if use_compile:
            # In place, so state-dict keys keep their names (no _orig_mod. prefix). Inductor caches what it
            # compiled (TORCHINDUCTOR_CACHE_DIR), so a restart on the same machine compiles in seconds.
            self.model.compile()
        _log(world, "torch.compile %s (%s)", "on" if use_compile else "off", compile_reason)
        self.ddp = parallel.replicate(self.model, world)
        if self.ddp is not None:  # to time this process's own backward pass, for stragglers
            self.ddp.register_comm_hook(None, self._gradients_ready)
        # Window offsets are a function of (seed, position) only: any world size reads the same examples.
        order = window_order(cfg.data.windows, len(self.train_blocks.tokens), cfg.data.block_size, cfg.seed)
        _log(world, "training %s (%.2fM parameters) on %s: %d examples/step over %d process(es), %s (%s), %s, "
             "%s (%s)", cfg.model.name, self.model.num_params() / 1e6, self.data.tokenizer.describe(),
             t.global_batch_size, world.world_size, dtype_name(compute_dtype(self.autocast)), self.precision_reason,
             world.device.type, self.parallelism, self.parallelism_reason)
        _log(world, "%s", _describe_windows(cfg, self.train_blocks))
        if t.warmup_steps >= t.max_steps and world.is_leader:
            log.warning("trainer.warmup_steps=%d is not below trainer.max_steps=%d: the whole run warms the learning "
                        "rate up (trainer.lr=%g comes at step %d); lower trainer.warmup_steps", t.warmup_steps,
                        t.max_steps, t.lr, t.warmup_steps)

        throughput = Throughput(t.global_batch_size * cfg.data.block_size)
        if world.is_leader:  # the one process that reports MFU
            self.peak, source = peak_flops(world.device, compute_dtype(self.autocast))
            _log(world, "MFU is measured against %.1f GFLOP/s per process, from %s", self.peak / 1e9, source)
        self.step_times = StepTimes(world, self.metrics)
        while state.step < t.max_steps:
            set_lr(self.replica.optimizer, t, state.step)
            self.progress.mark(state.step, "computing")
            started = time.perf_counter()
            try:
                loss_sum = self._step(order.starts(state.samples_seen, t.global_batch_size))
                state.step += 1
                state.samples_seen += t.global_batch_size
                # One small collective per step: the global loss, whether any process must stop, and two
                # things only the leader knows: whether snapshots keep failing, whether it lost the run.
                loss_total, stops, failing, lost = distributed.all_reduce_sum(
                    [loss_sum, float(stop.requested), *map(float, self.checkpointer.problems())], world)
            except Exception:
                self.checkpointer.rescue(self.replica, self._snapshot_metrics())
                raise
            self.checkpointer.stop_on(failing, lost)
            self.checkpointer.after_step()  # into the memory tier
            self.step_times.add(*self._split, time.perf_counter() - started)
            self.step_times.end_of_step(state.step)
            self.train_loss = loss_total / t.global_batch_size
            if not math.isfinite(self.train_loss):
                self.finish()
                raise TrainingError(f"loss is {self.train_loss} at step {state.step}; lower trainer.lr or raise "
                                    "trainer.warmup_steps, then run again to resume from the last snapshot")
            last = state.step == t.max_steps or stops > 0
            throughput.step()
            if self.change is not None:
                self._log_membership()
            if state.step % t.log_every == 0 or last:
                self._log_progress(throughput)
            # On a stop request, skip evaluation: the snapshot must land inside the shutdown window.
            if (t.eval_every and state.step % t.eval_every == 0) or (last and not stops):
                tick = lambda: self.progress.mark(state.step, "evaluating")
                with throughput.excluding():
                    self.val_loss = evaluate(self.model, self.val_blocks, cfg, world, self.autocast, tick)
                _log(world, "step %d | val loss %.4f", state.step, self.val_loss)
                self.metrics.log(state.step, {"val_loss": self.val_loss})
            if state.step % cfg.snapshot.every == 0 or last:
                with throughput.excluding():
                    self.save()
            if stops > 0:
                self.finish(release_memory=stop.requested)  # where the job goes on, the next round may read it
                if stop.requested:
                    _log(world, "stopped at step %d on request; run the same command to resume", state.step)
                else:
                    _log(world, "%d other process(es) were asked to stop: step %d is saved; the job goes on without "
                         "them", stops, state.step)
                return TrainResult(state.step, self.train_loss, self.val_loss, stopped_early=True,
                                   peer_stopped=not stop.requested)
        self.finish()
        _log(world, "done: step %d, train loss %.4f, val loss %.4f", state.step, self.train_loss, self.val_loss)
        return TrainResult(state.step, self.train_loss, self.val_loss)

    def _step(self, starts: np.ndarray) -> float:
        """One optimizer step over this process's slice of the global batch, the windows at token
        offsets `starts`; returns sum(loss * examples)."""
        t, world = self.cfg.trainer, self.world
        mine, pieces = _my_pieces(len(starts), t.micro_batch_size, world, self.model)
        # DDP and FSDP average gradients over processes; scaling each micro-batch's mean loss by
        # (its examples * world size / global batch) makes the result the full-batch gradient,
        # also when the batch does not split evenly.
        scale = world.world_size / t.global_batch_size
        loss_sum = torch.zeros((), device=world.device)
        started, waited = time.perf_counter(), 0.0
        self.replica.optimizer.zero_grad(set_to_none=True)
        for i, piece in enumerate(pieces):
            first = mine.start + (piece or pieces[0]).start
            count = piece.stop - piece.start if piece else 0  # a padding piece: run, but weigh nothing
            fetched = time.perf_counter()
            x, y = self.train_blocks.windows(starts[first : first + max(count, 1)])
            x, y = x.to(world.device, non_blocking=True), y.to(world.device, non_blocking=True)
            waited += time.perf_counter() - fetched
            # Dropout masks are a function of the data position, not of the process or its history.
            torch.manual_seed((self.cfg.seed * 1_000_003 + self.replica.state.samples_seen + first) % 2**63)
            sync = i == len(pieces) - 1
            with (nullcontext() if sync else parallel.no_sync(self.model, self.ddp)), self.autocast:
                _, loss = (self.ddp or self.replica.model)(x, y)
            weighted = loss * (count * scale)
            if sync:  # where the gradients are not exchanged bucket by bucket, its own work ends here
                self._own_end = time.perf_counter()
            (self.replica.scaler.scale(weighted) if self.replica.scaler else weighted).backward()
            loss_sum += loss.detach().float() * count
        updating = time.perf_counter()  # the gradients are everyone's now: what follows is this process's own again
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
        loss = loss_sum.item()
        self._split = (waited, self._own_end - started - waited + time.perf_counter() - updating)
        return loss

    def _gradients_ready(self, group, bucket):  # no annotation: DDP checks it, and ours are strings
        """DDP hands each bucket of gradients to this hook as soon as this process has computed them: the last
        one ends this process's own work in the step (what comes after is waiting for the others)."""
        self._own_end = time.perf_counter()
        return allreduce_hook(group, bucket)

    def _log_progress(self, throughput: Throughput) -> None:
        t, step = self.cfg.trainer, self.replica.state.step
        rate, seconds_per_step, elsewhere = throughput.read()  # tokens/s of training: evaluations and saves left out
        lr = self.replica.optimizer.param_groups[0]["lr"]
        used = self._mfu(rate)
        memory = peak_memory_bytes(self.world.device)
        slow = f" | slow: {', '.join(sorted(self.step_times.slow))}" if self.step_times.slow else ""
        _log(self.world, "step %d/%d | loss %.4f | lr %.2e | %.0f tokens/s | MFU %.1f%% | %.0f MB | ETA %s%s", step,
             t.max_steps, self.train_loss, lr, rate, 100 * used, memory / 1e6,
             _duration((t.max_steps - step) * seconds_per_step), slow)
        self.metrics.log(step, {"train_loss": self.train_loss, "lr": lr, "tokens_per_s": rate,
                                "other_s": round(elsewhere, 3),
                                "mfu": used, "peak_memory_mb": memory / 1e6, "world_size": self.world.world_size})

    def _log_membership(self) -> None:
        """At the generation's first step, a metrics record of its nodes and of what changed before it, as the
        agent saw it; and where nodes left or joined, one line: who left and how, who joined, the new size,
        the steps lost, the time from the change to this step."""
        change, self.change = self.change, None
        left, joined, members = (change.get(key) or [] for key in ("left", "joined", "members"))
        seconds = time.time() - float(change.get("noticed") or time.time())
        record = {"left": left, "joined": joined, "members": members, "cause": change.get("cause"),
                  "world_size": self.world.world_size, "steps_lost": self.steps_lost}
        self.metrics.log(self.replica.state.step, {"membership": record, "recovery_s": round(seconds, 2)})
        if change.get("cause") and not (left or joined):  # a restart within the same nodes: a hang, a failure
            self.metrics.log(self.replica.state.step, {"restart": change["cause"]})
            _log(self.world, "restart: %s; steps lost %s; this step %.1f s after it", change["cause"],
                 "unknown" if self.steps_lost is None else self.steps_lost, seconds)
        if left or joined:
            how = f" ({change['cause']})" if left and change.get("cause") else ""
            _log(self.world, "membership change: left %s%s; joined %s; now %d node(s), %d process(es); steps lost "
                 "%s; this step %.1f s after the change", ", ".join(left) or "none", how,
                 ", ".join(joined) or "none", len(members), self.world.world_size,
                 "unknown" if self.steps_lost is None else self.steps_lost, seconds)

    def _mfu(self, tokens_per_s: float) -> float:
        """MFU of this run (leader only; NaN elsewhere). Above 100% the peak was probed on a busy machine:
        probe again, keeping the higher figure."""
        if not self.peak:
            return float("nan")
        used = mfu(self.flops_per_token, tokens_per_s, self.peak * self.world.world_size)
        if used > 1:
            self.peak, _ = peak_flops(self.world.device, compute_dtype(self.autocast), measure=True)
            used = mfu(self.flops_per_token, tokens_per_s, self.peak * self.world.world_size)
        return used

    def save(self) -> None:
        self.progress.mark(self.replica.state.step, "saving")
        if self.world.is_leader:
            self.metrics.flush()  # what the dashboards show survives as long as the snapshot
        self.checkpointer.save(self.replica, self._snapshot_metrics())

    def finish(self, release_memory: bool = True) -> None:
        self.progress.mark(self.replica.state.step, "saving")
        self.metrics.close()
        self.checkpointer.finish(release_memory)
        self.progress.close()

    def _snapshot_metrics(self) -> dict:
        return {"train_loss": self.train_loss, "val_loss": self.val_loss}


def _describe_windows(cfg: Config, blocks: TokenBlocks) -> str:
    """What the run will read. Progress is in tokens, not epochs: random windows have no epochs."""
    t = cfg.trainer
    if cfg.data.windows == "random":
        kind = f"windows at any of {blocks.num_starts:,} offsets"
    else:
        kind = f"{len(blocks):,} fixed blocks, shuffled afresh each epoch,"
    passes = t.max_steps * t.global_batch_size * cfg.data.block_size / len(blocks.tokens)
    return (f"data.windows={cfg.data.windows}: {kind} of the {len(blocks.tokens):,} training tokens; "
            f"{t.max_steps} steps read {passes:.2f}x that many tokens")


@torch.no_grad()
def evaluate(model: GPT, blocks: TokenBlocks, cfg: Config, world: World, autocast, tick=lambda: None) -> float:
    """Mean loss over the first `eval_samples` validation blocks, shared among all processes; `tick()` after
    each batch (progress, for the agent's watchdog).

    Fixed blocks, whatever `data.windows` says: every evaluation measures the same text, so
    evaluations of one run, and of runs that sample windows differently, compare."""
    count = min(cfg.trainer.eval_samples, len(blocks))
    mine, pieces = _my_pieces(count, cfg.trainer.micro_batch_size, world, model)
    model.eval()
    loss_sum = 0.0
    for piece in pieces:
        start, size = (mine.start + piece.start, piece.stop - piece.start) if piece else (0, 0)
        x, y = blocks.batch(range(start, start + max(size, 1)))
        with autocast:
            _, loss = model(x.to(world.device), y.to(world.device))
        loss_sum += loss.item() * size
        tick()
    model.train()
    return distributed.all_reduce_sum([loss_sum], world)[0] / count


def _my_pieces(total: int, micro_batch_size: int, world: World, model: torch.nn.Module) -> tuple[slice, list]:
    """This process's share of `total` examples, and its micro-batches (slices of the share). A sharded
    model's forward is a collective, so there every process runs as many as the one with the largest
    share: None pads the list, a piece to run on any example and weigh zero."""
    mine = shard(total, world.world_size, world.rank)
    pieces = micro_batches(mine.stop - mine.start, micro_batch_size)
    if parallel.is_sharded(model):
        largest = math.ceil(total / world.world_size)
        pieces += [None] * (len(micro_batches(largest, micro_batch_size)) - len(pieces))
    return mine, pieces


def _check_batch(cfg: Config, world_size: int) -> None:
    if cfg.trainer.global_batch_size < world_size:
        raise ConfigError(
            f"trainer.global_batch_size={cfg.trainer.global_batch_size} cannot be served by "
            f"{world_size} processes: each needs at least one example per step. Raise "
            "trainer.global_batch_size to at least the number of processes, or start fewer"
        )


def _log(world: World, message: str, *args) -> None:
    if world.is_leader:
        log.info(message, *args)


def _log_if_leading(message: str, *args) -> None:
    """_log before the process group exists: in the process that will lead this generation."""
    if distributed.leads_this_generation():
        log.info(message, *args)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"

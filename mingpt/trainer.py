"""The elastic training loop.

Every start, whether the first, a torchrun restart after a crash, or a restart after nodes
left or joined, runs the same steps: prepare (or reuse) the data, join the process group,
load the newest complete snapshot, and train from its step to `max_steps`. The state of a
run is the replica's state alone (weights, optimizer, step, examples consumed), so any
single process can snapshot it and any number of processes can resume it.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mingpt
from mingpt import distributed
from mingpt.config import Config
from mingpt.data import PreparedData, TokenBlocks
from mingpt.performance import choose_compile, choose_precision, flops_per_token, mfu, peak_flops, peak_memory_bytes
from mingpt.prepare import prepare
from mingpt.pretrained import Pretrained, open_pretrained
from mingpt.errors import TrainingError
from mingpt.distributed import World
from mingpt.model import GPT, GPTConfig
from mingpt.sampler import micro_batches, shard, window_order
from mingpt.lease import LeaseLostError
from mingpt.loggers import Loggers
from mingpt.snapshot import Snapshot, SnapshotError, SnapshotStore, SnapshotWriter
from mingpt.storage import explain_storage_error
from mingpt.tokenizers import Tokenizer, tokenizer_from_dict

log = logging.getLogger(__name__)

# The parts of GPTConfig that decide the shape of the weights.
SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "tie_weights")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    samples_seen: int = 0  # the data cursor: examples consumed from the global stream (mingpt.sampler)


@dataclass
class TrainResult:
    step: int
    train_loss: float | None
    val_loss: float | None
    stopped_early: bool = False


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

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("%s received: stopping after this step with a snapshot", signal.Signals(signum).name)


def train(cfg: Config) -> TrainResult:
    """Run (or resume) the job `cfg` describes; returns when `max_steps` is reached or a stop was requested."""
    distributed.check_store_sharing()  # first: a launch that would deadlock fails before any work
    store = SnapshotStore(cfg.snapshot.dir, keep=cfg.snapshot.keep, storage_options=cfg.snapshot.storage_options)
    store.check_writable()
    # The leader of this generation claims the run before any data work: a second job started
    # into the same snapshot.dir by mistake stops here, and a worker left from an older generation
    # can no longer commit (see mingpt.lease).
    with store.claim(cfg.snapshot.lease_timeout_s) if distributed.leads_this_generation() else nullcontext():
        d = cfg.data
        pretrained = open_pretrained(cfg.model.init_from, d.block_size) if cfg.model.init_from else None
        data = PreparedData(prepare(d.corpus, _tokenizer(cfg, pretrained), d.vocab_size, d.prepared_dir,
                                    d.val_fraction, text_field=d.text_field, bpe_sample_bytes=d.bpe_sample_bytes,
                                    num_workers=d.num_workers))
        model_config = _model_config(cfg, data, pretrained)
        world = distributed.start(cfg.trainer.dist_timeout_s)
        try:
            _check_batch(cfg, world)
            with StopFlag() as stop:
                result = Trainer(cfg, world, store, data, model_config, pretrained).run(stop)
            distributed.barrier(world)  # leave together: a process torn down while a peer still talks to it aborts
            return result
        finally:
            distributed.stop()


def _tokenizer(cfg: Config, pretrained: Pretrained | None) -> str:
    """data.tokenizer, or the tokenizer of model.init_from where data.tokenizer is left at its default."""
    default = type(cfg.data)().tokenizer
    if pretrained is None or cfg.data.tokenizer != default:
        return cfg.data.tokenizer
    _log_if_leading("data.tokenizer: the tokenizer of model.init_from (%s)", pretrained.tokenizer)
    return pretrained.tokenizer


def _model_config(cfg: Config, data: PreparedData, pretrained: Pretrained | None) -> GPTConfig:
    if pretrained is None:
        return cfg.model.build(data.vocab_size, cfg.data.block_size)
    if pretrained.config.vocab_size != data.vocab_size:
        raise mingpt.ConfigError(
            f"model.init_from={pretrained.url} has a vocabulary of {pretrained.config.vocab_size}, the data's "
            f"tokenizer ({data.tokenizer.describe()}) one of {data.vocab_size}; leave data.tokenizer at its default "
            "to use the tokenizer that came with the weights")
    _log_if_leading("model.init_from=%s: %s (instead of model=%s)", pretrained.url, pretrained.describe(),
                    cfg.model.name)
    return replace(pretrained.config, dropout=cfg.model.dropout)


class Trainer:
    """The replica's state (model, optimizer, TrainState) and the loop that advances it."""

    def __init__(self, cfg: Config, world: World, store: SnapshotStore, data: PreparedData, model_config: GPTConfig,
                 pretrained: Pretrained | None = None):
        t = cfg.trainer
        self.cfg, self.world, self.store, self.data, self.pretrained = cfg, world, store, data, pretrained
        self.train_blocks = data.split("train", cfg.data.block_size)
        self.val_blocks = data.split("val", cfg.data.block_size)
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        self.model = GPT(model_config).to(world.device)
        self.optimizer = torch.optim.AdamW(self.model.param_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                           fused=True)  # one kernel for all parameters: 2.9 -> 1.2 ms on CPU
        precision, self.precision_reason = choose_precision(t.precision, world.device, model_config.n_embd)
        self.autocast, self.scaler = _precision(precision, world.device)
        self.ddp: DDP | None = None
        self.state = TrainState()
        self.writer = SnapshotWriter(store, cfg.snapshot.async_save, cfg.snapshot.max_failures)
        self.metrics = Loggers(t.loggers, store, world, cfg.to_dict())  # trainer.loggers; the leader's alone
        self.events: list[tuple[str, str]] = []  # (kind, text): what resume found, marked on the dashboards
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self.peak: float | None = None  # FLOP/s of one process, for MFU (known to the leader)
        self.flops_per_token = flops_per_token(model_config, self.model.num_params())

    def resume(self) -> None:
        """Load the newest verified snapshot, the same one in every process."""
        snapshot = _choose_snapshot(self.store, self.world)
        if snapshot is None:
            if self.pretrained:  # a new run: its weights, a fresh optimizer, step 0
                self.model.load_state_dict(self.pretrained.load())
                _log(self.world, "initialised from model.init_from=%s", self.pretrained.url)
            return
        if self.pretrained:
            _log(self.world, "model.init_from=%s is not read: this run resumes from its own snapshot",
                 self.pretrained.url)
        _check_compatible(snapshot, self.model.config, self.data.tokenizer)
        self.model.load_state_dict(snapshot.load_tensors("model.pt", self.world.device))
        configured = [_hyperparameters(group) for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(snapshot.load_tensors("optimizer.pt", self.world.device))
        self._apply_configured(configured)
        if self.scaler is not None and "scaler.pt" in snapshot.manifest["files"]:
            self.scaler.load_state_dict(snapshot.load_tensors("scaler.pt"))
        self.state = TrainState(snapshot.manifest["step"], snapshot.manifest["samples_seen"])
        _log(self.world, "resumed from %s: step %d, %d examples seen, now %d process(es)",
             snapshot.url, self.state.step, self.state.samples_seen, self.world.world_size)
        before, now = snapshot.manifest.get("world_size"), self.world.world_size
        self.events.append(("restart", f"resumed from step {self.state.step} with {now} process(es)"))
        if before is not None and before != now:
            self.events.append(("world_size_change", f"{before} -> {now} processes at step {self.state.step}"))
        changed = _changed_settings(snapshot.manifest.get("config", {}), self.cfg.to_dict())
        if changed:
            _log(self.world, "settings changed since that snapshot: %s", ", ".join(changed))

    def _apply_configured(self, configured: list[dict]) -> None:
        """`load_state_dict` brings back the saved betas, weight decay, ...; this run's config wins."""
        for group, wanted in zip(self.optimizer.param_groups, configured):
            for key, value in wanted.items():
                if key != "lr" and group.get(key) != value:  # lr is set every step from the schedule
                    _log(self.world, "optimizer %s: %s in the snapshot, %s in the config: using the config",
                         key, group.get(key), value)
                    group[key] = value

    def run(self, stop: StopFlag) -> TrainResult:
        cfg, t, world = self.cfg, self.cfg.trainer, self.world
        self.resume()
        state = self.state
        if state.step >= t.max_steps:
            _log(world, "the run is already complete: step %d of trainer.max_steps=%d; nothing to do",
                 state.step, t.max_steps)
            return TrainResult(state.step, None, None)
        self.metrics.start(state.step)
        for kind, text in self.events:
            self.metrics.mark(state.step, kind, text)
        use_compile, compile_reason = choose_compile(t.compile, world.device)
        if use_compile:
            # In place, so state-dict keys keep their names (no _orig_mod. prefix). Inductor caches what it
            # compiled (TORCHINDUCTOR_CACHE_DIR), so a restart on the same machine compiles in seconds.
            self.model.compile()
        _log(world, "torch.compile %s (%s)", "on" if use_compile else "off", compile_reason)
        if world.distributed:
            self.ddp = DDP(self.model, device_ids=[world.device] if world.device.type == "cuda" else None)
        # Window offsets are a function of (seed, position) only: any world size reads the same examples.
        order = window_order(cfg.data.windows, len(self.train_blocks.tokens), cfg.data.block_size, cfg.seed)
        _log(world, "training %s (%.2fM parameters) on %s: %d examples/step over %d process(es), %s (%s), %s",
             cfg.model.name, self.model.num_params() / 1e6, self.data.tokenizer.describe(), t.global_batch_size,
             world.world_size, autocast_name(self.autocast), self.precision_reason, world.device.type)
        _log(world, "%s", _describe_windows(cfg, self.train_blocks))

        progress = _Progress(t.global_batch_size * cfg.data.block_size)
        if world.is_leader:  # the one process that reports MFU
            self.peak, source = peak_flops(world.device, _compute_dtype(self.autocast))
            _log(world, "MFU is measured against %.1f GFLOP/s per process, from %s", self.peak / 1e9, source)
        while state.step < t.max_steps:
            _set_lr(self.optimizer, cfg, state.step)
            try:
                loss_sum = self._step(order.starts(state.samples_seen, t.global_batch_size))
                state.step += 1
                state.samples_seen += t.global_batch_size
                # One small collective per step: the global loss, whether any process must stop, and two
                # things only the leader knows: whether snapshots keep failing, whether it lost the run.
                leader = world.is_leader
                loss_total, stops, failing, lost = distributed.all_reduce_sum(
                    [loss_sum, float(stop.requested), float(leader and self.writer.failed_too_often),
                     float(leader and self.store.lease is not None and self.store.lease.lost)], world)
            except Exception:
                self.rescue()
                raise
            _check_fatal(self.writer, failing, lost)
            self.train_loss = loss_total / t.global_batch_size
            if not math.isfinite(self.train_loss):
                self.finish()
                raise TrainingError(f"loss is {self.train_loss} at step {state.step}; lower trainer.lr or raise "
                                    "trainer.warmup_steps, then run again to resume from the last snapshot")
            last = state.step == t.max_steps or stops > 0
            progress.step()
            if state.step % t.log_every == 0 or last:
                self._log_progress(progress)
            # On a stop request, skip evaluation: the snapshot must land inside the shutdown window.
            if (t.eval_every and state.step % t.eval_every == 0) or (last and not stops):
                self.val_loss = evaluate(self.model, self.val_blocks, cfg, world, self.autocast)
                _log(world, "step %d | val loss %.4f", state.step, self.val_loss)
                self.metrics.log(state.step, {"val_loss": self.val_loss})
            if state.step % cfg.snapshot.every == 0 or last:
                self.save()
            if stops > 0:
                self.finish()
                _log(world, "stopped at step %d on request; run the same command to resume", state.step)
                return TrainResult(state.step, self.train_loss, self.val_loss, stopped_early=True)
        self.finish()
        _log(world, "done: step %d, train loss %.4f, val loss %.4f", state.step, self.train_loss, self.val_loss)
        return TrainResult(state.step, self.train_loss, self.val_loss)

    def _step(self, starts: np.ndarray) -> float:
        """One optimizer step over this process's slice of the global batch, the windows at token
        offsets `starts`; returns sum(loss * examples)."""
        t, world = self.cfg.trainer, self.world
        mine = shard(len(starts), world.world_size, world.rank)
        pieces = micro_batches(mine.stop - mine.start, t.micro_batch_size)
        # DDP averages gradients over processes; scaling each micro-batch's mean loss by
        # (its examples * world size / global batch) makes the result the full-batch gradient,
        # also when the batch does not split evenly.
        scale = world.world_size / t.global_batch_size
        loss_sum = torch.zeros((), device=world.device)
        self.optimizer.zero_grad(set_to_none=True)
        for i, piece in enumerate(pieces):
            first = mine.start + piece.start
            count = piece.stop - piece.start
            x, y = self.train_blocks.windows(starts[first : first + count])
            x, y = x.to(world.device, non_blocking=True), y.to(world.device, non_blocking=True)
            # Dropout masks are a function of the data position, not of the process or its history.
            torch.manual_seed((self.cfg.seed * 1_000_003 + self.state.samples_seen + first) % 2**63)
            sync = self.ddp is None or i == len(pieces) - 1
            with (nullcontext() if sync else self.ddp.no_sync()), self.autocast:
                _, loss = (self.ddp or self.model)(x, y)
            weighted = loss * (count * scale)
            (self.scaler.scale(weighted) if self.scaler else weighted).backward()
            loss_sum += loss.detach().float() * count
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return loss_sum.item()

    def _log_progress(self, progress: "_Progress") -> None:
        t, step = self.cfg.trainer, self.state.step
        rate, seconds_per_step = progress.window()
        lr = self.optimizer.param_groups[0]["lr"]
        used = self._mfu(rate)
        memory = peak_memory_bytes(self.world.device)
        _log(self.world, "step %d/%d | loss %.4f | lr %.2e | %.0f tokens/s | MFU %.1f%% | %.0f MB | ETA %s", step,
             t.max_steps, self.train_loss, lr, rate, 100 * used, memory / 1e6,
             _duration((t.max_steps - step) * seconds_per_step))
        self.metrics.log(step, {"train_loss": self.train_loss, "lr": lr, "tokens_per_s": rate,
                                "mfu": used, "peak_memory_mb": memory / 1e6, "world_size": self.world.world_size})

    def _mfu(self, tokens_per_s: float) -> float:
        """MFU of this run (leader only; NaN elsewhere). Above 100% the peak was probed on a busy machine:
        probe again, keeping the higher figure."""
        if not self.peak:
            return float("nan")
        used = mfu(self.flops_per_token, tokens_per_s, self.peak * self.world.world_size)
        if used > 1:
            self.peak, _ = peak_flops(self.world.device, _compute_dtype(self.autocast), measure=True)
            used = mfu(self.flops_per_token, tokens_per_s, self.peak * self.world.world_size)
        return used

    def save(self) -> None:
        """The leader snapshots alone: every replica holds the same state. Training goes on meanwhile."""
        if not self.world.is_leader:
            return
        self.metrics.flush()
        tensors = {"model": _to_cpu(self.model.state_dict()), "optimizer": _to_cpu(self.optimizer.state_dict())}
        if self.scaler is not None:  # fp16: the loss scale it found is part of the state
            tensors["scaler"] = self.scaler.state_dict()
        info = {
            "samples_seen": self.state.samples_seen,
            "model_config": self.model.config.to_dict(),
            "config": self.cfg.to_dict(),
            "world_size": self.world.world_size,
            "metrics": {"train_loss": self.train_loss, "val_loss": self.val_loss},
            "library_version": mingpt.__version__,
        }
        self.writer.save(self.state.step, tensors, {"tokenizer.json": self.data.tokenizer.to_json().encode()}, info)

    def finish(self) -> None:
        """Wait for the snapshot in flight: the job must not end before it is committed, nor end
        "done" when it was not. Every process learns the outcome, so all exit alike."""
        self.writer.wait()
        self.metrics.close()
        failed = float(self.world.is_leader and self.writer.failures > 0)
        if distributed.all_reduce_sum([failed], self.world)[0]:
            self.writer.check(final=True)
            raise SnapshotError("the process writing snapshots could not write the last one; see its log")

    def rescue(self) -> None:
        """A step failed (most often: a peer died mid-collective). The optimizer had not stepped, or the
        state already counts the step, so this replica is consistent: the leader snapshots it, no
        collectives involved, before the error ends the process and torchrun restarts the group.
        If a newer generation holds the run already, the store's fence refuses the save.

        Only with gloo (and alone): NCCL reports a peer's death late, possibly after the optimizer
        stepped on partly reduced gradients, so there the last periodic snapshot is the safe one."""
        if not self.world.is_leader or (self.world.distributed and dist.get_backend() != "gloo"):
            return
        try:
            self.writer.wait()
            if self.state.step > 0:
                log.warning("step failed; saving step %d from this process before exiting", self.state.step)
                self.save()
                self.writer.wait()
        except Exception as e:
            log.error("could not save a rescue snapshot: %s", e)


class _Progress:
    """Tokens per second and seconds per step since the last progress line."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.started, self.steps = time.perf_counter(), 0

    def step(self) -> None:
        self.steps += 1

    def window(self) -> tuple[float, float]:
        elapsed = time.perf_counter() - self.started
        rate = self.steps * self.tokens_per_step / elapsed
        seconds_per_step = elapsed / max(1, self.steps)
        self.started, self.steps = time.perf_counter(), 0
        return rate, seconds_per_step


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


def _check_fatal(writer: SnapshotWriter, failing: float, lost: float) -> None:
    """Stop every process together when the leader lost the run or cannot write snapshots."""
    if lost:
        raise LeaseLostError("another job or a newer generation of this one took over snapshot.dir; this "
                             "generation stops without writing anything more (the leader's log says who)")
    if failing:
        writer.check()
        raise SnapshotError("the process writing snapshots could not write them; see its log")


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


@torch.no_grad()
def evaluate(model: GPT, blocks: TokenBlocks, cfg: Config, world: World, autocast) -> float:
    """Mean loss over the first `eval_samples` validation blocks, shared among all processes.

    Fixed blocks, whatever `data.windows` says: every evaluation measures the same text, so
    evaluations of one run, and of runs that sample windows differently, compare."""
    count = min(cfg.trainer.eval_samples, len(blocks))
    mine = shard(count, world.world_size, world.rank)
    model.eval()
    loss_sum = 0.0
    for piece in micro_batches(mine.stop - mine.start, cfg.trainer.micro_batch_size):
        start = mine.start + piece.start
        x, y = blocks.batch(range(start, start + piece.stop - piece.start))
        with autocast:
            _, loss = model(x.to(world.device), y.to(world.device))
        loss_sum += loss.item() * (piece.stop - piece.start)
    model.train()
    return distributed.all_reduce_sum([loss_sum], world)[0] / count


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up to trainer.lr, then cosine decay to lr * min_lr_ratio at max_steps."""
    t = cfg.trainer
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _set_lr(optimizer: torch.optim.Optimizer, cfg: Config, step: int) -> None:
    lr = lr_at(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr


def _check_batch(cfg: Config, world: World) -> None:
    if cfg.trainer.global_batch_size < world.world_size:
        raise mingpt.ConfigError(
            f"trainer.global_batch_size={cfg.trainer.global_batch_size} cannot be served by "
            f"{world.world_size} processes: each needs at least one example per step. Raise "
            "trainer.global_batch_size to at least the number of processes, or start fewer"
        )


def _choose_snapshot(store: SnapshotStore, world: World) -> Snapshot | None:
    """The leader picks the newest verified snapshot; every process then loads that same one."""
    _check_shared(store, world)
    latest, choice = None, ("none", None)
    if world.is_leader:
        try:
            latest = store.latest()
            choice = ("snapshot", latest.name) if latest else ("none", None)
        except Exception as e:  # tell the others, or they would wait for the broadcast in vain
            choice = ("error", f"cannot read snapshots from {store.url}: {explain_storage_error(e, store.local)}")
    kind, value = distributed.broadcast_object(choice, world)
    if kind == "error":
        raise SnapshotError(value)
    if kind == "none" or latest is not None:
        return latest  # the leader keeps the bytes it verified, so it reads them once
    return store.get(value)


def _check_shared(store: SnapshotStore, world: World) -> None:
    """With several processes, every one must see what the leader writes: any of them may lead the
    next generation. A local folder that is not shared between nodes would silently restart a run."""
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
            "processes cannot see the files the first one writes there. Use storage every node reaches (s3://, NFS)"
        )


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


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _precision(precision: str, device: torch.device):
    """The autocast context of 'fp32', 'bf16' or 'fp16' and, for fp16 only, a GradScaler."""
    if precision == "fp32":
        return nullcontext(), None
    if precision == "fp16":
        if device.type != "cuda":
            raise mingpt.ConfigError("trainer.precision=fp16 needs a GPU; use fp32 or bf16 on CPUs")
        return torch.autocast("cuda", dtype=torch.float16), torch.amp.GradScaler("cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16), None


def _compute_dtype(autocast) -> torch.dtype:
    return autocast.fast_dtype if isinstance(autocast, torch.autocast) else torch.float32


def autocast_name(autocast) -> str:
    return str(autocast.fast_dtype).replace("torch.", "") if isinstance(autocast, torch.autocast) else "float32"


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

"""What a training run tells the people watching it: the progress line, metrics, MFU, what a start found, membership
changes, and the ledger of samples (a digest per step: none lost or repeated). The leader speaks (live: the writer's);
every process compares step times (mingpt.training.stragglers)."""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from datetime import timedelta

import torch

from mingpt.data.prepared import TokenBlocks
from mingpt.metrics.loggers import Loggers
from mingpt.metrics.scoring import Tally
from mingpt.model import GPT
from mingpt.rundir import RunDir
from mingpt.training.config import Config
from mingpt.training.distributed import World
from mingpt.training.performance import Throughput, flops_per_token, mfu, peak_flops, peak_memory_bytes
from mingpt.training.resume import Resumed
from mingpt.training.state import TrainState
from mingpt.training.stragglers import StepTimes

log = logging.getLogger(__name__)


class Report:
    """One generation's reporting; `excluding()` leaves evaluations and saves out of the tokens/s."""

    def __init__(self, cfg: Config, world: World, run: RunDir, model: GPT, compute_dtype: torch.dtype,
                 speaks: bool):
        self.cfg, self.world, self.run, self.compute_dtype = cfg, world, run, compute_dtype
        self.speaks = speaks
        self.metrics = Loggers(cfg.trainer.loggers, run, cfg.to_dict(), speaks)
        self.change = world.job.membership if world.is_leader else None
        self.flops_per_token = flops_per_token(model.config, model.num_params())
        self.throughput: Throughput | None = None
        self.peak: float | None = None  # FLOP/s of one process, for MFU (known to the leader)
        self.processes = world.world_size  # that took part in the last step
        self.steps_lost: int | None = None
        self.step_times: StepTimes | None = None

    def start(self, step: int, resumed: Resumed, description: list[str]) -> None:
        """Training begins at `step`: what the start found, the run described, the reference for MFU."""
        self.metrics.start(step)
        for kind, text in resumed.events:
            self.metrics.mark(step, kind, text)
        self.steps_lost = resumed.steps_lost
        if self.steps_lost is not None:
            self.metrics.log(step, {"steps_lost": self.steps_lost})
        for line in description:
            self.say("%s", line)
        t = self.cfg.trainer
        if t.warmup_steps >= t.max_steps and self.speaks:
            log.warning("trainer.warmup_steps=%d is not below trainer.max_steps=%d: the whole run warms the learning "
                        "rate up (trainer.lr=%g comes at step %d); lower trainer.warmup_steps", t.warmup_steps,
                        t.max_steps, t.lr, t.warmup_steps)
        if self.world.is_leader:  # the processes that may report MFU
            self.peak, source = peak_flops(self.world.device, self.compute_dtype)
            self.say("MFU is measured against %.1f GFLOP/s per process, from %s", self.peak / 1e9, source)
        self.step_times = StepTimes(self.world, self.metrics)
        self.throughput = Throughput(t.global_batch_size * self.cfg.data.block_size)

    def speak(self, speaks: bool, state: TrainState) -> None:
        """Live mode: this process speaks for the job while its group is the writer."""
        if speaks == self.speaks:
            return
        self.metrics.close()
        self.speaks = speaks
        self.metrics = self.step_times.metrics = Loggers(self.cfg.trainer.loggers, self.run, self.cfg.to_dict(), speaks)
        self.metrics.start(state.step)
        self.log_again(state.ledger)  # the last steps the writer before may have committed but not logged

    def log_again(self, ledger: list[tuple[int, str]]) -> None:
        """The samples of steps that another process took, which it may not have lived to log."""
        if self.speaks:
            for seen, samples in ledger:
                self.metrics.log(seen, {"samples": samples, "again": True})

    def step(self, step: int, loss: float, lr: float, samples: str, processes: int, split: tuple[float, float],
             seconds: float, last: bool) -> None:
        """After each step, in every process."""
        self.step_times.add(*split, seconds)
        self.step_times.end_of_step(step)
        self.throughput.step()
        self.processes = processes
        self.metrics.log(step, {"samples": samples})
        if self.change is not None:
            self._membership(step)
        if step % self.cfg.trainer.log_every == 0 or last:
            self._progress(step, loss, lr)

    def evaluation(self, step: int, val_loss: float) -> None:
        self.say("step %d | val loss %.4f", step, val_loss)
        self.metrics.log(step, {"val_loss": val_loss})

    def hellaswag(self, step: int, tally: Tally) -> None:
        self.say("step %d | hellaswag acc_norm %.4f | acc %.4f | %d examples", step, tally.acc_norm, tally.acc,
                 tally.count)
        self.metrics.log(step, {"hellaswag_acc": tally.acc, "hellaswag_acc_norm": tally.acc_norm,
                                "hellaswag_examples": tally.count})

    def excluding(self) -> AbstractContextManager:
        return self.throughput.excluding()

    def say(self, message: str, *args) -> None:
        """Log a line from the process that speaks for the job."""
        if self.speaks:
            log.info(message, *args)

    def _progress(self, step: int, loss: float, lr: float) -> None:
        t = self.cfg.trainer
        rate, seconds_per_step, elsewhere = self.throughput.read()  # evaluations and saves left out
        used = self._mfu(rate)
        memory = peak_memory_bytes(self.world.device)
        slow = f" | slow: {', '.join(sorted(self.step_times.slow))}" if self.step_times.slow else ""
        self.say("step %d/%d | loss %.4f | lr %.2e | %.0f tokens/s | MFU %.1f%% | %.0f MB | ETA %s%s", step,
                 t.max_steps, loss, lr, rate, 100 * used, memory / 1e6,
                 timedelta(seconds=int((t.max_steps - step) * seconds_per_step)), slow)
        self.metrics.log(step, {"train_loss": loss, "lr": lr, "tokens_per_s": rate, "other_s": round(elsewhere, 3),
                                "mfu": used, "peak_memory_mb": memory / 1e6, "world_size": self.processes})

    def _membership(self, step: int) -> None:
        """At the generation's first step: a record of what changed before it; one line where nodes left or joined."""
        change, self.change = self.change, None
        left, joined, members = (change.get(key) or [] for key in ("left", "joined", "members"))
        seconds = time.time() - float(change.get("noticed") or time.time())
        lost = "unknown" if self.steps_lost is None else self.steps_lost
        record = {"left": left, "joined": joined, "members": members, "cause": change.get("cause"),
                  "world_size": self.world.world_size, "steps_lost": self.steps_lost}
        self.metrics.log(step, {"membership": record, "recovery_s": round(seconds, 2)})
        if change.get("cause") and not (left or joined):  # a restart within the same nodes: a hang, a failure
            self.metrics.log(step, {"restart": change["cause"]})
            self.say("restart: %s; steps lost %s; this step %.1f s after it", change["cause"], lost, seconds)
        if left or joined:
            how = f" ({change['cause']})" if left and change.get("cause") else ""
            self.say("membership change: left %s%s; joined %s; now %d node(s), %d process(es); steps lost %s; this "
                     "step %.1f s after the change", ", ".join(left) or "none", how, ", ".join(joined) or "none",
                     len(members), self.world.world_size, lost, seconds)

    def _mfu(self, tokens_per_s: float) -> float:
        """Leader only (NaN elsewhere). Above 100% the peak was probed on a busy machine: probe again."""
        if not self.peak:
            return float("nan")
        used = mfu(self.flops_per_token, tokens_per_s, self.peak * self.processes)
        if used > 1:
            self.peak, _ = peak_flops(self.world.device, self.compute_dtype, measure=True)
            used = mfu(self.flops_per_token, tokens_per_s, self.peak * self.processes)
        return used


def describe_windows(cfg: Config, blocks: TokenBlocks) -> str:
    """Progress is in tokens, not epochs: random windows have no epochs."""
    t = cfg.trainer
    if cfg.data.windows == "random":
        kind = f"windows at any of {blocks.num_starts:,} offsets"
    else:
        kind = f"{len(blocks):,} fixed blocks, shuffled afresh each epoch,"
    passes = t.max_steps * t.global_batch_size * cfg.data.block_size / len(blocks.tokens)
    return (f"data.windows={cfg.data.windows}: {kind} of the {len(blocks.tokens):,} training tokens; "
            f"{t.max_steps} steps read {passes:.2f}x that many tokens")

"""The per-step agreement of a generation: after every step, every process learns the same four things
in one all-reduce: the global batch's loss, how many processes were asked to stop, and what only the
leader knows (snapshots keep failing; another job or a newer generation took the run over). Each
process then acts alike on them: it logs the same loss, stops at the same step, or fails with the others."""

from __future__ import annotations

from dataclasses import dataclass

from mingpt.training import distributed
from mingpt.training.checkpointer import Checkpointer
from mingpt.training.distributed import World


@dataclass(frozen=True)
class Outcome:
    loss: float  # the mean loss of the step's global batch
    stops: int  # processes asked to stop (SIGTERM, Ctrl-C) during the step
    saves_failing: bool  # the leader's snapshots keep failing
    run_lost: bool  # the leader lost the run's lease


class StepAgreement:
    def __init__(self, world: World, checkpointer: Checkpointer, global_batch_size: int):
        self.world, self.checkpointer, self.global_batch_size = world, checkpointer, global_batch_size

    def exchange(self, loss_sum: float, stop_requested: bool) -> Outcome:
        """The collective, after this process's optimizer step; `loss_sum` is its sum(loss * examples)."""
        saves_failing, run_lost = self.checkpointer.problems()
        loss, stops, failing, lost = distributed.all_reduce_sum(
            [loss_sum, float(stop_requested), float(saves_failing), float(run_lost)], self.world)
        return Outcome(loss / self.global_batch_size, int(stops), bool(failing), bool(lost))

    def enforce(self, outcome: Outcome) -> None:
        """Stop every process together where the leader lost the run or cannot write snapshots."""
        self.checkpointer.stop_on(outcome.saves_failing, outcome.run_lost)

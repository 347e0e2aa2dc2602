"""The per-step agreement of a generation under torchrun: after the gradients, one all-reduce of four numbers that
every process acts on alike: the loss, the stop requests, and what only the leader knows (snapshots keep failing;
the run was taken over). The live mode's counterpart is mingpt.training.live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mingpt.training import distributed
from mingpt.training.checkpointer import Checkpointer
from mingpt.training.distributed import World


@dataclass(frozen=True)
class Share:
    """This process's place among the processes of a step, which split its global batch."""
    index: int
    count: int


@dataclass(frozen=True)
class Outcome:
    loss: float  # the mean loss of the step's global batch
    stops: int  # processes asked to stop (SIGTERM, Ctrl-C) during the step: the generation ends
    saves_failing: bool  # the leader's snapshots keep failing
    run_lost: bool  # the leader lost the run's lease
    committed: bool = True  # live mode: the step counts (else it is done again)
    generation: int | None = None  # live mode: the writer's lease generation
    leaving: bool = False  # live mode: a group of the step was asked to stop; the job may be ending: save the step


class Agreement(Protocol):
    """The per-step protocol that the trainer follows in either mode, in the order it calls it."""

    writes: bool  # whether this process's group writes the run's snapshots and metrics (the live mode's changes)

    def resumed_at(self, step: int, samples_seen: int) -> None:
        """Once, after resuming: where the run goes on from."""

    def begin(self) -> Share:
        """Before each step: this process's place among those that take part in it."""

    def exchange(self, loss_sum: float, stop_requested: bool) -> Outcome:
        """Once this process's gradients are in: what every process of the step then acts on alike."""

    def enforce(self, outcome: Outcome) -> None:
        """After the step: stop every process together where the outcome says so."""

    def close(self) -> None:
        """At the end of the generation."""


class StepAgreement:
    writes = True  # every generation writes its snapshots (its leader, or every process its shard)

    def __init__(self, world: World, checkpointer: Checkpointer, global_batch_size: int):
        self.world, self.checkpointer, self.global_batch_size = world, checkpointer, global_batch_size

    def begin(self) -> Share:
        return Share(self.world.rank, self.world.world_size)

    def exchange(self, loss_sum: float, stop_requested: bool) -> Outcome:
        """The collective, once this process's gradients are in; `loss_sum` is its sum(loss * examples)."""
        saves_failing, run_lost = self.checkpointer.problems()
        loss, stops, failing, lost = distributed.all_reduce_sum(
            [loss_sum, float(stop_requested), float(saves_failing), float(run_lost)], self.world)
        return Outcome(loss / self.global_batch_size, int(stops), bool(failing), bool(lost))

    def enforce(self, outcome: Outcome) -> None:
        """Stop every process together where the leader lost the run or cannot write snapshots."""
        self.checkpointer.stop_on(outcome.saves_failing, outcome.run_lost)

    def resumed_at(self, step: int, samples_seen: int) -> None:
        pass

    def close(self) -> None:
        pass

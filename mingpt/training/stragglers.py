"""Slow processes. Every step waits for the slowest at its collectives, so step times look alike; what differs is
the time a process spends on its own (its data, computing, the optimizer), the rest being synchronising. Every WINDOW
steps one all-gather compares them; the leader logs them (`process_times`) and names, once per episode, a process at
least SLOWER times the others' median. (On GPUs the host's clock sees kernel launches, not their end: a slow device
shows in everyone's synchronising time.)"""

from __future__ import annotations

import logging
import os
import socket
import statistics

from mingpt.metrics.loggers import Loggers
from mingpt.training import distributed
from mingpt.training.distributed import World

log = logging.getLogger(__name__)

WINDOW = 20  # steps between two comparisons
SLOWER = 1.2  # a process whose own time is this much the others' median is named ...
NOTABLE = 0.1  # ... when what it adds is this share of the step at least (a few ms of noise is not a straggler),
SEEN = 2  # ... in this many windows in a row
CALM = 3  # windows at the others' speed that end an episode


class StepTimes:
    """This process's time per step, split, and the window's comparison across processes."""
    def __init__(self, world: World, metrics: Loggers):
        self.world, self.metrics = world, metrics
        self.names = distributed.all_gather_object(f"{socket.gethostname()} pid {os.getpid()}", world)
        self.sums = [0.0, 0.0, 0.0]  # data, computing, synchronising: seconds over the window
        self.steps = 0
        self.slow: dict[str, int] = {}  # named in the episode under way -> windows since at the others' speed
        self.suspects: dict[str, int] = {}  # slow in this many windows in a row, not named yet

    def add(self, data_s: float, compute_s: float, step_s: float) -> None:
        """One step: its seconds waiting for data, computing, and in all (the rest is synchronising)."""
        for i, seconds in enumerate((data_s, compute_s, max(0.0, step_s - data_s - compute_s))):
            self.sums[i] += seconds

    def end_of_step(self, step: int) -> None:
        """Every WINDOW steps (the same steps in every process): compare, report, start a new window."""
        self.steps += 1
        if self.steps < WINDOW:
            return
        everyone = distributed.all_gather([s / self.steps for s in self.sums], self.world)
        step_s = sum(self.sums) / self.steps
        self.sums, self.steps = [0.0, 0.0, 0.0], 0
        if self.world.is_leader:
            self._report(step, everyone, step_s)

    def _report(self, step: int, everyone: list[list[float]], step_s: float) -> None:
        self.metrics.log(step, {"process_times": [
            {"process": name, "data_ms": round(1000 * d, 2), "compute_ms": round(1000 * c, 2),
             "sync_ms": round(1000 * s, 2)} for name, (d, c, s) in zip(self.names, everyone)]})
        own = [d + c for d, c, _ in everyone]  # what a process takes on its own
        for i, name in enumerate(self.names):
            others = statistics.median(own[:i] + own[i + 1:]) if len(own) > 1 else 0.0
            if others > 0 and own[i] >= SLOWER * others and own[i] - others >= NOTABLE * step_s:
                self.suspects[name] = self.suspects.get(name, 0) + 1
                if name not in self.slow and self.suspects[name] >= SEEN:
                    log.warning("slow process: %s takes %.2fx the others' time on its own steps (%.0f ms a step "
                                "computing and waiting for data, the others' median %.0f ms, over steps %d-%d); "
                                "every step waits for it", name, own[i] / others, 1000 * own[i], 1000 * others,
                                step - WINDOW + 1, step)
                    self.slow[name] = 0
                elif name in self.slow:
                    self.slow[name] = 0
                continue
            self.suspects.pop(name, None)
            if name in self.slow:
                self.slow[name] += 1
                if self.slow[name] >= CALM:
                    del self.slow[name]
                    log.info("%s is back to the others' speed", name)

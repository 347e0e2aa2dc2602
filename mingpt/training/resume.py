"""Where a generation starts from, the same in every process: the newest state in the nodes' memory tiers
when it is newer than the newest verified snapshot, else that snapshot, else model.init_from's weights
for a new run, else nothing (a new run from the seed's weights)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from mingpt.interop.pretrained import Pretrained
from mingpt.storage import redact
from mingpt.training.checkpointer import Checkpointer
from mingpt.training.distributed import World
from mingpt.training.state import Replica
from mingpt.training.stopflag import StopFlag

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    """What a start found, for the report."""

    events: list[tuple[str, str]] = field(default_factory=list)  # (kind, text), marked on the dashboards
    steps_lost: int | None = None  # steps reached before this start and not in the state loaded (None: unknown)


def resume(checkpointer: Checkpointer, replica: Replica, world: World, pretrained: Pretrained | None,
           stop: StopFlag) -> Resumed:
    """Load the newest state into `replica` (see the module's description). Every process calls it."""
    snapshot = checkpointer.latest()
    memory = checkpointer.load_newer_from_memory(snapshot)
    resumed = Resumed()
    if snapshot is None and memory is None:
        if pretrained:  # a new run: its weights, a fresh optimizer, step 0
            with stop.at_once():  # a download may take minutes
                weights = pretrained.load()
            replica.model.load_state_dict(weights)
            _log(world, "initialised from model.init_from=%s", redact(pretrained.url))
        return resumed
    if pretrained:
        _log(world, "model.init_from=%s is not read: this run resumes from its own snapshot", redact(pretrained.url))
    if memory is None:
        checkpointer.load(snapshot, replica)
        source, before = snapshot.url, snapshot.manifest.get("world_size")
    else:
        durable = f"step {snapshot.manifest['step']}" if snapshot else "none"
        source = f"the memory tier of {', '.join(memory['hosts'])} (the last snapshot: {durable})"
        before = memory["world_size"]
    state, now = replica.state, world.world_size
    _log(world, "resumed from %s: step %d, %d examples seen, now %d process(es)", source, state.step,
         state.samples_seen, now)
    if checkpointer.reached:  # known where a memory tier recorded the steps
        resumed.steps_lost = max(0, checkpointer.reached - state.step)
        _log(world, "steps lost: %d (step %d was reached before the restart)", resumed.steps_lost,
             checkpointer.reached)
    resumed.events.append(("restart", f"resumed from step {state.step} with {now} process(es)"))
    if before is not None and before != now:
        resumed.events.append(("world_size_change", f"{before} -> {now} processes at step {state.step}"))
    return resumed


def _log(world: World, message: str, *args) -> None:
    if world.is_leader:
        log.info(message, *args)

"""Where a generation starts from, the same in every process: the newest state in the nodes' memory tiers
when it is newer than the newest verified snapshot, else that snapshot, else model.init_from's weights
for a new run, else nothing (a new run from the seed's weights)."""

from __future__ import annotations

import logging
import socket
from collections import Counter
from dataclasses import dataclass, field

from mingpt.checkpoint.store import Snapshot
from mingpt.errors import DataError, PeerLeft
from mingpt.interop.pretrained import Pretrained
from mingpt.jobenv import PEER_LOST
from mingpt.storage import redact
from mingpt.training import distributed
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
    """Every process calls it."""
    snapshot = checkpointer.latest()
    agree_on_data(checkpointer, world, snapshot)
    if snapshot is not None:  # before the memory tier starts: a job refused here leaves none behind
        checkpointer.check_fits(snapshot, replica)
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
        _log(world, "steps lost: %d (step %d was reached before the restart)", resumed.steps_lost, checkpointer.reached)
    resumed.events.append(("restart", f"resumed from step {state.step} with {now} process(es)"))
    if before is not None and before != now:
        resumed.events.append(("world_size_change", f"{before} -> {now} processes at step {state.step}"))
    return resumed


def agree_on_data(checkpointer: Checkpointer, world: World, snapshot: Snapshot | None) -> None:
    """Every process must train on the same data: the snapshot's where some process has it, else most processes'. A
    process with other data is refused, and the others end the generation as for a lost peer, to go on without it."""
    if not world.distributed:
        return
    data = checkpointer.cfg.data
    everyone = distributed.all_gather_object((checkpointer.data_fingerprint, socket.gethostname(), data.corpus), world)
    fingerprints = [fingerprint for fingerprint, _, _ in everyone]
    if len(set(fingerprints)) == 1:
        return
    saved = snapshot.manifest.get("data_fingerprint") if snapshot else None
    job = saved if saved in fingerprints else Counter(fingerprints).most_common(1)[0][0]
    _, job_host, job_corpus = everyone[fingerprints.index(job)]
    others = [rank for rank, fingerprint in enumerate(fingerprints) if fingerprint != job]
    if checkpointer.data_fingerprint != job:
        raise DataError(
            f"this node's prepared data (fingerprint {checkpointer.data_fingerprint[:12]}, data.corpus={redact(data.corpus)}) "
            f"is not the job's (fingerprint {job[:12]}, data.corpus={redact(job_corpus)} on {job_host}): start every node "
            "of a job with the same data settings and corpus")
    _log(world, "rank(s) %s on %s train on other data (fingerprint %s, not the job's %s): refused; this generation "
         "ends without them", ", ".join(map(str, others)), ", ".join(sorted({everyone[r][1] for r in others})),
         fingerprints[others[0]][:12], job[:12])
    raise PeerLeft(f"rank(s) {', '.join(map(str, others))} train on other data and were refused; this process goes "
                   "on in the next round of the job", PEER_LOST)


def _log(world: World, message: str, *args) -> None:
    if world.is_leader:
        log.info(message, *args)

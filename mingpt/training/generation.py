"""Where the processes of a generation meet and form their process group (gloo on CPUs, NCCL on GPUs)."""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mingpt.errors import ConfigError, one_line
from mingpt.jobenv import JobEnv
from mingpt.training.distributed import World, gpu_of, peer_lost, sigterm_ends_at_once

log = logging.getLogger(__name__)


class Meeting:
    """The launcher's key-value store, opened first so that peers wait for a process preparing data as long as it
    takes, not timing out in init_process_group (one never started still does). The constructor reaches nothing."""

    def __init__(self, job: JobEnv, timeout_s: float):
        self.job, self.timeout_s = job, timeout_s
        host, port = job.master
        self.address = f"{host}:{port}"
        # torchrun's own store (one agent only: check_store_sharing) outlives restarts, unlike rank 0's: there the
        # restart count keeps earlier generations' keys apart.
        self.prefix = f"mingpt/{job.run_id or ''}/{job.restart_count if job.agent_store else '-'}"
        self.store: dist.TCPStore | None = None
        self.opened = 0.0

    def open(self) -> Meeting:
        """Connect to the store (hosting it on rank 0 where the agent does not), and say this process joined."""
        (host, port), shared = self.job.master, self.job.agent_store
        self.opened = time.monotonic()
        try:
            with sigterm_ends_at_once():  # connecting waits in torch's C++ for a store that may never come
                self.store = dist.TCPStore(host, port, self.job.world_size, is_master=self.job.rank == 0 and not shared,
                                           timeout=timedelta(seconds=self.timeout_s), multi_tenant=not shared,
                                           wait_for_workers=False)
        except dist.DistError as e:
            raise self._error(e) from None
        self.store.set(self._key("joined", self.job.rank), socket.gethostname())
        return self

    def ready(self) -> None:
        """Say that this process has prepared its data; wait until every process has."""
        self.store.set(self._key("ready", self.job.rank), socket.gethostname())
        said = time.monotonic() - WAIT_LOG_S + 1  # the first report after a second, then every WAIT_LOG_S
        while True:
            missing = [rank for rank in range(self.job.world_size) if not self._has("ready", rank)]
            if not missing:
                return
            absent = [rank for rank in missing if not self._has("joined", rank)]
            if absent and time.monotonic() - self.opened > self.timeout_s:
                raise self._error(f"rank(s) {_ranks(absent)} never started")
            if self.job.rank == 0 and time.monotonic() - said >= WAIT_LOG_S:
                log.info("waiting for %d process(es) to prepare their data: %s", len(missing), self._describe(missing))
                said = time.monotonic()
            time.sleep(0.2)

    def _describe(self, ranks: list[int]) -> str:
        by_host: dict[str, list[int]] = {}
        for rank in ranks:
            host = self.store.get(self._key("joined", rank)).decode() if self._has("joined", rank) else "not started"
            by_host.setdefault(host, []).append(rank)
        return "; ".join(f"rank {_ranks(r)} on {host}" for host, r in by_host.items())

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _has(self, kind: str, rank: int) -> bool:
        return self.store.check([self._key(kind, rank)])

    def _error(self, cause) -> Exception:
        if isinstance(cause, dist.DistError) and self.job.under_torchrun:
            # torchrun formed this generation and set MASTER_*: a peer (the one hosting the store, say) has gone
            return peer_lost(cause)
        return ConfigError(f"rank {self.job.rank} of {self.job.world_size} could not meet its peers at "
                           f"{self.address} within {self.timeout_s:.0f} s (trainer.dist_timeout_s): start all "
                           f"WORLD_SIZE processes, or check MASTER_ADDR and MASTER_PORT ({one_line(cause)})")


WAIT_LOG_S = 30.0  # how often the leader says whom it waits for


def meet(job: JobEnv, timeout_s: float) -> Meeting | None:
    """The generation's meeting point (None when this process is alone)."""
    return Meeting(job, timeout_s).open() if job.world_size > 1 else None


def start(job: JobEnv, timeout_s: float, meeting: Meeting | None = None) -> World:
    """Join the process group torchrun describes (if any), once every process is ready. The finite timeout turns a
    hung collective (a peer that died mid-step) into an error, which torchrun answers by restarting the workers."""
    if torch.cuda.is_available():
        device = torch.device("cuda", gpu_of(job.local_rank))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if job.world_size > 1:
        _join(meeting or Meeting(job, timeout_s).open(), device)
    return World(rank=job.rank, world_size=job.world_size, local_rank=job.local_rank, device=device,
                 per_node=job.local_world_size, job=job)


def _join(meeting: Meeting, device: torch.device) -> None:
    job, timeout_s = meeting.job, meeting.timeout_s
    # By hand, a missing peer would otherwise make this process wait silently for the whole timeout.
    say = log.info if job.under_torchrun else log.warning
    say("rank %d of %d: joining the process group at %s, waiting up to %.0f s (trainer.dist_timeout_s) for the "
        "other %d process(es) to start", job.rank, job.world_size, meeting.address, timeout_s,
        job.world_size - 1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    meeting.store.set_timeout(timedelta(seconds=timeout_s))
    try:
        with sigterm_ends_at_once():  # forming the group waits in torch's C++ for every peer
            meeting.ready()
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"{meeting.prefix}/pg", meeting.store),
                                    rank=job.rank, world_size=job.world_size,
                                    timeout=timedelta(seconds=timeout_s), device_id=device_id)
    except dist.DistError as e:  # a peer that died between the meeting and here
        raise meeting._error(e) from None
    log.debug("joined process group: rank %d of %d, %s on %s", job.rank, job.world_size, backend, device)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))

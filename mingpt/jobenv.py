"""The contract between a node's agent (mingpt.launch) and its workers (mingpt.training), in one place: the job's
environment (`JobEnv`, read once per worker), the exit statuses of a membership change, the progress marks the
watchdog reads, and the Lighthouse's key and timeouts. No torch: the agent and `mingpt-rendezvous` read it first."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NamedTuple

from mingpt.errors import ConfigError
from mingpt.storage import read_own_file

# What mingpt-torchrun's agent adds to the environment of its workers (torchrun sets the rest of JobEnv's).
PROGRESS_DIR = "MINGPT_PROGRESS_DIR"  # the agent's private folder of progress marks, for its watchdog
MEMBERSHIP = "MINGPT_MEMBERSHIP"  # what changed before this generation (JSON), which the new leader logs
HELLASWAG_FETCHED = "MINGPT_HELLASWAG_FETCHED"  # "cached" (read this machine's copy) or "unavailable" (train without)
LIVE_LIGHTHOUSE = "MINGPT_LIVE_LIGHTHOUSE"  # --live: the Lighthouse's address (http://host:port)
LIVE_RENDEZVOUS = "MINGPT_LIVE_RENDEZVOUS"  # --live: the store of mingpt-rendezvous (host:port)
LIVE_HOST = "MINGPT_LIVE_HOST"  # --live: the address other nodes reach this one at
LIVE_MIN_NODES = "MINGPT_LIVE_MIN_NODES"  # --live: the fewest groups that may commit a step (--nnodes's MIN)
WARM_WORKERS = "MINGPT_WARM_WORKERS"  # set by users: 0 starts every worker as a new Python, as under plain torchrun

# A worker's exit statuses for a generation ended by another process: a membership change, restarted for free.
PEER_STOPPED = 75  # another process was asked to stop (SIGTERM): its node leaves, or the job is being resized
PEER_LOST = 76  # a collective failed: another process died, hung or was cut off
MEMBERSHIP_EXITS = {PEER_STOPPED: "asked to stop (SIGTERM)", PEER_LOST: "lost (its processes died or were cut off)"}

LIGHTHOUSE_KEY = "mingpt/lighthouse"  # where mingpt-rendezvous publishes its Lighthouse's port, in its store
# The Lighthouse's timeouts (the live mode's others are in mingpt.training.live).
HEARTBEAT_TIMEOUT_MS = 1000  # a group silent this long is left out of the next quorum
JOIN_TIMEOUT_MS = 1000  # how long a quorum waits for live groups that have not asked yet
QUORUM_TICK_MS = 100  # how often it looks whether a quorum can form
# How long mingpt-rendezvous serves on after SIGTERM: at a job's end every process gets it at once, and a live
# node's last step needs the Lighthouse to commit (else it waits out the quorum's timeout before saving).
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class LiveEndpoints:
    """Where a live job's groups meet (mingpt-torchrun --live)."""

    lighthouse: str
    rendezvous: str
    host: str
    min_nodes: int


@dataclass(frozen=True)
class JobEnv:
    """What the launcher (torchrun, mingpt-torchrun's agent, or a hand-made environment) says of this process's job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master: tuple[str, int] | None = None  # the store of this generation (MASTER_ADDR, MASTER_PORT)
    run_id: str | None = None  # torchrun's --rdzv-id (TORCHELASTIC_RUN_ID): None without torchrun
    restart_count: int = 0  # the agent's restarts of its workers so far
    agent_store: bool = False  # the workers use their agent's rendezvous store (plain torchrun)
    nodes: int = 1  # the agents of this generation (GROUP_WORLD_SIZE)
    max_nodes: int = 1  # the most there may be: known where the workers share their agent's store (plain torchrun)
    progress_dir: str | None = None
    membership: dict | None = field(default=None, compare=False)
    hellaswag_fetched: str | None = None
    live: LiveEndpoints | None = None

    @property
    def under_torchrun(self) -> bool:
        """Whether an agent started this process (its parent, which outlives it)."""
        return self.run_id is not None

    @property
    def launcher(self) -> int:
        """The process this one's job lives with here: torchrun's agent (the parent, which outlives it), else itself."""
        return os.getppid() if self.under_torchrun else os.getpid()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
        """The job `environ` (os.environ) describes; inconsistent values are a ConfigError now, not a hang later."""
        env = os.environ if environ is None else environ
        world_size, rank = _int(env, "WORLD_SIZE", 1, 1), _int(env, "RANK", 0, 0)
        if rank >= world_size:
            raise ConfigError(f"RANK={rank} with WORLD_SIZE={world_size}: a rank must be below the world size. Let "
                              "torchrun set both (or set WORLD_SIZE to the number of processes, RANK to 0 .. "
                              "WORLD_SIZE-1)")
        local_rank = _int(env, "LOCAL_RANK", 0, 0)
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", local_rank + 1, 1)  # torchrun sets it; by hand, often not
        if local_rank >= local_world_size:
            raise ConfigError(f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_world_size}: a local rank must be "
                              "below the number of processes on this node. Let torchrun set both")
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                   master=_master(env, world_size), run_id=env.get("TORCHELASTIC_RUN_ID"),
                   restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0, 0),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   nodes=_int(env, "GROUP_WORLD_SIZE", 1, 1), max_nodes=_max_nodes(env),
                   progress_dir=env.get(PROGRESS_DIR) or None,
                   membership=_membership(env.get(MEMBERSHIP, "")), hellaswag_fetched=env.get(HELLASWAG_FETCHED),
                   live=_live(env))

    def to_environ(self) -> dict[str, str]:
        """The variables that describe this job, as from_environ reads them."""
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_WORLD_SIZE": str(self.nodes),
               "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
               "TORCHELASTIC_USE_AGENT_STORE": str(self.agent_store)}
        optional = {"TORCHELASTIC_RUN_ID": self.run_id, PROGRESS_DIR: self.progress_dir,
                    HELLASWAG_FETCHED: self.hellaswag_fetched,
                    MEMBERSHIP: None if self.membership is None else json.dumps(self.membership)}
        if self.master is not None:
            optional.update(MASTER_ADDR=self.master[0], MASTER_PORT=str(self.master[1]))
        if self.live is not None:
            optional.update({LIVE_LIGHTHOUSE: self.live.lighthouse, LIVE_RENDEZVOUS: self.live.rendezvous,
                             LIVE_HOST: self.live.host, LIVE_MIN_NODES: str(self.live.min_nodes)})
        return env | {name: value for name, value in optional.items() if value is not None}


def leads_this_generation(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process will lead its generation (rank 0), known before it reads the rest of its job."""
    try:
        return _int(os.environ if environ is None else environ, "RANK", 0, 0) == 0  # "00", " 0" and "" lead too
    except ConfigError:
        return False


def first_on_its_node(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is the first of its node: it reports the node's own work, which the leader cannot see."""
    try:
        return _int(os.environ if environ is None else environ, "LOCAL_RANK", 0, 0) == 0
    except ConfigError:
        return False


def worker_name(environ: Mapping[str, str] | None = None) -> str | None:
    """A worker's process name (what `ps -e` and `top` show; its command line is the agent's where it was forked from
    the agent's server), `mingpt-worker0` by its local rank. None for a process torchrun did not start."""
    env = os.environ if environ is None else environ
    local_rank = env.get("LOCAL_RANK", "")
    return f"mingpt-worker{local_rank}" if "TORCHELASTIC_RUN_ID" in env and local_rank.isdigit() else None


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    text = env.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer: it is set by torchrun; unset it or fix the launch") \
            from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}: it is set by torchrun; unset it or fix the "
                          "launch")
    return value


def _master(env: Mapping[str, str], world_size: int) -> tuple[str, int] | None:
    if world_size == 1:  # one process meets nobody: whatever is set is not checked
        addr, port = env.get("MASTER_ADDR", "").strip(), env.get("MASTER_PORT", "").strip()
        return (addr, int(port)) if addr and port.isdigit() and 0 < int(port) < 65536 else None
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name, "").strip():
            raise ConfigError(f"WORLD_SIZE={world_size} but {name} is not set: start several processes with "
                              "torchrun (or mingpt-torchrun), which sets it")
    port = _int(env, "MASTER_PORT", 0, 1)
    if port > 65535:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port: use one in 1-65535")
    return env["MASTER_ADDR"].strip(), port


def _max_nodes(env: Mapping[str, str]) -> int:
    """The most nodes this job may have, where the workers share their agent's store: plain torchrun's --nnodes, for
    which it gives its workers no variable, read from the agent's command line or PET_NNODES; else this generation's."""
    nodes = _int(env, "GROUP_WORLD_SIZE", 1, 1)
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return nodes
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        args = []
    return max(nodes, max_nodes(args, env.get("PET_NNODES", "1")))


def max_nodes(args: list[str], nnodes: str = "1") -> int:
    """The most nodes torchrun's command line `args` allows (its --nnodes, else `nnodes`); 1 where unreadable."""
    for arg, following in zip(args, args[1:] + [""]):
        name, equals, value = arg.partition("=")
        if len(name) > len("--n") and "--nnodes".startswith(name):  # torchrun's argparse takes --nnode, --nn too
            nnodes = value if equals else following
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        return 1


def _membership(text: str) -> dict | None:
    try:
        change = json.loads(text)
    except ValueError:
        return None
    return change if isinstance(change, dict) else None


def _live(env: Mapping[str, str]) -> LiveEndpoints | None:
    if not env.get(LIVE_LIGHTHOUSE):
        return None
    try:
        return LiveEndpoints(env[LIVE_LIGHTHOUSE], env[LIVE_RENDEZVOUS], env[LIVE_HOST], int(env[LIVE_MIN_NODES]))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"the live mode's variables are incomplete ({e}): start live jobs with "
                          "mingpt-torchrun --live") from None


# A worker's progress mark: one pwrite of RECORD, for its agent's watchdog (mingpt.launch.watchdog).
PHASES = ("starting", "computing", "evaluating", "saving", "compiling")
# step, phase, when entered (time.monotonic), hang timeout, the first step computed (-1 before), warm-up allowance
RECORD = struct.Struct("<qqddqd")


class Mark(NamedTuple):
    """A process's last mark, as its agent reads it."""

    step: int
    phase: str
    when: float
    timeout: float  # trainer.hang_timeout_s (0: the agent chooses)
    first: int  # the step this process started computing at: its generation's first, where -1 none yet
    warmup_timeout: float  # how long that first step (warming up) or a compile may take

    @property
    def progressed(self) -> bool:
        """Whether this process completed a step."""
        return 0 <= self.first < self.step

    @property
    def in_first_step(self) -> bool:
        return self.step == self.first

    @property
    def warming_up(self) -> bool:
        """Whether this process is in its first step or compiling: allowed `warmup_timeout`."""
        return self.in_first_step or self.phase == "compiling"

    def pack(self) -> bytes:
        return RECORD.pack(self.step, PHASES.index(self.phase), self.when, self.timeout, self.first,
                           self.warmup_timeout)


def read_mark(path: Path) -> Mark | None:
    """The last mark in a progress file; None where it holds none yet."""
    try:
        data = read_own_file(path, RECORD.size)
    except OSError:  # not yet made; or not a regular file of this user's: never read
        return None
    if len(data) < RECORD.size:
        return None
    step, phase, when, timeout, first, warmup_timeout = RECORD.unpack(data)
    return Mark(step, PHASES[phase] if 0 <= phase < len(PHASES) else "starting", when, timeout, first, warmup_timeout)

"""What `mingpt-torchrun` sets for elastic jobs that survive restarts and membership changes (torch 2.13),
and what its agent (mingpt.training.agent) and the workers tell each other.

Why a wrapper around torchrun: by default torchrun's agents share their rendezvous store with the
workers. With torch 2.13 a job on several agents then never trains (an agent times out on
`/torch.rendezvous.<id>.1/torchelastic/role_info/*`), a node joining later deadlocks the job, and
restarted workers can hang in `init_process_group`. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` avoids
all of it, but the agent reads it, so the worker cannot set it for itself: the launcher must.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from mingpt.processes import PR_SET_NAME, prctl, signal_when_parent_dies

STORE_SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# On GPUs (NCCL), a hung collective is found by NCCL's own watchdog too: errors end the process instead of
# hanging it, a heartbeat monitor ends a process whose watchdog itself is stuck, and on a timeout the flight
# recorder writes the last collectives of every process (to TORCH_FR_DUMP_TEMP_FILE, /tmp by default) for
# `python -m torch.distributed.flight_recorder`. The user's own values win, under either name of a setting.
NCCL_WATCH = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
FORMER_NAMES = {"TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE"}  # torch warns in every process at the old


def watch_nccl(environ: dict) -> None:
    """Add NCCL_WATCH's settings to `environ` (os.environ: the workers inherit it), but for those the user set."""
    for name, value in NCCL_WATCH.items():
        if name not in environ and FORMER_NAMES.get(name, name) not in environ:
            environ[name] = value

# Rendezvous settings for quick recovery (torch's defaults in brackets). A dead node is noticed when it has
# missed 3 heartbeats a second apart (15 s): nodes' clocks must agree to within about a second, as NTP keeps
# them. A round closes 1 s after its first node arrived (30 s): long enough for the survivors of a change,
# whose agents poll the rendezvous 4 times a second (mingpt.training.agent), to arrive together. The user's
# own keys win.
QUICK_RENDEZVOUS = {
    "join_timeout": "600",
    "last_call_timeout": "1",
    "close_timeout": "10",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
}

# Exit statuses by which a worker tells the agent that its generation ended because of another process,
# not of its own failure: a membership change, which mingpt-torchrun's agent restarts without using up
# --max-restarts (plain torchrun counts them as failures).
PEER_STOPPED = 75  # another process was asked to stop (SIGTERM): its node leaves, or the job is being resized
PEER_LOST = 76  # a collective failed: another process died, hung or was cut off
MEMBERSHIP_EXITS = {PEER_STOPPED: "asked to stop (SIGTERM)", PEER_LOST: "lost (its processes died or were cut off)"}

# How the agent tells its workers what changed before this generation (read by the leader, which logs it).
MEMBERSHIP = "MINGPT_MEMBERSHIP"


def merge_rendezvous_conf(user_conf: str, defaults: dict[str, str] = QUICK_RENDEZVOUS) -> str:
    """torchrun's `--rdzv-conf` string ("k=v,k=v") with `defaults` for every key the user left out."""
    merged = dict(defaults)
    for item in filter(None, (part.strip() for part in user_conf.split(","))):
        key, _, value = item.partition("=")
        merged[key.strip()] = value.strip()
    return ",".join(f"{key}={value}" for key, value in merged.items())


def membership_change() -> dict | None:
    """What this generation's agent saw change (nodes left and joined, why, when), or None: no agent said."""
    try:
        change = json.loads(os.environ.get(MEMBERSHIP, ""))
    except ValueError:
        return None
    return change if isinstance(change, dict) else None


def max_nodes_of_agent() -> int:
    """The most nodes the agent that started us allows (torchrun's --nnodes, "2" or "1:4"), read from
    its command line (torchrun gives workers no variable for it); 1 where that cannot be read."""
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return 1
    return max_nodes(args, os.environ.get("PET_NNODES", "1"))  # torchrun also reads options from PET_* variables


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


def name_this_worker() -> None:
    """Name a worker of torchrun's by its local rank (`mingpt-worker0`, as ps and top show it): one forked from the
    agent's server (mingpt.training.forkserver) has the agent's command line and the server's environment in /proc."""
    local_rank = os.environ.get("LOCAL_RANK", "")
    if "TORCHELASTIC_RUN_ID" in os.environ and local_rank.isdigit():
        prctl(PR_SET_NAME, f"mingpt-worker{local_rank}".encode())


def end_with_the_agent() -> None:
    """A worker that torchrun started is sent SIGTERM when its agent dies (SIGKILL, the OOM killer), as when the
    agent stops it: it saves its step and leaves. It trained on alone before, holding the run, so that the same
    command started again was refused, until a collective failed."""
    if "TORCHELASTIC_RUN_ID" in os.environ and not signal_when_parent_dies(signal.SIGTERM):
        os.kill(os.getpid(), signal.SIGTERM)  # the agent died before the request was made

"""What `mingpt-torchrun` sets for elastic jobs that survive restarts and membership changes (torch 2.13).

Why a wrapper around torchrun: by default torchrun's agents share their rendezvous store with the
workers. With torch 2.13 a job on several agents then never trains (an agent times out on
`/torch.rendezvous.<id>.1/torchelastic/role_info/*`), a node joining later deadlocks the job, and
restarted workers can hang in `init_process_group`. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` avoids
all of it, but the agent reads it, so the worker cannot set it for itself: the launcher must.
"""

from __future__ import annotations

STORE_SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Rendezvous settings for quick recovery: a dead node is noticed after 3 missed heartbeats (15 s,
# torch's default), a new round starts 5 s after the minimum of nodes is there (torch: 30 s), and
# a round is closed 10 s after it started to close (torch: 30 s). The user's own keys win.
QUICK_RENDEZVOUS = {
    "join_timeout": "600",
    "last_call_timeout": "5",
    "close_timeout": "10",
    "keep_alive_interval": "5",
    "keep_alive_max_attempt": "3",
}


def merge_rendezvous_conf(user_conf: str, defaults: dict[str, str] = QUICK_RENDEZVOUS) -> str:
    """torchrun's `--rdzv-conf` string ("k=v,k=v") with `defaults` for every key the user left out."""
    merged = dict(defaults)
    for item in filter(None, (part.strip() for part in user_conf.split(","))):
        key, _, value = item.partition("=")
        merged[key.strip()] = value.strip()
    return ",".join(f"{key}={value}" for key, value in merged.items())

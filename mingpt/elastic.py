"""Launching elastic jobs that survive restarts and membership changes (torch 2.13).

    mingpt-torchrun ARGS...         torchrun, with the settings elastic jobs need
    mingpt-rendezvous --port 29500  hosts the rendezvous store on a machine that does not train

Why a wrapper: by default torchrun's agents share their rendezvous store with the workers. With
torch 2.13 a job on several agents then never trains (an agent times out on
`/torch.rendezvous.<id>.1/torchelastic/role_info/*`), a node joining later deadlocks the job, and
restarted workers can hang in `init_process_group`. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` avoids
all of it, but the agent reads it, so the worker cannot set it for itself: the launcher must.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

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

log = logging.getLogger("mingpt")


def merge_rendezvous_conf(user_conf: str, defaults: dict[str, str] = QUICK_RENDEZVOUS) -> str:
    """torchrun's `--rdzv-conf` string ("k=v,k=v") with `defaults` for every key the user left out."""
    merged = dict(defaults)
    for item in filter(None, (part.strip() for part in user_conf.split(","))):
        key, _, value = item.partition("=")
        merged[key.strip()] = value.strip()
    return ",".join(f"{key}={value}" for key, value in merged.items())


def torchrun(argv: list[str] | None = None) -> None:
    """`mingpt-torchrun`: torchrun with the same arguments, the agents' store sharing off (unless the
    user set the variable) and quick rendezvous settings (merged under the user's `--rdzv-conf`)."""
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import record

    args = run.parse_args(argv)  # torchrun's own parser: the same options, the same errors
    args.rdzv_conf = merge_rendezvous_conf(args.rdzv_conf)
    os.environ.setdefault(STORE_SHARING, "1")
    print(f"mingpt-torchrun: {STORE_SHARING}={os.environ[STORE_SHARING]} --rdzv-conf={args.rdzv_conf}",
          file=sys.stderr, flush=True)
    record(run.run)(args)


def rendezvous(argv: list[str] | None = None) -> int:
    """`mingpt-rendezvous`: host torchrun's c10d rendezvous store until stopped (SIGTERM or Ctrl-C).

    Run it on a machine that does not train (a login node, the SLURM batch host) and point every
    agent's `--rdzv-endpoint` at it: the agents then join as clients, and any of them may die
    without taking the job down, which is not so when the first agent hosts the store.
    """
    parser = argparse.ArgumentParser(prog="mingpt-rendezvous", description=rendezvous.__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=29500, help="TCP port to listen on (default 29500)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # held for sigwait below: either stops us in order

    from torch.distributed import TCPStore

    try:  # a server listens on every interface, whatever host name it is given
        store = TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False, multi_tenant=True)
    except RuntimeError as e:  # torch's DistNetworkError
        print(f"error: cannot listen on port {args.port} ({str(e).splitlines()[0]}): another store or job "
              "may be using it; choose another port with --port", file=sys.stderr)
        return 2
    host = socket.gethostname()
    log.info("rendezvous store listening on port %d of %s. Start every node with: mingpt-torchrun "
             "--nnodes=MIN:MAX --rdzv-backend=c10d --rdzv-endpoint=%s:%d --rdzv-id=JOB ... train/main.py",
             args.port, host, host, args.port)
    stopped_by = signal.sigwait(stop_signals)
    log.info("stopped by %s: agents still running lose their rendezvous", signal.Signals(stopped_by).name)
    del store
    return 0

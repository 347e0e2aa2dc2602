"""`mingpt-torchrun ARGS...`: torchrun with the settings elastic jobs need (mingpt.launch); what ADDS lists."""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed import run

from mingpt import torch_internals
from mingpt.cli import configure_logging, run_command
from mingpt.errors import ConfigError
from mingpt.launch import forkserver
from mingpt.launch.checks import check_launch
from mingpt.launch.live import start
from mingpt.launch.node import launch, merge_rendezvous_conf

ADDS = """\
mingpt-torchrun: torch's torchrun (the same options, below), plus what an elastic mingpt job needs:
  - it prepares the job's data on this node before joining the rendezvous, and checks the node and
    worker counts and the endpoint first (one line and exit 2 for what torchrun would fail on later);
  - quick rendezvous settings, under any --rdzv-conf keys of yours, and the agents' store sharing off;
  - an agent that keeps the job going while nodes die, leave and join, without using up --max-restarts;
  - a watchdog that names a hung worker with its Python stack and restarts the workers in seconds;
  - after SIGTERM, the workers have 110 s to save before SIGKILL (--shutdown-timeout; torch: 30 s);
  - workers forked from a server that has imported torch and the trainer, not started anew each time;
  - on GPUs, NCCL's async error handling, heartbeat monitor and flight recorder;
  - the live mode, wherever mingpt-rendezvous serves the job (its store and torchft's Lighthouse): nodes
    dying, leaving and joining restart no worker on any other node. Before the training script, --live
    asks for it (refused where it cannot run), and --no-live for the restart mode: every change of nodes
    restarts every worker. The first line says which mode the node runs in, and why.
"""


def main(argv: list[str] | None = None, server: forkserver.Server | None = None) -> int:
    """`mingpt-torchrun`: torchrun with the same arguments and what ADDS lists. `server`: the copy of this process
    that workers are forked from (mingpt.launch.forkserver), or None: each worker starts as a new Python."""
    argv = sys.argv[1:] if argv is None else argv
    if _asks_for_help(argv):
        print(ADDS)
    try:
        argv, asked = _without_mode(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = run.parse_args(argv)  # torchrun's own parser: the same options, the same errors
    args.rdzv_conf = merge_rendezvous_conf(args.rdzv_conf)
    configure_logging(logging.WARNING, "%(asctime)s %(message)s", "%H:%M:%S")
    logging.getLogger("mingpt").setLevel(logging.INFO)  # this node's own progress and membership, on its own log
    options = argv[:_script_at(argv)]  # torchrun's own, before the training script
    status = run_command(lambda: torch_internals.check(sharded=False)) or \
        run_command(lambda: check_launch(args, options, asked == "live")) or run_command(lambda: start(args, asked))
    return status or launch(args, server)


def _script_at(argv: list[str]) -> int:
    """Where the training script is in `argv` (len(argv) where none is): torchrun's options come before it."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and (arg.endswith(".py") or arg == "mingpt-train"):
            return i
    return len(argv)


def _without_mode(argv: list[str]) -> tuple[list[str], str | None]:
    """argv without mingpt-torchrun's own --live or --no-live (before the training script), and the mode it asks for:
    "live", "restart", or None (mingpt.launch.live chooses)."""
    flags, script = {"--live": "live", "--no-live": "restart"}, _script_at(argv)
    asked = {flags[arg] for arg in argv[:script] if arg in flags}
    if len(asked) > 1:
        raise ConfigError("--live and --no-live ask for two modes: give one")
    return [arg for arg in argv[:script] if arg not in flags] + argv[script:], asked.pop() if asked else None


def _asks_for_help(argv: list[str]) -> bool:
    """Whether -h or --help comes before the training script (after it, it is the script's)."""
    return any(arg in ("-h", "--help") for arg in argv[:_script_at(argv)])


def command(argv: list[str] | None = None) -> None:
    """The `mingpt-torchrun` command: main's status. A refusal leaves by os._exit: a store client still retrying in a
    thread (mingpt.launch.checks) would abort the process as the interpreter tears down. The workers' server is forked
    first; workers forked from it leave through this function's first line, so nothing may catch around it."""
    server = forkserver.Server.fork()
    try:
        status = main(argv, server)
    finally:
        if server is not None:
            server.stop()
    if status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    command()

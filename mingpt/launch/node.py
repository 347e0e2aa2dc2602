"""How mingpt-torchrun runs its node's part of a job: the settings it gives torchrun, the data it prepares before
joining, and the agent, which starts the workers (forked from the warm server where it can).

Why a wrapper around torchrun: torchrun's agents share their rendezvous store with the workers by default, and then
a multi-node job never trains, a late joiner deadlocks it, and restarted workers can hang in `init_process_group`.
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` avoids it, but the agent reads it, so the launcher must set it."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from mingpt import torch_internals
from mingpt.checkpoint.shm import process_folder
from mingpt.jobenv import HELLASWAG_FETCHED
from mingpt.launch import agent, forkserver
from mingpt.training.app import CONF_DIR, Config, compose_config
from mingpt.training.preparation import fetch_hellaswag, prepare_data

log = logging.getLogger(__name__)

STORE_SHARING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# The workers' window between the agent's SIGTERM and its SIGKILL, to finish their step and snapshot: torch's 30 s
# cuts a large snapshot short. train/slurm.sbatch's notice (--signal=TERM@120) less its margin; --shutdown-timeout
# or this variable of the user's wins.
STOP_WINDOW = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
STOP_WINDOW_S = 110

# On GPUs, NCCL's own watchdog: errors end a process instead of hanging it, a heartbeat monitor ends one whose watchdog
# is stuck, and the flight recorder writes the last collectives on a timeout. The user's values win, under either name.
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


# Rendezvous settings for quick recovery; the user's own keys win. Heartbeats a second apart need nodes' clocks to
# agree to about a second (as NTP keeps them); a round closing a second after its first node is long enough for the
# survivors of a change, whose agents poll often (agent.POLL_S), to arrive together.
QUICK_RENDEZVOUS = {
    "join_timeout": "600",
    "last_call_timeout": "1",
    "close_timeout": "10",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
}


def merge_rendezvous_conf(user_conf: str, defaults: dict[str, str] = QUICK_RENDEZVOUS) -> str:
    """torchrun's `--rdzv-conf` string ("k=v,k=v") with `defaults` for every key the user left out."""
    merged = dict(defaults)
    for item in filter(None, (part.strip() for part in user_conf.split(","))):
        key, _, value = item.partition("=")
        merged[key.strip()] = value.strip()
    return ",".join(f"{key}={value}" for key, value in merged.items())


def warm_workers(args: argparse.Namespace, server: forkserver.Server | None) -> forkserver.Server | None:
    """`server`, told to serve this node's workers where they run a Python script; else None."""
    if server is None or args.no_python or args.module or not Path(args.training_script).is_file():
        return None
    server.serve(args.training_script)
    return server


def launch(args: argparse.Namespace, server: forkserver.Server | None) -> int:
    """Run this node's agent until the job ends; its exit status. With no `server` each worker is a new Python."""
    os.environ.setdefault(STORE_SHARING, "1")
    window = args.shutdown_timeout if args.shutdown_timeout is not None else \
        os.environ.setdefault(STOP_WINDOW, str(STOP_WINDOW_S))
    watch_nccl(os.environ)
    print(f"mingpt-torchrun: {STORE_SHARING}={os.environ[STORE_SHARING]} --rdzv-conf={args.rdzv_conf} "
          f"--shutdown-timeout={window}", file=sys.stderr, flush=True)
    agent.install()
    # Now, for a job that goes ahead, with the workers' environment set: the server's imports overlap the rendezvous.
    if warm_workers(args, server) is not None:
        torch_internals.start_workers_with(server.start)
    own_logs = _own_log_dir(args)
    try:
        record(run.run)(args)
    except agent.JobFinished as e:
        print(f"mingpt-torchrun: {e}", file=sys.stderr, flush=True)
    except agent.RestartsUsedUp as e:
        print(f"mingpt-torchrun: {e}", file=sys.stderr, flush=True)
        return e.status
    except SignalException as e:  # SIGTERM or SIGINT: the agent stopped its workers, which saved their step
        print(f"mingpt-torchrun: stopped by {e.sigval.name}; the workers' lines above say where they stopped",
              file=sys.stderr, flush=True)
        return 128 + e.sigval
    except ChildFailedError as e:
        if {failure.exitcode for failure in e.failures.values()} != {2}:
            raise  # a crash: torch's report of each failure, with its traceback
        print("mingpt-torchrun: this node's workers stopped on bad input or configuration (exit 2): their line "
              "above says what", file=sys.stderr, flush=True)
        return 2
    finally:
        if own_logs:
            shutil.rmtree(args.log_dir, ignore_errors=True)
    return 0


def _own_log_dir(args: argparse.Namespace) -> bool:
    """Where the user keeps no worker logs, torch would still leave a torchelastic_* folder in /tmp for its workers'
    error files: make it this agent's own, which goes when the agent ends, or, if it is killed, when the next starts."""
    if args.log_dir is not None or args.redirects != "0" or args.tee != "0" or args.logs_specs is not None:
        return False
    args.log_dir = str(process_folder("torchrun"))
    return True


# Hydra's flags that print (the config, help, the version) instead of running the application.
HYDRA_INFO_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--version", "--info", "-i", "--resolve",
                    "--shell-completion", "-sc"}


def job_config(args: argparse.Namespace) -> Config | None:
    """The job's configuration, where the script is a mingpt application (mingpt-train, or a script with `conf/`) that
    trains (with one of Hydra's printing flags, the workers print and end); else None."""
    conf = Path(args.training_script).resolve().parent / "conf"
    if Path(args.training_script).name == "mingpt-train":
        conf = CONF_DIR
    elif args.no_python or args.module or not (conf / "config.yaml").is_file():
        return None
    if {arg.split("=")[0] for arg in args.training_script_args} & HYDRA_INFO_FLAGS:
        return None
    return compose_config(conf, args.training_script_args)


def prepare_before_joining(args: argparse.Namespace, cfg: Config | None) -> None:
    """Prepare the data and fetch HellaSwag's file before this node's agent joins, not while the job waits (past
    trainer.dist_timeout_s, ending it)."""
    if cfg is None:
        return
    started = time.monotonic()
    fetched = fetch_hellaswag(cfg.trainer)
    if fetched is not None:
        os.environ[HELLASWAG_FETCHED] = fetched  # the workers inherit the agent's environment
    folder = prepare_data(cfg)
    log.info("mingpt-torchrun: data ready in %s (%.0f s); joining the job", folder, time.monotonic() - started)

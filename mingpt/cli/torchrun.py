"""`mingpt-torchrun ARGS...`: torchrun with the settings elastic jobs need (see mingpt.training.launcher).

Before the agent starts, the node and worker counts and the rendezvous endpoint are checked: what
torchrun would refuse with a traceback, or after a minute with two, is one line and exit 2."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterator

from torch.distributed import DistError, TCPStore, run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from mingpt import torch_internals
from mingpt.checkpoint.shm import check_temporary_folder, process_folder
from mingpt.cli import configure_logging, run_command
from mingpt.errors import ConfigError, one_line
from mingpt.training import agent, forkserver, live
from mingpt.training.app import CONF_DIR, compose_config
from mingpt.training.launcher import STORE_SHARING, merge_rendezvous_conf, watch_nccl
from mingpt.training.preparation import fetch_hellaswag, prepare_data

ADDS = """\
mingpt-torchrun: torch's torchrun (the same options, below), plus what an elastic mingpt job needs:
  - it prepares the job's data on this node before joining the rendezvous, and checks the node and
    worker counts and the endpoint first (one line and exit 2 for what torchrun would fail on later);
  - quick rendezvous settings, under any --rdzv-conf keys of yours, and the agents' store sharing off;
  - an agent that keeps the job going while nodes die, leave and join, without using up --max-restarts;
  - a watchdog that names a hung worker with its Python stack and restarts the workers in seconds;
  - workers forked from a server that has imported torch and the trainer, not started anew each time;
  - on GPUs, NCCL's async error handling, heartbeat monitor and flight recorder;
  - --live (before the training script): this node is one torchft replica group, and nodes dying,
    leaving and joining restart no worker on any other node (mingpt-rendezvous serves the Lighthouse).
"""
C10D_PORT = 29400  # torch's c10d rendezvous port when --rdzv-endpoint names none
log = logging.getLogger(__name__)
CHECK = "check with `nc -zv {host} {port}` from this node (docs/launching.md: Multinode troubleshooting)"


def main(argv: list[str] | None = None, server: forkserver.Server | None = None) -> int:
    """`mingpt-torchrun`: torchrun with the same arguments, the agents' store sharing off (unless the
    user set the variable), quick rendezvous settings (merged under the user's `--rdzv-conf`), workers forked
    from a server that has imported the trainer (mingpt.training.forkserver), and an agent that keeps the job
    going while nodes die, leave and join (mingpt.training.agent). `server`: the copy of this process that workers
    are forked from (command forks it), or None: each worker starts as a new Python."""
    argv = sys.argv[1:] if argv is None else argv
    if _asks_for_help(argv):
        print(ADDS)
    argv, live_mode = _without_live(argv)
    args = run.parse_args(argv)  # torchrun's own parser: the same options, the same errors
    args.rdzv_conf = merge_rendezvous_conf(args.rdzv_conf)
    configure_logging(logging.WARNING, "%(asctime)s %(message)s", "%H:%M:%S")
    logging.getLogger("mingpt").setLevel(logging.INFO)  # this node's own progress and membership, on its own log
    status = run_command(lambda: torch_internals.check(sharded=False)) or \
        run_command(lambda: check_launch(args, argv, live_mode)) or run_command(lambda: prepare_before_joining(args))
    if not status and live_mode:
        status = run_command(lambda: join_live(args))
    if status:
        return status
    return _launch(args, server)


def warm_workers(args: argparse.Namespace, server: forkserver.Server | None) -> forkserver.Server | None:
    """`server`, told to serve this node's workers where they run a Python script; else None."""
    if server is None or args.no_python or args.module or not Path(args.training_script).is_file():
        return None
    server.serve(args.training_script)
    return server


def _launch(args: argparse.Namespace, server: forkserver.Server | None) -> int:
    os.environ.setdefault(STORE_SHARING, "1")
    watch_nccl(os.environ)
    print(f"mingpt-torchrun: {STORE_SHARING}={os.environ[STORE_SHARING]} --rdzv-conf={args.rdzv_conf}",
          file=sys.stderr, flush=True)
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
    """Where the user keeps no worker logs (no --log-dir, --redirects, --tee or --logs-specs), torch would still
    make a torchelastic_* folder in /tmp for its workers' error files and leave it there: make it a folder of
    this agent's own, which goes when the agent ends, or, if it is killed, when the next one starts."""
    if args.log_dir is not None or args.redirects != "0" or args.tee != "0" or args.logs_specs is not None:
        return False
    args.log_dir = str(process_folder("torchrun"))
    return True


def _script_at(argv: list[str]) -> int:
    """Where the training script is in mingpt-torchrun's arguments (len(argv) where none is): torchrun's options
    come before it, the script's own after."""
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and (arg.endswith(".py") or arg == "mingpt-train"):
            return i
    return len(argv)


def _without_live(argv: list[str]) -> tuple[list[str], bool]:
    """argv without mingpt-torchrun's own --live (before the training script), and whether it was there."""
    if "--live" not in argv[:_script_at(argv)]:
        return argv, False
    i = argv.index("--live")
    return argv[:i] + argv[i + 1:], True


def join_live(args: argparse.Namespace) -> None:
    """--live: this node's torchrun becomes one replica group of the job. Its agent rendezvouses with this
    node's workers alone; the groups meet through torchft's Lighthouse, which mingpt-rendezvous serves beside
    the store at --rdzv-endpoint (mingpt.training.live)."""
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=C10D_PORT)
    try:  # (where the endpoint is this machine's, check_endpoint took this node for the store's host: not here)
        socket.create_connection((host, port), timeout=STORE_ANSWER_S).close()
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_ANSWER_S),
                         wait_for_workers=False)
        serves = store.check([live.LIGHTHOUSE_KEY])
    except (OSError, DistError) as e:
        check = CHECK.format(host=host, port=port)
        raise ConfigError(f"--live: no rendezvous store answers at {host}:{port} ({one_line(e)}); start "
                          f"mingpt-rendezvous --port {port} there first; {check}") from None
    if not serves:
        raise ConfigError(f"--live: the rendezvous store at {host}:{port} serves no Lighthouse; start it with "
                          f"mingpt-rendezvous --port {port}, which serves both")
    with socket.create_connection((host, port), timeout=STORE_ANSWER_S) as probe:
        reachable_at = probe.getsockname()[0]  # this node's address on the way to the rendezvous
    lower, _ = run.parse_min_max_nnodes(args.nnodes)
    os.environ.update({
        live.LIGHTHOUSE: f"http://{host}:{store.get(live.LIGHTHOUSE_KEY).decode()}",
        live.RENDEZVOUS: f"{host}:{port}",
        live.HOST: reachable_at,
        live.MIN_NODES: str(lower),
    })
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every step at its default level
    # This node's workers alone, on a rendezvous of their own that this agent hosts.
    args.nnodes, args.rdzv_endpoint = "1", "localhost:0"
    args.rdzv_conf = merge_rendezvous_conf(f"{args.rdzv_conf},is_host=true", {})
    log.info("mingpt-torchrun: live mode: this node is one replica group of job %s (Lighthouse %s)", args.rdzv_id,
             os.environ[live.LIGHTHOUSE])


def _asks_for_help(argv: list[str]) -> bool:
    """Whether -h or --help comes before the training script (after it, it is the script's)."""
    return any(arg in ("-h", "--help") for arg in argv[:_script_at(argv)])


def prepare_before_joining(args: argparse.Namespace) -> None:
    """Prepare (or reuse) the data the job's overrides describe, and fetch HellaSwag's file where it is scored,
    on this node, before its agent enters the rendezvous: a node joining a running job would otherwise make every
    other node wait while its workers tokenize, and past trainer.dist_timeout_s end the job. Only for a mingpt
    application (mingpt-train, or a script with a `conf/` folder beside it); a mistake in the overrides is one
    line here, before any agent starts."""
    conf = Path(args.training_script).resolve().parent / "conf"
    if Path(args.training_script).name == "mingpt-train":
        conf = CONF_DIR
    elif args.no_python or args.module or not (conf / "config.yaml").is_file():
        return
    if {arg.split("=")[0] for arg in args.training_script_args} & HYDRA_INFO_FLAGS:  # the workers print, and end
        return
    cfg = compose_config(conf, args.training_script_args)
    started = time.monotonic()
    fetch_hellaswag(cfg.trainer)
    folder = prepare_data(cfg)
    log.info("mingpt-torchrun: data ready in %s (%.0f s); joining the job", folder, time.monotonic() - started)


# Hydra's flags that print (the config, help, the version) instead of running the application.
HYDRA_INFO_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--version", "--info", "-i", "--resolve",
                    "--shell-completion", "-sc"}


def check_launch(args: argparse.Namespace, argv: list[str], live_mode: bool = False) -> None:
    """Refuse in one line what torchrun refuses with a traceback (node and worker counts), or only after a
    minute and two tracebacks (a rendezvous endpoint it cannot resolve or reach)."""
    check_temporary_folder()  # where the agent keeps its logs and its watchdog's marks
    check_nnodes(args.nnodes)
    if not (args.no_python or args.module or Path(args.training_script).is_file()):
        raise ConfigError(f"the training script {args.training_script} is not a file; a command on the PATH, such as "
                          "mingpt-train, needs --no-python before it")
    if live_mode and (args.standalone or not args.rdzv_endpoint):
        raise ConfigError("--live: give --rdzv-endpoint=HOST:PORT, where mingpt-rendezvous --port PORT serves the "
                          "rendezvous and torchft's Lighthouse (not --standalone)")
    use_c10d(args, argv)
    check_nproc_per_node(args.nproc_per_node)
    check_rendezvous(args)
    if args.rdzv_backend == "c10d" and not args.standalone:  # --standalone makes its own store on localhost
        check_endpoint(args.rdzv_endpoint, args.rdzv_conf)


def use_c10d(args: argparse.Namespace, argv: list[str]) -> None:
    """The agent keeps a job going on torch's c10d rendezvous, which needs no other service. Where the user named no
    backend (torchrun's default, static, is a fixed set of nodes that never changes): c10d, at --rdzv-endpoint; else
    on one node, on a free port of this machine (as --standalone), or at --master-addr:--master-port, where static
    would have met."""
    if any(arg.split("=")[0] in ("--rdzv-backend", "--rdzv_backend") for arg in argv[:_script_at(argv)]) or \
            "PET_RDZV_BACKEND" in os.environ:
        return  # check_rendezvous refuses any other than c10d
    args.rdzv_backend = "c10d"
    if not args.rdzv_endpoint and not args.standalone:
        if run.parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.standalone = True
        else:
            args.rdzv_endpoint = f"{args.master_addr}:{args.master_port}"


BACKENDS = ("c10d",)  # the rendezvous backends the agent runs on (torch's others: static, etcd, etcd-v2)
# The --rdzv-conf keys that are numbers of seconds or attempts, and the least of each (a heartbeat every 0 s
# is a busy loop; 0 attempts declares every node dead).
NUMERIC_CONF = {"join_timeout": 1, "last_call_timeout": 0, "close_timeout": 1, "keep_alive_interval": 1,
                "keep_alive_max_attempt": 1, "read_timeout": 1, "timeout": 1}


def check_rendezvous(args: argparse.Namespace) -> None:
    if args.rdzv_backend not in BACKENDS:
        raise ConfigError(f"--rdzv-backend={args.rdzv_backend}: mingpt-torchrun's agent runs on the c10d rendezvous, "
                          "which needs no other service: leave --rdzv-backend out, or give c10d")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts={args.max_restarts}: give a number of restarts of at least 0")
    if "@" in args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint takes HOST:PORT, with no user name or password")
    try:
        conf = torch_internals.parse_rendezvous_config(args.rdzv_conf)
    except ValueError as e:
        raise ConfigError(f"--rdzv-conf: {str(e).rstrip('.')}; give KEY=VALUE pairs separated by commas") from None
    for key, least in NUMERIC_CONF.items():
        if key in conf and not (conf[key].isdigit() and int(conf[key]) >= least):
            raise ConfigError(f"--rdzv-conf: {key}={conf[key]} must be a whole number of at least {least}")


def check_nnodes(value: str) -> None:
    try:  # torch's own reading: N or MIN:MAX
        low, high = run.parse_min_max_nnodes(value)
    except (ValueError, RuntimeError):  # not numbers; more than two of them
        low = high = 0
    if not 1 <= low <= high:
        raise ConfigError(f"--nnodes={value}: give a number of nodes of at least 1, or MIN:MAX with "
                          "1 <= MIN <= MAX (e.g. --nnodes=1:4)")


def check_nproc_per_node(value: str) -> None:
    try:  # torch's own reading: a number, cpu, gpu, xpu or auto, the device count where there is one
        count, reason = run.determine_local_world_size(value), ""
    except ValueError as e:  # "Unsupported nproc_per_node value: x", "Cuda is not available."
        count, reason = 0, f" ({e})"
    if count < 1:
        raise ConfigError(f"--nproc-per-node={value}{reason}: give a number of workers of at least 1, or cpu, "
                          "gpu or auto (one worker per CPU or GPU of this node)")


def check_endpoint(endpoint: str, rdzv_conf: str) -> None:
    """The c10d store at `endpoint` resolves, and unless this node hosts it, accepts a connection.

    A node may start before the store's host: it is given as long as torch's own store client waits
    (the rendezvous `read_timeout`, 60 s unless --rdzv-conf sets it), so this check never gives up
    sooner than torchrun would, and ends what would fail anyway in one line instead of two tracebacks."""
    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=C10D_PORT)
        conf = torch_internals.parse_rendezvous_config(rdzv_conf)
        params = RendezvousParameters("c10d", endpoint, "check", 1, 1, **conf)
        is_host, wait_s = params.get_as_bool("is_host"), params.get_as_int("read_timeout", 60)
        if wait_s < 1:
            raise ValueError(f"The read timeout must be a positive integer, got {wait_s}.")
    except ValueError as e:  # torch's messages name the port or the option
        raise ConfigError(f"{str(e).rstrip('.')}; fix --rdzv-endpoint or --rdzv-conf") from None
    check = CHECK.format(host=host, port=port)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:  # socket.gaierror: unknown name, or no DNS to ask
        raise ConfigError(f"--rdzv-endpoint={endpoint}: cannot resolve {host!r} ({e.strerror}); give the name or "
                          f"address of the store's host as this node knows it; {check}") from None
    told = is_host is not None
    if not told:
        is_host = torch_internals.is_this_machine(host)  # as torch decides who hosts the store
    if is_host:
        return check_port_to_host(host, port, endpoint, told)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5, wait_s)).close()
            return check_store_answers(host, port, endpoint)
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"--rdzv-endpoint={endpoint}: no rendezvous store answers at {host}:{port} after {wait_s} s "
                    f"({e.strerror or e}); start the store there first (mingpt-rendezvous --port {port}, or the "
                    f"node named in --rdzv-endpoint), and {check}") from None
            time.sleep(1)  # refused at once while the store's host is still starting: ask again


STORE_ANSWER_S = 6.0  # how long a rendezvous store may take to answer its first question (at once, on a network)


def check_port_to_host(host: str, port: int, endpoint: str, told: bool) -> None:
    """This node is to host the store at `port`. Where the port is taken, torch's agent, told to host (is_host=true),
    fails with a traceback; deciding for itself, it joins whatever listens there as a store's client, which waits
    for good on another kind of server. A store already there (another agent of this machine hosts it) is joined."""
    if port == 0 or _port_is_free(port):
        return
    if not told:
        try:
            socket.create_connection((host, port), timeout=5).close()
        except OSError:
            pass
        else:
            return check_store_answers(host, port, endpoint)
    raise ConfigError(f"--rdzv-endpoint={endpoint}: this node is to host the rendezvous store, but port {port} is "
                      f"taken on this machine ({what_answers(host, port)}); give a free port, or stop what uses it")


def _port_is_free(port: int) -> bool:
    """Whether a store could listen on `port` of every address of this machine, as torch's does."""
    try:
        if socket.has_dualstack_ipv6():
            socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True).close()
        else:
            socket.create_server(("", port)).close()
    except OSError as e:
        return e.errno != errno.EADDRINUSE  # not ours to judge otherwise (a privileged port): torch says
    return True


def what_answers(host: str, port: int) -> str:
    """What the server at host:port says, in words: its greeting (SSH, SMTP), or its answer to an HTTP request."""
    try:
        with socket.create_connection((host, port), timeout=2) as peer:
            peer.settimeout(1)
            said = _greeting(peer)
    except OSError as e:
        return f"nothing accepts a connection at {host}:{port} ({e.strerror or e}), though the port is in use"
    first = said.decode("ascii", "replace").strip().splitlines()[0] if said.strip() else ""
    return f"{host}:{port} answered {first[:80]!r}" if first else f"{host}:{port} said nothing"


def _greeting(peer: socket.socket) -> bytes:
    try:
        return peer.recv(200)
    except TimeoutError:  # a server that waits to be asked: ask as a web browser would
        pass
    try:
        peer.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
        return peer.recv(200)
    except OSError:
        return b""


def check_store_answers(host: str, port: int, endpoint: str) -> None:
    """A port that accepts connections is not yet a rendezvous store: torch's store client, connecting to
    another kind of server (an HTTP port, say), waits for good, whatever its timeout. So its first question
    is asked in a thread, and given STORE_ANSWER_S; standard error is closed meanwhile, as the client logs each
    failed try with a C++ stack trace (70-190 lines before the one that says what is wrong)."""
    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_ANSWER_S),
                             wait_for_workers=False)
            store.check(["mingpt-torchrun/probe"])
            outcome.append(None)
        except Exception as e:
            outcome.append(e)

    asking = threading.Thread(target=ask, name="store-probe", daemon=True)  # left behind if it never returns
    with _stderr_closed():
        asking.start()
        asking.join(STORE_ANSWER_S)
    if not outcome or outcome[0] is not None:
        why = f"({one_line(outcome[0])})" if outcome else f"within {STORE_ANSWER_S:.0f} s"
        raise ConfigError(f"--rdzv-endpoint={endpoint}: {host}:{port} accepts connections but does not answer as a "
                          f"rendezvous store {why}; {what_answers(host, port)}: another kind of server uses that port; "
                          "give the port of mingpt-rendezvous, or of the node that hosts the store")


@contextmanager
def _stderr_closed() -> Iterator[None]:
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def command(argv: list[str] | None = None) -> None:
    """The `mingpt-torchrun` command: main's status. A refusal leaves at once (os._exit, the output flushed): a store
    client still retrying in a thread (check_store_answers) would abort the process as the interpreter tears down.

    The workers' server is forked first, from this process as it started (mingpt.training.forkserver). The workers
    forked from it leave through this function's first line, as their scripts end: nothing may catch around it."""
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

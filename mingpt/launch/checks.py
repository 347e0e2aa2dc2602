"""What mingpt-torchrun checks before its agent starts (counts, rendezvous settings and endpoint, temporary folder):
what torchrun would refuse with a traceback, or only after minutes, is one line here (a ConfigError) and exit 2."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterator

from torch.distributed import TCPStore, run
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from mingpt import torch_internals
from mingpt.checkpoint.shm import check_temporary_folder
from mingpt.errors import ConfigError, one_line

C10D_PORT = 29400  # torch's c10d rendezvous port when --rdzv-endpoint names none


CHECK = "check with `nc -zv {host} {port}` from this node (docs/launching.md: Multinode troubleshooting)"


def check_launch(args: argparse.Namespace, options: list[str], live_mode: bool = False) -> None:
    """`options`: the arguments given before the training script (torchrun's own)."""
    check_temporary_folder()  # where the agent keeps its logs and its watchdog's marks
    check_nnodes(args.nnodes)
    if not (args.no_python or args.module or Path(args.training_script).is_file()):
        raise ConfigError(f"the training script {args.training_script} is not a file; a command on the PATH, such as "
                          "mingpt-train, needs --no-python before it")
    if live_mode and (args.standalone or not args.rdzv_endpoint):
        raise ConfigError("--live: give --rdzv-endpoint=HOST:PORT, where mingpt-rendezvous --port PORT serves the "
                          "rendezvous and torchft's Lighthouse (not --standalone)")
    use_c10d(args, options)
    check_nproc_per_node(args.nproc_per_node)
    check_rendezvous(args)
    if args.rdzv_backend == "c10d" and not args.standalone:  # --standalone makes its own store on localhost
        check_endpoint(args.rdzv_endpoint, args.rdzv_conf)


def use_c10d(args: argparse.Namespace, options: list[str]) -> None:
    """Where the user named no backend (torchrun's default, static, is a fixed set of nodes): c10d, which needs no
    other service, at --rdzv-endpoint, else as --standalone on one node, or where static would have met."""
    if any(arg.split("=")[0] in ("--rdzv-backend", "--rdzv_backend") for arg in options) or \
            "PET_RDZV_BACKEND" in os.environ:
        return  # check_rendezvous refuses any other than c10d
    args.rdzv_backend = "c10d"
    if not args.rdzv_endpoint and not args.standalone:
        if run.parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.standalone = True
        else:
            args.rdzv_endpoint = f"{args.master_addr}:{args.master_port}"


BACKENDS = ("c10d",)  # the rendezvous backends the agent runs on (torch's others: static, etcd, etcd-v2)


# The --rdzv-conf keys that are numbers, and the least of each (a 0 s heartbeat busy-loops; 0 attempts kill every node).
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
    """The c10d store at `endpoint` resolves, and unless this node hosts it, accepts a connection within torch's own
    `read_timeout` (a node may start before the store's host: this never gives up sooner than torchrun would)."""
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
    """Where the port is taken, torch's agent told to host fails with a traceback, and one deciding for itself joins
    whatever listens there, waiting for good on another kind of server. A store already there is joined."""
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
    """torch's store client waits for good on another kind of server (an HTTP port), whatever its timeout: ask in a
    thread, for STORE_ANSWER_S, with standard error closed (the client logs each try with a long C++ stack)."""
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


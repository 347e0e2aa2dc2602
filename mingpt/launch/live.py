"""The launching side of the live mode (mingpt-torchrun --live; the workers' side is mingpt.training.live): a node
finds the Lighthouse that mingpt-rendezvous serves beside its store, and runs its workers, which meet the other nodes'
there."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import time
from datetime import timedelta

from torch.distributed import DistError, TCPStore, run
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from mingpt.errors import ConfigError, one_line
from mingpt.jobenv import LIGHTHOUSE_KEY, LIVE_HOST, LIVE_LIGHTHOUSE, LIVE_MIN_NODES, LIVE_RENDEZVOUS
from mingpt.launch.checks import C10D_PORT, CHECK, STORE_ANSWER_S
from mingpt.launch.node import job_config, merge_rendezvous_conf, prepare_before_joining
from mingpt.training.app import Config

log = logging.getLogger(__name__)


def start(args: argparse.Namespace, asked: str | None) -> None:
    """Say this node's mode first (`asked`: "live" for --live, "restart" for --no-live, None to choose), then prepare
    the job's data, then, live, find the Lighthouse."""
    cfg = job_config(args)
    live, why = choose_mode(args, asked, cfg)
    log.info("mingpt-torchrun: %s mode (%s)", "live" if live else "restart", why)
    prepare_before_joining(args, cfg)
    if live:
        join_live(args)


def choose_mode(args: argparse.Namespace, asked: str | None, cfg: Config | None) -> tuple[bool, str]:
    """Whether this node runs the job in the live mode, and why: where asked, else wherever mingpt-rendezvous serves
    the job's store and its Lighthouse and the job can run live."""
    if asked is not None:
        return asked == "live", "--live" if asked == "live" else "--no-live"
    if args.standalone or run.parse_min_max_nnodes(args.nnodes)[1] == 1:
        return False, "one node; --live for a job of several around mingpt-rendezvous"
    if cfg is not None and cfg.trainer.parallelism == "fsdp":
        return False, "trainer.parallelism=fsdp shards over every node, which the live mode cannot"
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=C10D_PORT)
    try:
        lighthouse = _lighthouse_port(host, port)
    except (OSError, DistError):  # nothing listens yet: this node hosts the store, as torch's agent does
        return False, f"this node hosts the rendezvous store at {host}:{port}; --live needs mingpt-rendezvous there"
    if lighthouse is None:
        time.sleep(1)  # mingpt-rendezvous publishes its Lighthouse just after its store listens
        lighthouse = _lighthouse_port(host, port)
    if lighthouse is None:
        return False, f"the store at {host}:{port} serves no Lighthouse (it is not mingpt-rendezvous's)"
    return True, f"mingpt-rendezvous at {host}:{port} serves the job's Lighthouse; --no-live for the restart mode"


def _lighthouse_port(host: str, port: int) -> str | None:
    """The port of the Lighthouse that the store at host:port publishes; None where it publishes none."""
    socket.create_connection((host, port), timeout=STORE_ANSWER_S).close()
    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_ANSWER_S), wait_for_workers=False)
    return store.get(LIGHTHOUSE_KEY).decode() if store.check([LIGHTHOUSE_KEY]) else None


def join_live(args: argparse.Namespace) -> None:
    """This node's workers meet the other nodes' through the Lighthouse at --rdzv-endpoint."""
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=C10D_PORT)
    try:  # (where the endpoint is this machine's, check_endpoint took this node for the store's host: not here)
        lighthouse = _lighthouse_port(host, port)
    except (OSError, DistError) as e:
        check = CHECK.format(host=host, port=port)
        raise ConfigError(f"--live: no rendezvous store answers at {host}:{port} ({one_line(e)}); start "
                          f"mingpt-rendezvous --port {port} there first; {check}") from None
    if lighthouse is None:
        raise ConfigError(f"--live: the rendezvous store at {host}:{port} serves no Lighthouse; start it with "
                          f"mingpt-rendezvous --port {port}, which serves both")
    try:
        import torchft  # noqa: F401  (the workers' engine: a node that cannot load it cannot take part)
        socket.create_connection((host, int(lighthouse)), timeout=STORE_ANSWER_S).close()
    except (ImportError, OSError) as e:
        raise ConfigError(f"this node cannot join live job {args.rdzv_id}: {one_line(e)}; fix it, or start every node "
                          "of the job with --no-live (the restart mode)") from None
    with socket.create_connection((host, port), timeout=STORE_ANSWER_S) as probe:
        reachable_at = probe.getsockname()[0]  # this node's address on the way to the rendezvous
    lower, _ = run.parse_min_max_nnodes(args.nnodes)
    os.environ.update({
        LIVE_LIGHTHOUSE: f"http://{host}:{lighthouse}",
        LIVE_RENDEZVOUS: f"{host}:{port}",
        LIVE_HOST: reachable_at,
        LIVE_MIN_NODES: str(lower),
    })
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every step at its default level
    args.nnodes, args.rdzv_endpoint = "1", "localhost:0"
    args.rdzv_conf = merge_rendezvous_conf(f"{args.rdzv_conf},is_host=true", {})
    log.info("mingpt-torchrun: this node's workers meet live job %s's through the Lighthouse %s", args.rdzv_id,
             os.environ[LIVE_LIGHTHOUSE])

"""The launching side of the live mode (mingpt-torchrun --live; the workers' side is mingpt.training.live): a node
finds the Lighthouse that mingpt-rendezvous serves beside its store, and runs its workers, which meet the other nodes'
there."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from datetime import timedelta

from torch.distributed import DistError, TCPStore, run
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from mingpt.errors import ConfigError, one_line
from mingpt.jobenv import LIGHTHOUSE_KEY, LIVE_HOST, LIVE_LIGHTHOUSE, LIVE_MIN_NODES, LIVE_RENDEZVOUS
from mingpt.launch.checks import C10D_PORT, CHECK, STORE_ANSWER_S
from mingpt.launch.node import merge_rendezvous_conf

log = logging.getLogger(__name__)


def join_live(args: argparse.Namespace) -> None:
    """--live: this node is one replica group; the groups meet through the Lighthouse at --rdzv-endpoint."""
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=C10D_PORT)
    try:  # (where the endpoint is this machine's, check_endpoint took this node for the store's host: not here)
        socket.create_connection((host, port), timeout=STORE_ANSWER_S).close()
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_ANSWER_S), wait_for_workers=False)
        serves = store.check([LIGHTHOUSE_KEY])
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
        LIVE_LIGHTHOUSE: f"http://{host}:{store.get(LIGHTHOUSE_KEY).decode()}",
        LIVE_RENDEZVOUS: f"{host}:{port}",
        LIVE_HOST: reachable_at,
        LIVE_MIN_NODES: str(lower),
    })
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every step at its default level
    args.nnodes, args.rdzv_endpoint = "1", "localhost:0"
    args.rdzv_conf = merge_rendezvous_conf(f"{args.rdzv_conf},is_host=true", {})
    log.info("mingpt-torchrun: live mode: this node is one replica group of job %s (Lighthouse %s)", args.rdzv_id,
             os.environ[LIVE_LIGHTHOUSE])


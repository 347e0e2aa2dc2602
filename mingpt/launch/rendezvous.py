"""What `mingpt-rendezvous` serves on a machine that does not train: torchrun's c10d rendezvous store, and beside
it the Lighthouse where the groups of live jobs meet (mingpt-torchrun --live)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from mingpt.jobenv import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, LIGHTHOUSE_KEY, QUORUM_TICK_MS, STOP_GRACE_S

log = logging.getLogger(__name__)


def serve(port: int, lighthouse_port: int, lighthouse_chosen: bool) -> int:
    """Serve the store and Lighthouse (the store alone where an unchosen port is taken) until SIGINT or SIGTERM;
    with a Lighthouse, until STOP_GRACE_S after SIGTERM."""
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # held for sigwait below: either stops us in order
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse logs every quorum at its default level
    from torch.distributed import TCPStore  # imported once the flags are read, so that --help is quick
    from torchft.coordination import LighthouseServer  # noqa: F401  (before the store listens: a node that asks it
    # meanwhile would find no Lighthouse published, and choose the restart mode; mingpt.launch.live.choose_mode)

    try:  # a server listens on every interface, whatever host name it is given
        store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    except RuntimeError as e:  # torch's DistNetworkError
        print(f"error: cannot listen on port {port} ({str(e).splitlines()[0]}): another store or job "
              "may be using it; choose another port with --port", file=sys.stderr)
        return 2
    try:
        lighthouse = start_lighthouse(lighthouse_port)
    except RuntimeError as e:  # the port is taken: torchft's error names the address
        why = f"cannot start the Lighthouse of live jobs on port {lighthouse_port} ({str(e).splitlines()[0]})"
        if lighthouse_chosen:
            print(f"error: {why}: choose another port with --lighthouse-port", file=sys.stderr)
            return 2
        log.warning("%s: serving the store alone (mingpt-torchrun --live will refuse it); give --lighthouse-port "
                    "for live jobs", why)
        lighthouse = None
    host = socket.gethostname()
    if lighthouse is not None:
        store.set(LIGHTHOUSE_KEY, str(lighthouse_port))  # where mingpt-torchrun --live finds it
        log.info("the Lighthouse of live jobs (mingpt-torchrun --live) listens on port %d", lighthouse_port)
    log.info("rendezvous store listening on port %d of %s. Start every node with: mingpt-torchrun [--live] "
             "--nnodes=MIN:MAX --rdzv-backend=c10d --rdzv-endpoint=%s:%d --rdzv-id=JOB ... train/main.py",
             port, host, host, port)
    # At a job's end Slurm signals every process at once: a live node's last step still needs the Lighthouse.
    if signal.sigwait(stop_signals) == signal.SIGTERM and lighthouse is not None:
        log.info("SIGTERM: serving %.0f s more, while the job's nodes stop and save their step (SIGINT or SIGTERM "
                 "again: stop now)", STOP_GRACE_S)
        signal.sigtimedwait(stop_signals, STOP_GRACE_S)
    log.info("stopped: agents still running lose their rendezvous")
    if lighthouse is not None:
        lighthouse.shutdown()
    del store
    return 0


def start_lighthouse(port: int):
    """torchft's Lighthouse on `port` (every interface), with the live mode's timeouts."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=f"0.0.0.0:{port}", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                            quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)

"""`mingpt-rendezvous --port 29500`: host torchrun's rendezvous store, and the Lighthouse of live jobs, on a
machine that does not train."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from mingpt.cli import command_parser, configure_logging, summary

log = logging.getLogger("mingpt")


def main(argv: list[str] | None = None) -> int:
    """`mingpt-rendezvous`: host torchrun's c10d rendezvous store until stopped (SIGTERM or Ctrl-C).

    Run it on a machine that does not train (a login node, the SLURM batch host) and point every
    agent's `--rdzv-endpoint` at it: the agents then join as clients, and any of them may die
    without taking the job down, which is not so when the first agent hosts the store.
    """
    parser = command_parser("mingpt-rendezvous", summary(main.__doc__))
    parser.add_argument("--port", type=int, default=29500, help="TCP port to listen on")
    # ("%(default).0s" prints nothing: the default is worked out from --port.)
    parser.add_argument("--lighthouse-port", type=int, default=None,
                        help="TCP port of torchft's Lighthouse, for mingpt-torchrun --live (default: --port + "
                             "1)%(default).0s")
    args = parser.parse_args(argv)
    chosen = args.lighthouse_port is not None  # else --port + 1, which a job of torchrun's alone can do without
    if not chosen:
        args.lighthouse_port = args.port + 1
    for flag, port in (("--port", args.port), ("--lighthouse-port", args.lighthouse_port)):
        if not 0 < port < 65536:
            implied = "" if chosen or flag == "--port" else f" (--port + 1: give --lighthouse-port below {port})"
            parser.error(f"{flag} must be in 1..65535, got {port}{implied}")
    configure_logging(logging.WARNING, "%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    log.setLevel(logging.INFO)
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # held for sigwait below: either stops us in order

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse logs every quorum at its default level
    from torch.distributed import TCPStore  # imported once the flags are read, so that --help is quick

    from mingpt.training import live

    try:  # a server listens on every interface, whatever host name it is given
        store = TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False, multi_tenant=True)
    except RuntimeError as e:  # torch's DistNetworkError
        print(f"error: cannot listen on port {args.port} ({str(e).splitlines()[0]}): another store or job "
              "may be using it; choose another port with --port", file=sys.stderr)
        return 2
    try:
        lighthouse = start_lighthouse(args.lighthouse_port)
    except RuntimeError as e:  # the port is taken: torchft's error names the address
        why = f"cannot start the Lighthouse of live jobs on port {args.lighthouse_port} ({str(e).splitlines()[0]})"
        if chosen:
            print(f"error: {why}: choose another port with --lighthouse-port", file=sys.stderr)
            return 2
        log.warning("%s: serving the store alone (mingpt-torchrun --live will refuse it); give --lighthouse-port "
                    "for live jobs", why)
        lighthouse = None
    host = socket.gethostname()
    if lighthouse is not None:
        store.set(live.LIGHTHOUSE_KEY, str(args.lighthouse_port))  # where mingpt-torchrun --live finds it
        log.info("the Lighthouse of live jobs (mingpt-torchrun --live) listens on port %d", args.lighthouse_port)
    log.info("rendezvous store listening on port %d of %s. Start every node with: mingpt-torchrun [--live] "
             "--nnodes=MIN:MAX --rdzv-backend=c10d --rdzv-endpoint=%s:%d --rdzv-id=JOB ... train/main.py",
             args.port, host, host, args.port)
    stopped_by = signal.sigwait(stop_signals)
    log.info("stopped by %s: agents still running lose their rendezvous", signal.Signals(stopped_by).name)
    if lighthouse is not None:
        lighthouse.shutdown()
    del store
    return 0


def start_lighthouse(port: int):
    """torchft's Lighthouse on `port` (every interface), with the live mode's timeouts."""
    from torchft.coordination import LighthouseServer

    from mingpt.training import live

    return LighthouseServer(bind=f"0.0.0.0:{port}", min_replicas=1, join_timeout_ms=live.JOIN_TIMEOUT_MS,
                            quorum_tick_ms=live.QUORUM_TICK_MS, heartbeat_timeout_ms=live.HEARTBEAT_TIMEOUT_MS)


if __name__ == "__main__":
    raise SystemExit(main())

"""`mingpt-rendezvous --port 29500`: host torchrun's rendezvous store on a machine that does not train."""

from __future__ import annotations

import logging
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
    parser.add_argument("--port", type=int, default=29500, help="TCP port to listen on (default 29500)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    configure_logging(logging.WARNING, "%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    log.setLevel(logging.INFO)
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # held for sigwait below: either stops us in order

    from torch.distributed import TCPStore  # imported once the flags are read, so that --help is quick

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


if __name__ == "__main__":
    raise SystemExit(main())

"""`mingpt-rendezvous --port 29500`: host torchrun's rendezvous store, and the Lighthouse of live jobs, on a
machine that does not train."""

from __future__ import annotations

import logging

from mingpt.cli import command_parser, configure_logging, summary
from mingpt.launch.rendezvous import serve


def main(argv: list[str] | None = None) -> int:
    """`mingpt-rendezvous`: host torchrun's c10d rendezvous store until Ctrl-C or SIGTERM (its Lighthouse: 30 s on).

    On a machine that does not train, so that any agent may die without taking the job down."""
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
    logging.getLogger("mingpt").setLevel(logging.INFO)
    return serve(args.port, args.lighthouse_port, chosen)


if __name__ == "__main__":
    raise SystemExit(main())

"""`mingpt-torchrun ARGS...`: torchrun with the settings elastic jobs need (see mingpt.training.launcher)."""

from __future__ import annotations

import os
import sys

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.errors import record

from mingpt.training.launcher import STORE_SHARING, merge_rendezvous_conf


def main(argv: list[str] | None = None) -> None:
    """`mingpt-torchrun`: torchrun with the same arguments, the agents' store sharing off (unless the
    user set the variable) and quick rendezvous settings (merged under the user's `--rdzv-conf`)."""
    args = run.parse_args(argv)  # torchrun's own parser: the same options, the same errors
    args.rdzv_conf = merge_rendezvous_conf(args.rdzv_conf)
    os.environ.setdefault(STORE_SHARING, "1")
    print(f"mingpt-torchrun: {STORE_SHARING}={os.environ[STORE_SHARING]} --rdzv-conf={args.rdzv_conf}",
          file=sys.stderr, flush=True)
    record(run.run)(args)


if __name__ == "__main__":
    main()

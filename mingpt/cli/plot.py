"""`mingpt-plot RUN`: a picture of a run's loss from its metrics.jsonl (see mingpt.metrics.plot).

Needs matplotlib: pip install -e ".[plot]"."""

from __future__ import annotations

import logging
import os

from mingpt.cli import command_parser, configure_logging, run_command, summary
from mingpt.errors import MinGPTError
from mingpt.metrics.plot import curves, draw, pyplot, read_records
from mingpt.storage import redact


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mingpt-plot", summary(__doc__))
    parser.add_argument("run", help="a snapshot.dir holding metrics.jsonl (local path or s3://...)")
    parser.add_argument("-o", "--output", default="loss.png", help="the picture to write (default: loss.png)")
    args = parser.parse_args(argv)
    configure_logging(logging.WARNING, "%(levelname)s %(message)s")
    return run_command(lambda: plot(args.run, args.output))


PICTURES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def plot(run: str, output: str) -> None:
    try:
        plt = pyplot()  # first: the one thing a user may have to install
    except ImportError:
        raise MinGPTError('mingpt-plot needs matplotlib: pip install -e ".[plot]" (or pip install matplotlib)') \
            from None
    if not output.lower().endswith(PICTURES) or os.path.isdir(output):  # matplotlib adds .png, or refuses the name
        raise MinGPTError(f"-o {output}: give a file name ending in {', '.join(PICTURES)} (the picture's format)")
    data = curves(read_records(run))
    if not data.train_loss and not data.val_loss:
        raise MinGPTError(f"{redact(run)}/metrics.jsonl holds no losses yet")
    last = max([*data.train_loss, *data.val_loss])
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        draw(data, f"{redact(run.rstrip('/'))}: step {last}", output, plt)
    except OSError as e:
        raise MinGPTError(f"cannot write {output}: {e}") from None
    print(os.path.abspath(output))


if __name__ == "__main__":
    raise SystemExit(main())

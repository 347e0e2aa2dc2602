"""The command-line tools. Each parses its flags, calls the library, and exits through `run_command`: a mistake of
the user's or of stored data (MinGPTError) is one line and exit 2, Ctrl-C 130, SIGTERM 143, never a traceback."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Callable

import mingpt
from mingpt.errors import MinGPTError, forget_stops, raise_stopped
from mingpt.storage import RedactingFilter, redact


def run_command(command: Callable[[], int | None], interrupted: str = "interrupted") -> int:
    """`command()`'s exit status (None is 0); MinGPTError -> its message and 2; Ctrl-C (SIGINT) or SIGTERM ->
    `interrupted` and 128 + the signal's number (130, 143), as shells report a process the signal ended."""
    # Installed even where SIGINT came ignored (a background job of a script): `kill -INT` must stop a command.
    previous = {sig: signal.signal(sig, raise_stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    forget_stops()
    try:
        return command() or 0
    except MinGPTError as e:
        print(f"error: {redact(e)}", file=sys.stderr)  # a storage client may have echoed a URL with its credentials
        return 2
    except KeyboardInterrupt as e:
        print(interrupted, file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        forget_stops()


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A command's flags: its description, each flag's default in --help, and --version."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {mingpt.__version__}")
    return parser


def configure_logging(level: int, fmt: str = "%(levelname)s %(message)s", datefmt: str | None = None) -> None:
    """A command's logging to stderr, every record redacted (see storage.RedactingFilter)."""
    logging.basicConfig(level=level, format=fmt, datefmt=datefmt)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def summary(doc: str) -> str:
    """A command's --help description: the first line of its module docstring, after "`mingpt-x ARGS`: "."""
    text = doc.strip().splitlines()[0].split(": ", 1)[-1]
    return text[0].upper() + text[1:]

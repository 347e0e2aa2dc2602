"""The command-line tools. Each module parses its flags, calls the library, and turns the outcome
into an exit status with `run_command`: a mistake of the user's or of stored data (MinGPTError) is
one line on stderr and exit 2, Ctrl-C is exit 130, never a traceback."""

from __future__ import annotations

import sys
from typing import Callable

from mingpt.errors import MinGPTError
from mingpt.storage import redact


def run_command(command: Callable[[], int | None], interrupted: str = "interrupted") -> int:
    """`command()`'s exit status (None is 0); MinGPTError -> its message and 2; Ctrl-C -> `interrupted` and 130."""
    try:
        return command() or 0
    except MinGPTError as e:
        print(f"error: {redact(e)}", file=sys.stderr)  # no URL credentials, wherever the message came from
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


def summary(doc: str) -> str:
    """A command's --help description: the first line of its module docstring, after "`mingpt-x ARGS`: "."""
    text = doc.strip().splitlines()[0].split(": ", 1)[-1]
    return text[0].upper() + text[1:]

"""Errors the library raises for bad input. Each message says what is wrong and what to do about it; the command-line
entry points print the message alone, without a traceback."""

import contextlib
import signal
from typing import Iterator


class MinGPTError(Exception):
    """Base class for every error caused by user input or stored data."""


class ConfigError(MinGPTError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class DataError(MinGPTError, ValueError):
    """A corpus or a prepared data folder is missing, empty, too short or damaged."""


class TokenizerError(MinGPTError, ValueError):
    """A tokenizer cannot be built, loaded, or cannot encode the given text."""


class TrainingError(MinGPTError):
    """Training cannot go on as configured (for example, the loss became infinite or NaN)."""


def one_line(cause) -> str:
    """An error (or a text) in one line: its type and the first line of its message."""
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return str(cause)


class PeerLeft(Exception):
    """This process's generation ended because another process was asked to stop, or died: not this one's failure. It
    exits with `exit_code` (mingpt.jobenv), which mingpt-torchrun's agent restarts without using up --max-restarts."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the program is, so that its cleanups run (temporary files, worker processes, the
    run's lease) before it exits. A KeyboardInterrupt: code that handles Ctrl-C handles both."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Signals whose Stopped was raised: one raised in a callback whose exceptions are printed and dropped (logging's
# after-fork hook) is lost, so long loops call `check_stopped`, and code that forks defers to it (`deferred_stops`).
_received: list[int] = []
_deferred = False


def raise_stopped(signum: int, frame) -> None:
    """A signal handler: raise Stopped, and remember it (see `check_stopped`)."""
    _received.append(signum)
    if not _deferred:
        raise Stopped(signum)


@contextlib.contextmanager
def deferred_stops() -> Iterator[None]:
    """Within: a stop is only remembered, and raised by `check_stopped` on the way out. For code that forks,
    whose hooks would print a Stopped raised in them as a traceback, and drop it."""
    global _deferred
    _deferred = True
    try:
        yield
    finally:
        _deferred = False
    check_stopped()


def check_stopped() -> None:
    """Raise Stopped again for a signal whose first Stopped was swallowed where it was raised."""
    if _received:
        raise Stopped(_received[-1])


def forget_stops() -> None:
    """The stop was handled (the command ends, or a new one starts in this process)."""
    _received.clear()

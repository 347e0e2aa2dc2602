"""A request to stop (SIGTERM, which torchrun and SLURM send before they kill, or Ctrl-C), as the training
loop sees it: finish the step, snapshot, exit."""

from __future__ import annotations

import logging
import signal
from contextlib import contextmanager
from typing import Iterator

from mingpt.errors import raise_stopped

log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGTERM or Ctrl-C (a second Ctrl-C aborts at once); a flag only, which the step's agreement shares."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @contextmanager
    def at_once(self) -> Iterator[None]:
        """Within, SIGTERM and Ctrl-C stop at once: for a long wait before the first step, with no step to finish."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, raise_stopped)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("%s received: stopping after this step with a snapshot", signal.Signals(signum).name)

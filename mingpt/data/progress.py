"""Progress of long data work: a tqdm bar on a terminal, a log line every few seconds elsewhere
(a batch job's log file, where a bar would write a line per update)."""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta

log = logging.getLogger("mingpt")

LOG_EVERY_S = 5.0


class Progress:
    """Bytes done out of `total` (None: unknown), with MB/s and time left."""

    def __init__(self, what: str, total: int | None):
        self.what, self.total, self.done = what, total, 0
        self.started = self.logged = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1000, leave=False)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.logged >= LOG_EVERY_S:
            self.logged = time.monotonic()
            log.info("%s", self.line())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        text = f"{self.what}: {self.done / 1e6:.0f} MB"
        if self.total:
            left = max(self.total - self.done, 0) / rate if rate else 0
            text += f" of {self.total / 1e6:.0f} MB ({100 * self.done / self.total:.0f}%)"
            text += f", {rate / 1e6:.1f} MB/s, {timedelta(seconds=round(left))} left"
        else:
            text += f", {rate / 1e6:.1f} MB/s"
        return text

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

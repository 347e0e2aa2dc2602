"""Holding something among processes that may die, on machines whose clocks disagree: the one primitive
behind the run's lease (mingpt.checkpoint.lease) and the claim of prepared data (mingpt.data.remote).

- A claim is a small JSON record, created exclusively where every claimant reaches it (O_EXCL on a local
  disk, a conditional PUT on S3): of two claimants exactly one wins. Who holds it is `holder()`.
- Its holder keeps it alive by rewriting it at an interval: a `Beat`.
- A claimant judges a holder on another machine gone only once its record `stood_still` for the holder's
  timeout on the claimant's own monotonic clock: no two machines' clocks are ever compared.
- A holder on this machine (the same host and boot) is gone once none of its processes runs, known by
  pid and start time, so that a reused pid is never taken for it: `ended_here`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable


def holder(pids: list[int]) -> dict:
    """What a claim says of its holder: this machine (host, boot) and its processes (pid, start time)."""
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pids": [[pid, start_time(pid)] for pid in pids]}


def ended_here(record: dict) -> bool:
    """Whether the holder a claim names ran on this machine and none of its processes runs any more."""
    return same_machine(record) and not any(process_alive(*p) for p in processes_of(record))


def same_machine(record: dict) -> bool:
    return record.get("host") == socket.gethostname() and record.get("boot_id") == boot_id()


def processes_of(record: dict) -> list[tuple[int, int]]:
    """The (pid, start time) pairs a claim names; whatever else its "pids" holds is ignored."""
    found = []
    for entry in record.get("pids") if isinstance(record.get("pids"), list) else []:
        if isinstance(entry, list) and len(entry) == 2 and all(type(n) is int for n in entry):
            found.append((entry[0], entry[1]))
    return found


def pids(record: dict) -> str:
    """The pids a claim names, for a message ("" where it names none)."""
    return ", ".join(str(pid) for pid, _ in processes_of(record))


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int:
    """The start time of a process (clock ticks since boot), so that a reused pid is not taken for it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def process_alive(pid: int, start: int = 0) -> bool:
    """Whether process `pid` of this machine runs (and, given its start time, is still that process)."""
    if pid <= 0:
        return False  # kill(0) or kill(-n) would ask about process groups, not this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # exists, owned by someone else; or we cannot tell: assume alive
    return not start or start_time(pid) == start


def stood_still(state: Callable[[], object], timeout: float) -> bool:
    """Watch `state()` (a claim's bytes, say) for `timeout` seconds of this process's monotonic clock: True
    when it never changed (its holder is gone), False as soon as it changes (its holder is alive)."""
    seen = state()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(min(1.0, timeout / 8))
        if state() != seen:
            return False
    return True


class Beat:
    """Call `renew` every `interval` seconds in a background thread until `stop`, or until `renew` returns
    False (the claim is no longer this process's). `renew` handles its own errors."""

    def __init__(self, renew: Callable[[], bool | None], interval: float, name: str):
        self.renew, self.interval = renew, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.renew() is False:
                return

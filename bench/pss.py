"""Memory of a process tree as the summed PSS (/proc/PID/smaps_rollup): shared libraries and
copy-on-write pages count once, split among the processes that share them, unlike RSS."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def pss_bytes(pid: int) -> int:
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue  # exited meanwhile
    return total


def run_measured(args: list[str], interval_s: float = 0.05, **popen) -> tuple[int, float, int]:
    """Run `args`; return (exit status, wall seconds, peak summed PSS of its process tree in bytes)."""
    started = time.perf_counter()
    proc = subprocess.Popen(args, **popen)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, pss_bytes(proc.pid))
            stop.wait(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = proc.wait()
    stop.set()
    sampler.join()
    return rc, time.perf_counter() - started, peak

"""The hang watchdog of a node's agent: finds a worker that stopped making progress, logs its Python stack and ends
it, so that torchrun restarts the workers instead of every node waiting for trainer.dist_timeout_s.

A worker is hung when its last mark (mingpt.training.progress) is older than trainer.hang_timeout_s, or (auto)
HANG_STEPS median steps; a first step or a compile, than trainer.dist_timeout_s. The others wait for a hung worker, so
their marks age too: the one ended is the stopped one (SIGSTOP, a debugger), else the oldest once past 1.5 timeouts
(so a hang elsewhere is left to its agent). py-spy reads its stack, even stopped; else it writes it on SIGUSR1."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from mingpt.checkpoint.shm import process_folder
from mingpt.jobenv import Mark, read_mark

log = logging.getLogger(__name__)

HANG_STEPS = 20  # auto: a worker is hung after this many median steps without progress
HANG_FLOOR_S = 20.0  # ... and never sooner than this
MEASURED = 5  # step times needed before auto acts
SKIPPED = 3  # the first step times of a generation, left out (compile, warm-up, the first copies)
STACK_TIMEOUT_S = 15.0
JUDGED = ("computing", "evaluating", "compiling")  # the phases judged (mingpt.training.progress)


class Watchdog:
    """One agent's watch over its workers' progress."""

    def __init__(self):
        self.folder = process_folder("progress")  # this user's alone; removed by the next job if this agent is killed
        self.host = socket.gethostname()
        self._seen: dict[int, tuple[int, float]] = {}  # pid -> (step, when) of its last new step
        self._times: deque[float] = deque(maxlen=50)
        self._skipped = 0
        self.finding: str | None = None  # what the last hang was: for the restart's cause

    def new_generation(self) -> None:
        """The workers are (re)started: their progress files and step times start afresh."""
        for path in self.folder.iterdir():
            path.unlink(missing_ok=True)
        self._seen.clear()
        self._times.clear()
        self._skipped = 0

    def check(self, pids: list[int]) -> list[int]:
        """The workers among `pids` found hung (each named in the log with its stack, and ended)."""
        now = time.monotonic()
        marks = self.marks(pids)
        self._time_steps(marks)
        timeout = self.timeout(marks)
        stale = {}  # pid -> (mark, the time it was allowed)
        for pid, mark in marks.items():
            allowed = mark.warmup_timeout if mark.warming_up else timeout
            if mark.phase in JUDGED and allowed and now - mark.when > allowed:
                stale[pid] = (mark, allowed)
        if not stale:
            return []
        stopped = {pid for pid in stale if _state(pid) == "T"}
        hung = sorted(stopped)
        oldest = min(stale, key=lambda pid: stale[pid][0].when)
        if not hung and now - stale[oldest][0].when > 1.5 * stale[oldest][1]:
            hung = [oldest]
        for pid in hung:
            mark, allowed = stale[pid]
            how = "stopped" if pid in stopped else "no progress"
            which = "a first step or a compile, allowed trainer.dist_timeout_s" if mark.warming_up else "hang timeout"
            self.finding = (f"hung: {self.host} pid {pid} ({how}; at step {mark.step}, {mark.phase}, for "
                            f"{now - mark.when:.0f} s; {which} {allowed:.0f} s)")
            log.error("mingpt-torchrun: worker %s on %s made no progress for %.0f s (step %d, %s; %s); its stack, then "
                      "a restart of the workers:\n%s", pid, self.host, now - mark.when, mark.step, mark.phase, how,
                      stack(pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return hung

    def marks(self, pids: list[int]) -> dict[int, Mark]:
        """The last marks of these workers (of this generation): those that made one."""
        return {pid: mark for pid in pids if (mark := read_mark(self.folder / str(pid))) is not None}

    def timeout(self, marks: dict) -> float | None:
        """The hang timeout the workers asked for, or (auto) the one their step times give; None until known."""
        configured = max((mark.timeout for mark in marks.values()), default=0.0)
        if configured > 0:
            return configured
        if len(self._times) < MEASURED:
            return None
        return max(HANG_FLOOR_S, HANG_STEPS * statistics.median(self._times))

    def _time_steps(self, marks: dict) -> None:
        for pid, (step, _, when, *_) in marks.items():
            last = self._seen.get(pid)
            if last is None or step > last[0]:
                self._seen[pid] = (step, when)
                if last is not None and last[0] > 0:
                    if self._skipped < SKIPPED:
                        self._skipped += 1
                    else:
                        self._times.append((when - last[1]) / (step - last[0]))

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def stack(pid: int) -> str:
    """The Python stack of every thread of `pid`, as Python writes a traceback (outermost call first)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking", "--json"], capture_output=True,
                             text=True, timeout=STACK_TIMEOUT_S)
        threads = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        threads = None
    if not threads:  # py-spy missing or refused: the process writes its own, if it still runs
        try:
            os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
        except ProcessLookupError:
            pass
        return "  (py-spy could not read it; a running process wrote its stack to its own log on SIGUSR1)"
    lines = []
    for thread in threads:
        lines.append(f"Thread {thread.get('os_thread_id')} ({thread.get('thread_name') or 'unnamed'}), most recent "
                     "call last:")
        for frame in reversed(thread.get("frames") or []):
            lines.append(f'  File "{frame.get("filename")}", line {frame.get("line")}, in {frame.get("name")}')
    return "\n".join(lines)


def _state(pid: int) -> str:
    """The state letter of a process (R, S, D, T, ...); "" where it has ended."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""

"""This process's progress, for its agent's watchdog (mingpt.launch.watchdog): the step, the phase and when it entered
it, in a small file of the agent's private folder (MINGPT_PROGRESS_DIR), so that no hung collective can hide it. Any
compile is marked `compiling` while it lasts (allowed trainer.dist_timeout_s, as a first step). A folder that is not
this user's alone (mode 0700, not a link) is not used (others could plant a FIFO or a link in it): the process then
trains on unwatched, with one warning."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable

from mingpt import torch_internals
from mingpt.jobenv import PROGRESS_DIR, Mark
from mingpt.processes import PR_SET_PTRACER, prctl
from mingpt.storage import open_own_file, private_folder

log = logging.getLogger(__name__)


class Progress:
    """Marks of this process's progress, where an agent watches them."""
    def __init__(self, folder: str | None, hang_timeout_s: float, warmup_s: float):
        self.hang_timeout_s, self.warmup_s = hang_timeout_s, warmup_s
        self.fd = _open_mark_file(Path(folder)) if folder else None
        if self.fd is not None:
            let_the_agent_read_my_stack()
        self.step, self.phase, self.first = 0, "starting", -1
        self._before_compiling = "starting"
        self._unwatch: Callable[[], None] | None = None
        self.mark(0, "starting")

    def watch_compiles(self) -> None:
        """Called only where it compiles: the imports it needs are slow."""
        if self.fd is not None and self._unwatch is None:
            self._unwatch = torch_internals.watch_compiles(self._compiling, self._compiled)

    def _compiling(self) -> None:
        self._before_compiling = self.phase
        self.mark(self.step, "compiling")

    def _compiled(self) -> None:
        self.mark(self.step, self._before_compiling)

    def mark(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        if phase == "computing" and self.first < 0:
            self.first = step
        if self.fd is not None:
            os.pwrite(self.fd, Mark(step, phase, time.monotonic(), self.hang_timeout_s, self.first,
                                    self.warmup_s).pack(), 0)

    def close(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _open_mark_file(folder: Path) -> int | None:
    """None, with one warning, where the folder or the file is not this user's alone."""
    why = None if private_folder(folder) else "not a folder of this user's alone (mode 0700, not a link)"
    if why is None:
        try:
            return open_own_file(folder / str(os.getpid()), os.O_WRONLY | os.O_CREAT)
        except OSError as e:  # a link, a FIFO, another user's file, or no room
            why = f"cannot use a file of this user's in it ({e.strerror or e})"
    log.warning("%s=%s: %s; this process's progress is not reported, and its agent's watchdog cannot tell if it "
                "hangs", PROGRESS_DIR, folder, why)
    return None


def let_the_agent_read_my_stack() -> None:
    """Where Yama lets a process read only its descendants (ptrace_scope 1), allow the agent (and its py-spy); and
    write every thread's stack to stderr on SIGUSR1, where py-spy is missing."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    prctl(PR_SET_PTRACER, os.getppid())  # (not Linux: py-spy asks for what it needs there)

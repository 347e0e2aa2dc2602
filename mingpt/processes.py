"""What this process asks Linux about its kin (prctl): to die with its parent, its name in ps and top, who may
read its stack, adopting orphans. Where there is no prctl (not Linux), a request does nothing and says so."""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PTRACER = 0x59616D61


def prctl(option: int, arg: int | bytes) -> bool:
    """Ask prctl(option, arg); False where this system has no prctl."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def signal_when_parent_dies(sig: int, parent: int | None = None) -> bool:
    """Have the kernel send `sig` when the parent dies; False where it (`parent`, else the present one) already has."""
    parent = os.getppid() if parent is None else parent
    prctl(PR_SET_PDEATHSIG, sig)
    return os.getppid() == parent


def end_with_parent(sig: int) -> None:
    """Have this process sent `sig` when its parent dies; sent now where it has died already."""
    if not signal_when_parent_dies(sig):
        os.kill(os.getpid(), sig)

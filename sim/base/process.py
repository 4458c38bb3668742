"""Process hygiene shared by the simulator's worker pool and the torch backend's rank processes."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG), and exit now (status 1) if
    the parent ``parent_pid`` died before the request; elsewhere a no-op (the child then ends when it next talks
    to the parent, or, for a torch rank, when its peers' connections close). Call it first thing in a child."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)

"""Process hygiene shared by the simulator's worker pool and the torch backend's rank processes."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

__all__ = ["die_with_parent", "exit_on_signal", "raise_if_signalled"]

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


#: Signals :func:`exit_on_signal` has received in this process, in order.
_RECEIVED: list[int] = []


def exit_on_signal(signum, frame=None) -> None:
    """A signal handler (e.g. for SIGTERM): record ``signum`` and raise SystemExit(128 + signum), so the process
    unwinds (its ``finally`` blocks stop children and remove ``DIR.partial``) and exits with the shell's code.

    A Python handler runs between two bytecodes of the main thread, wherever they are: inside a finalizer
    (``__del__``, a weakref callback, a garbage-collector pass) its SystemExit is printed as "Exception ignored"
    and lost. Code that blocks for long therefore wakes up now and then and calls :func:`raise_if_signalled`."""
    _RECEIVED.append(int(signum))
    raise SystemExit(128 + int(signum))


def raise_if_signalled() -> None:
    """Raise SystemExit(128 + signum) again if :func:`exit_on_signal` has received a signal (its first raise may
    have been swallowed by a finalizer); nothing otherwise."""
    if _RECEIVED:
        raise SystemExit(128 + _RECEIVED[0])

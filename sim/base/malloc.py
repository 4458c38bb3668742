"""Keep freed numpy buffers in the process's heap (glibc), so that a fresh array reuses warm pages.

Every simulated step allocates a few fresh vectors of d per rank (the accumulator, the residual, the update):
at d = 10^7 in float32 that is 40 MB each, some 50 per iteration at P = 16. glibc serves such a request with
its own mmap and gives it back with munmap on free, so every fresh vector's pages are faulted in and zeroed by
the kernel again (about a third of the run's time was system time at d = 10^7 on the 2-core VM this project is
measured on). With mmap off for malloc and trimming raised, a freed vector stays in the heap and the next one
of its size takes the same, already mapped pages: the same bits, fewer page faults
(``benchmarks/bench_large_d.py``: 1.96 -> 1.26 s per Top-k iteration; README, "Numerics speed").

The setting is process-wide and lasts: the CLI applies it at start-up (:func:`experiments.cli.main`), the
benchmarks before they time anything. A library user may call :func:`keep_freed_memory` in their own process.
Cost: up to ``trim`` bytes of freed memory stay mapped (counted in the resident set) until the process exits.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4


@functools.cache
def keep_freed_memory(trim: int = 2**31 - 1, top_pad: int = 256 * 1024 * 1024) -> str:
    """Tell glibc's malloc to serve every request from the heap and to keep freed memory; return a one-line note.

    trim: bytes of free memory at the top of the heap kept before it is returned to the kernel (M_TRIM_THRESHOLD,
    default 2 GiB - 1). top_pad: extra bytes requested from the kernel on every heap growth (M_TOP_PAD, 256 MiB).
    Sets M_MMAP_MAX = 0 (no mmap for malloc; glibc still falls back to mmap if the heap cannot grow) and
    M_MMAP_THRESHOLD = 32 MiB. Returns "glibc mallopt: ..." or why nothing was done (not Linux/glibc, or
    mallopt refused); never raises. Applied once per process (cached).
    """
    name = ctypes.util.find_library("c")
    if platform.system() != "Linux" or not name:
        return "malloc tuning: not available (not glibc)"
    try:
        libc = ctypes.CDLL(name)
        ok = all(libc.mallopt(param, value) == 1 for param, value in (
            (_M_MMAP_THRESHOLD, 32 * 1024 * 1024), (_M_TRIM_THRESHOLD, int(trim)), (_M_TOP_PAD, int(top_pad)),
            (_M_MMAP_MAX, 0)))
    except (OSError, AttributeError):
        return "malloc tuning: not available (no mallopt)"
    if not ok:
        return "malloc tuning: mallopt refused"
    return (f"malloc tuning: glibc mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD={trim / 2**20:.0f}MiB, "
            f"M_TOP_PAD={top_pad / 2**20:.0f}MiB")

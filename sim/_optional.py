"""Optional compiled kernels: import a numba module of this package once, or report that numba is missing."""
from __future__ import annotations

import functools
import importlib


@functools.cache
def kernels(name: str):
    """The module ``sim.<name>`` (a numba kernel module such as ``_topk_numba``), imported once; None when it
    cannot be imported (numba is optional: every caller has a numpy path that gives the same bits, slower)."""
    try:
        return importlib.import_module(f"sim.{name}")
    except ImportError:
        return None

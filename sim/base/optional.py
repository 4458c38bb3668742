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


def torch_module(user: str):
    """The torch module, or ConfigError (one line) saying that ``user`` (e.g. "a [model] network") needs torch and
    which extra installs it (the CPU build torch==2.13.0). torch is optional: only networks, measured workloads, the
    torch backend and the DDP hooks need it."""
    try:
        import torch
    except ImportError:  # pragma: no cover - exercised only without torch
        from sim.base.errors import ConfigError

        raise ConfigError(f"{user} needs torch, which is not installed: pip install -e '.[torch]' (the CPU build "
                          "torch==2.13.0)") from None
    return torch

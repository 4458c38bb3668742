"""Optional compiled kernels: import a numba module once, or report that numba is missing."""
from __future__ import annotations

import functools
import importlib


@functools.cache
def kernels(module: str):
    """The numba kernel module ``module`` (its full name, e.g. ``"sim.comm._topk_numba"``, given by the package that
    owns it), imported once; None when numba is not installed (numba is optional: every caller has a numpy path
    that gives the same bits, slower). Any other ImportError is raised: a kernel module that moved or broke must
    not silently turn into the slow path."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if (err.name or "").split(".")[0] == "numba":
            return None
        raise


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

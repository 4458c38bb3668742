"""Compression kernels on torch tensors (any device), for the torch backend's ranks and the DDP hooks.

The numpy definitions are in :mod:`sim.comm.compression`; each kernel here returns what its numpy counterpart
returns, bit for bit (tests/test_topk_fast.py, tests/test_ddp_hooks_ops.py). torch is imported on call.
"""
from __future__ import annotations

import numpy as np

from sim.base.errors import NonFiniteError, SparsimError, check_range

__all__ = ["topk_torch"]


def topk_torch(x, k: int):
    """:func:`sim.comm.compression.topk` on a torch tensor, on its device (a GPU included): the same indices and values.

    x: 1-D float tensor (d,), no NaN. k: int, 1 <= k <= d. Returns (idx, val): int64 tensor of the selected
    coordinates, ascending, and x at them (x's dtype and device); at most k entries, exact zeros never
    selected, ties in magnitude to the lower index. ``torch.topk`` supplies only the k-th largest magnitude (its
    values are exact; which of several tied entries it picks is unspecified), the tie rule is applied after it.
    :func:`sim.comm.compression.selection_device` routes :func:`sim.comm.compression.topk` through it (the torch backend's
    ranks with ``torch.select_device``, the DDP hooks on GPU tensors). Raises SparsimError for k outside [1, d],
    NonFiniteError naming the first NaN coordinate.
    """
    import torch

    d = int(x.shape[0])
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise SparsimError(f"k = {k!r} must be an integer: valid 1 <= k <= d = {d}")
    k = int(check_range("k", int(k), 1, d))
    a = x.abs()
    nan = torch.isnan(a)
    if bool(nan.any()):
        i = int(nan.nonzero()[0, 0])
        raise NonFiniteError(f"top-k selection: coordinate {i} of the vector is {float(x[i])}: valid values are "
                             "not NaN (a NaN has no magnitude to rank)")
    v = torch.topk(a, k, sorted=False).values.min()
    if bool(v == 0):  # fewer than k non-zeros: all of them
        idx = a.nonzero().flatten()
    else:
        above = (a > v).nonzero().flatten()
        ties = (a == v).nonzero().flatten()[: k - above.numel()]
        idx = torch.cat([above, ties]).sort().values
    return idx, x[idx]

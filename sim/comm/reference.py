"""Straightforward reference definitions of the sparse operators, as they were before the fast versions (#12).

They are the executable specification the fast operators are tested against bit for bit
(``tests/test_merge_fast.py``) and the "before" of their benchmark (``benchmarks/bench_merge.py``); nothing
else uses them. Shapes and dtypes as :mod:`sim.comm.compression`.
"""
from __future__ import annotations

import numpy as np

from sim.comm.compression import Sparse, topk_select_indices
from sim.base.errors import SparsimError

__all__ = ["ref_merge", "ref_survive", "ref_sum"]


def ref_merge(a: Sparse, b: Sparse, k: int) -> Sparse:
    """The gTop-k merge by set union and partition: values added on the union of the supports (a's, then b's),
    the top k of the sum kept (ties to the lower index), exact zeros dropped. k already checked.
    Raises SparsimError if the dimensions differ."""
    if a.d != b.d:
        raise SparsimError("dimensions must match")
    idx = np.union1d(a.idx, b.idx)
    val = np.zeros(idx.shape[0], dtype=np.result_type(a.val.dtype, b.val.dtype))
    val[np.searchsorted(idx, a.idx)] += a.val
    val[np.searchsorted(idx, b.idx)] += b.val
    if idx.shape[0] > k:
        keep = topk_select_indices(np.abs(val), k)
        idx, val = idx[keep], val[keep]
    nz = val != 0
    return Sparse(idx[nz], val[nz], a.d)


def ref_survive(tracker, support) -> None:
    """The gTop-k survival update of ``sim.comm.collectives._Tracker.survive``: every tracked source keeps alive only
    its indices that are in ``support`` (int64 array, sorted)."""
    for _, idx, alive in tracker.sources:
        alive &= np.isin(idx, support, assume_unique=True)


def ref_sum(blocks, d: int, dtype) -> np.ndarray:
    """The dense sum of the allgathered selections, rank by rank: float array (d,) of ``dtype``."""
    g = np.zeros(d, dtype=dtype)
    for b in blocks:
        g[b.idx] += b.val
    return g

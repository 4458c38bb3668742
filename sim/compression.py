"""Compression operators: TopK, RandK, the gTop-k merge operator, and error-feedback memory.

All operators are pure and deterministic. Ties in magnitude are broken by the LOWER index
(docs/theory.md section 1), so every worker and every backend selects the same set. Entries whose value
is exactly zero carry no mass and are never transmitted: a selection holds at most k entries.

Sources: Shi et al., "A Convergence Analysis of Distributed SGD with Communication-Efficient
Gradient Sparsification", IJCAI 2019 (TopK, merge operator, gTopK, Algorithm 1); Stich et al.,
"Sparsified SGD with Memory", NeurIPS 2018 (Def. 2.1 k-contraction, RandK, memory).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import SparsimError, check_range

__all__ = [
    "Sparse",
    "topk",
    "randk",
    "merge",
    "densify",
    "topk_select_indices",
]


@dataclass(frozen=True)
class Sparse:
    """A sparse vector of dimension ``d``.

    ``idx``: int64 array (m,), strictly increasing coordinates in [0, d).
    ``val``: float array (m,), the values at those coordinates (never exactly 0 for a selection).
    On the wire it costs ``m * (value_bytes + index_bytes)`` bytes (:meth:`nbytes`).
    """

    idx: np.ndarray
    val: np.ndarray
    d: int

    def __len__(self) -> int:
        return int(self.idx.shape[0])

    def nbytes(self, value_bytes: int = 4, index_bytes: int = 4) -> int:
        """Bytes on the wire: ``len(self) * (value_bytes + index_bytes)``."""
        return len(self) * (int(value_bytes) + int(index_bytes))

    def to_dense(self) -> np.ndarray:
        """Dense float array of shape (d,) with zeros off the support."""
        return densify(self)


def densify(s: Sparse) -> np.ndarray:
    """Dense copy of a :class:`Sparse`: float array (d,) with ``out[s.idx] = s.val``."""
    out = np.zeros(s.d, dtype=s.val.dtype if len(s) else np.float64)
    out[s.idx] = s.val
    return out


def _check_k(k, d: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise SparsimError(f"k = {k!r} must be an integer: valid 1 <= k <= d = {d}")
    check_range("k", int(k), 1, d)
    return int(k)


def topk_select_indices(absx: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of ``absx`` (float array (n,), all >= 0), ties to the lower index.

    Returns an int64 array (k,) sorted ascending. O(n) via ``np.partition`` plus an exact tie rule:
    every entry strictly above the k-th largest value is taken, then the lowest-index entries equal
    to it fill the remaining slots.
    """
    n = absx.shape[0]
    if k >= n:
        return np.arange(n, dtype=np.int64)
    thr = np.partition(absx, n - k)[n - k]
    above = np.flatnonzero(absx > thr)
    need = k - above.shape[0]
    ties = np.flatnonzero(absx == thr)[:need]
    out = np.concatenate([above, ties]).astype(np.int64, copy=False)
    out.sort()
    return out


def topk(x: np.ndarray, k: int) -> Sparse:
    """TopK(x): the k entries of largest |x_i| (ties: lower index wins), exact zeros dropped.

    x: float array (d,), finite. k: int, 1 <= k <= d. Returns a :class:`Sparse` with at most k entries.
    TopK is a k-contraction for every x: ||x - TopK(x)||^2 <= (1 - k/d) ||x||^2 (Stich et al. 2018, Def. 2.1).
    Raises SparsimError for k outside [1, d].
    """
    x = np.asarray(x)
    d = x.shape[0]
    k = _check_k(k, d)
    if np.count_nonzero(x) < d:
        # zeros are never selected: choose among the non-zeros only (np.partition is very slow on the
        # long runs of tied zeros that sparse gradients have). Same result, ties still to the lower index.
        nzi = np.flatnonzero(x)
        sel = nzi if nzi.shape[0] <= k else nzi[topk_select_indices(np.abs(x[nzi]), k)]
        return Sparse(sel.astype(np.int64, copy=False), x[sel], d)
    sel = topk_select_indices(np.abs(x), k)
    return Sparse(sel, x[sel], d)


def randk(x: np.ndarray, k: int, rng: np.random.Generator) -> Sparse:
    """RandK(x): k coordinates drawn uniformly WITHOUT replacement (exact zeros dropped).

    x: float array (d,). rng: a seeded numpy Generator (the draw is reproducible for a given seed).
    E||x - RandK(x)||^2 = (1 - k/d)||x||^2 (Stich et al. 2018, Lemma A.1). Raises SparsimError for bad k.
    """
    x = np.asarray(x)
    d = x.shape[0]
    k = _check_k(k, d)
    sel = np.sort(rng.choice(d, size=k, replace=False)).astype(np.int64)
    vals = x[sel]
    nz = vals != 0
    return Sparse(sel[nz], vals[nz], d)


def merge(a: Sparse, b: Sparse, k: int) -> Sparse:
    """The gTop-k merge operator a T b = TopK(a + b) for two (at most) k-sparse vectors.

    Sums the two sparse vectors on the union of their supports (up to 2k entries) and keeps exactly
    the k largest magnitudes (ties: lower index), dropping exact zeros (e.g. cancellations).
    Commutative bit-for-bit (IEEE addition is commutative); NOT associative, so the reduction
    tree's shape matters (docs/theory.md section 1; Shi et al. 2019, Eq. (5)). Raises SparsimError if
    the dimensions differ or k is out of range.
    """
    if a.d != b.d:
        raise SparsimError(f"merge of vectors of dimension {a.d} and {b.d}: dimensions must match")
    k = _check_k(k, a.d)
    idx = np.union1d(a.idx, b.idx)
    val = np.zeros(idx.shape[0], dtype=np.result_type(a.val.dtype, b.val.dtype))
    val[np.searchsorted(idx, a.idx)] += a.val
    val[np.searchsorted(idx, b.idx)] += b.val
    if idx.shape[0] > k:
        keep = topk_select_indices(np.abs(val), k)
        idx, val = idx[keep], val[keep]
    nz = val != 0
    return Sparse(idx[nz], val[nz], a.d)

"""Compression operators: TopK, RandK, the gTop-k merge operator, and error-feedback memory.

All operators are pure and deterministic. Ties in magnitude are broken by the LOWER index
(docs/theory.md section 1), so every worker and every backend selects the same set. Entries whose value
is exactly zero carry no mass and are never transmitted: a selection holds at most k entries.

Sources: Shi et al., "A Convergence Analysis of Distributed SGD with Communication-Efficient
Gradient Sparsification", IJCAI 2019 (TopK, merge operator, gTopK, Algorithm 1); Stich et al.,
"Sparsified SGD with Memory", NeurIPS 2018 (Def. 2.1 k-contraction, RandK, memory).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from sim.base.optional import kernels
from sim.base.errors import NonFiniteError, SparsimError, check_range

__all__ = [
    "Sparse",
    "topk",
    "randk",
    "merge",
    "densify",
    "topk_select_indices",
    "selection_device",
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
        """Dense float array of shape (d,) of the dtype of ``val``, zeros off the support; READ-ONLY and built once
        per Sparse: every later call returns the same array (:func:`densify` makes a fresh, writable copy).

        The simulated ranks of a gTop-k tree all receive the same result object, so its dense form is built
        once for all of them instead of once per rank (at d = 10^7, P = 16: 15 zero-filled 40 MB vectors and
        scatters fewer per iteration), with the same bits; read-only, so that no rank can change what the
        others read (an in-place write raises ValueError)."""
        got = self.__dict__.get("_dense")
        if got is None:
            got = densify(self)
            got.flags.writeable = False
            object.__setattr__(self, "_dense", got)  # a cache, not a field: equality and repr ignore it
        return got

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_dense", None)  # a copy of the fields' content: not pickled
        return state


def densify(s: Sparse) -> np.ndarray:
    """Dense copy of a :class:`Sparse`: array (d,) of the dtype of ``s.val`` (empty or not: an empty float32
    selection densifies to float32 zeros) with ``out[s.idx] = s.val``."""
    out = np.zeros(s.d, dtype=s.val.dtype)
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

    x: float array (d,), no NaN (+-inf ranks above every finite value). k: int, 1 <= k <= d. Returns a
    :class:`Sparse` with at most k entries, indices ascending. TopK is a k-contraction for every x:
    ||x - TopK(x)||^2 <= (1 - k/d) ||x||^2 (Stich et al. 2018, Def. 2.1).
    Raises SparsimError for k outside [1, d], NonFiniteError naming the first coordinate that is NaN.

    Speed (float32 / float64): a threshold estimated from a sample of |x|, one filtering pass that keeps the
    entries at or above it (a bounded, self-correcting candidate buffer; a NaN check on the way), and an exact
    selection among the candidates; with numba installed the pass is one compiled loop at about half the time
    of ``x.copy()`` (README, "Top-k selection speed"). The result never depends on the estimate: a poor one
    costs a second pass or a few buffer cuts, never a different selection (tests/test_topk_fast.py).
    """
    x = np.asarray(x)
    d = x.shape[0]
    k = _check_k(k, d)
    if _SELECT_DEVICE is not None and d >= _DEVICE_MIN_D and x.ndim == 1 and x.dtype in (np.float32, np.float64):
        return _topk_on_device(x, k, _SELECT_DEVICE)
    return _topk_fast(x, k)


#: The torch device :func:`topk` selects on (None: here, numba or numpy); set with :func:`selection_device`.
_SELECT_DEVICE = None
#: Below this d a device selection is not worth its two transfers and kernel launches: :func:`topk` stays here.
_DEVICE_MIN_D = 1 << 15


@contextlib.contextmanager
def selection_device(device):
    """Context manager: inside it, :func:`topk` on vectors of d >= 2^15 entries makes its selection with torch on
    ``device`` (a torch device or its name, e.g. "cuda:0"; None: in numpy/numba as usual), then restores the
    previous setting.

    The selection is the same bit for bit: the vector is copied to the device, ``sim.comm.torch_kernels.topk_torch``
    finds the indices there (the k largest magnitudes, ties to the lower index, exact zeros never selected,
    ascending), they come back as int64 and the values are read from the host vector. What it costs: one copy
    of x to the device (d * itemsize bytes) and of at most k indices back. The torch backend's ranks use it with
    their GPU (scenario key ``torch.select_device``, :func:`sim.distributed.backend.run_worker`). Not thread-safe (a
    module-level setting). Raises ImportError (torch missing) or torch's error for an unknown device when a
    selection is made.
    """
    global _SELECT_DEVICE
    before = _SELECT_DEVICE
    _SELECT_DEVICE = device
    try:
        yield
    finally:
        _SELECT_DEVICE = before


def _topk_on_device(x: np.ndarray, k: int, device) -> Sparse:
    """:func:`topk` (valid k, float32/float64 x of shape (d,)) with the selection made by torch on ``device``."""
    import torch

    from sim.comm.torch_kernels import topk_torch

    xt = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    idx, _ = topk_torch(xt, k)
    idx = idx.cpu().numpy().astype(np.int64, copy=False)
    return Sparse(idx, x[idx], x.shape[0])


#: Sampled threshold: the sample has about ``_HITS`` entries above the threshold, so the count above it is known
#: to about 1/sqrt(_HITS) = 1/8; it aims at a candidate set of ``_MARGIN * k`` entries (6 standard deviations
#: above k: a second pass is very rare), and at least a fraction ``_FLOOR_C * sqrt(_HITS / d)`` of d (for small k:
#: balances the sample's random reads against the candidates' cost). A larger sample with a smaller margin was
#: slower at d = 1e6: the sample's random reads and partition cost more than the candidates they save.
_HITS = 64
_MARGIN = 1.75
_FLOOR_C = 0.5
#: Below this d the numpy path is used (microseconds either way): no numba import or compilation for small runs.
_NUMBA_MIN_D = 1 << 15


def _kernels():
    return kernels("sim.comm._topk_numba")


def _nan_error(x: np.ndarray, i: int | None = None) -> NonFiniteError:
    if i is None:
        i = int(np.flatnonzero(np.isnan(x))[0])
    return NonFiniteError(f"top-k selection: coordinate {i} of the vector is {x[i]}: valid values are not NaN "
                          "(a NaN has no magnitude to rank)")


def _plan(d: int, k: int, sample: int | None, frac: float | None) -> tuple[int, float]:
    """(m, p): sample size (0: no sample, threshold at the smallest positive magnitude) and the fraction p of d
    the threshold aims to keep."""
    p = frac if frac is not None else min(1.0, max(_MARGIN * k / d, _FLOOR_C * math.sqrt(_HITS / d)))
    if sample is not None:
        return min(int(sample), d), float(p)
    m = math.ceil(_HITS / p)
    return (0 if m * 4 > d else m), float(p)


def _topk_fast(x: np.ndarray, k: int, *, sample: int | None = None, frac: float | None = None,
               cap: int | None = None, use_numba: bool | None = None) -> Sparse:
    """:func:`topk` for a valid k. The keywords exist for the tests (tests/test_topk_fast.py) to force the
    paths that random inputs rarely take: ``sample`` (entries sampled; 0: none), ``frac`` (fraction of d the
    threshold aims to keep), ``cap`` (candidate buffer size, > k), ``use_numba`` (False: the numpy path; True:
    numba whatever d, if installed; None: numba from d = ``_NUMBA_MIN_D`` on)."""
    d = x.shape[0]
    if x.ndim != 1 or x.dtype not in (np.float32, np.float64):
        return _topk_partition(x, k)
    x = np.ascontiguousarray(x)
    K = _kernels() if use_numba or (use_numba is None and d >= _NUMBA_MIN_D) else None
    tiny = x.dtype.type(np.finfo(x.dtype).smallest_subnormal)
    m, p = _plan(d, k, sample, frac)
    t0 = tiny
    if m > 0:
        if K is not None:
            s, has_nan = K.sample_abs(x, m)
        else:
            s = np.abs(x[np.arange(m) * (d // m) + (np.arange(1, m + 1) * 2654435761) % (d // m)])
            has_nan = bool(np.isnan(s).any())
        if has_nan:
            raise _nan_error(x)
        r = min(m, max(1, math.ceil(p * m)))
        t0 = max(np.partition(s, m - r)[m - r], tiny)
    if K is None:
        return _topk_numpy(x, k, t0, tiny)
    c = min(d, max(2 * k, int(1.5 * p * d), 1024) if cap is None else max(int(cap), k + 1))
    n, idx, val = _scan(K, x, k, t0, c)
    if n < k and t0 > tiny:  # the threshold was too high: every non-zero is a candidate (the buffer stays bounded)
        n, idx, val = _scan(K, x, k, tiny, c)
    if n <= k:
        return Sparse(idx[:n].copy(), val[:n].copy(), d)
    sel, vals = K.select(idx, val, n, k, np.partition(np.abs(val[:n]), n - k)[n - k])
    return Sparse(sel, vals, d)


def _scan(K, x: np.ndarray, k: int, t0, cap: int):
    """Run :func:`sim.comm._topk_numba.scan` over x from threshold t0 with a buffer of ``cap`` (> k, or d) entries,
    cutting the buffer to its top k whenever it fills (doubling it then, up to 2^22 entries, so that inputs
    whose candidates keep coming, such as ascending ones, need few cuts). Returns (n, idx, val): the buffer
    (idx int64, val x at idx) and its size. Raises NonFiniteError at the first NaN."""
    d = x.shape[0]
    idx = np.empty(cap, np.int64)
    val = np.empty(cap, x.dtype)
    n, pos, t, v, strict = 0, 0, t0, t0, False
    while True:
        n, pos, nan = K.scan(x, pos, t, v, strict, idx, val, n)
        if nan:
            raise _nan_error(x, int(pos))
        if pos >= d:
            return n, idx, val
        v = np.partition(np.abs(val[:n]), n - k)[n - k]
        n = K.cut(idx, val, n, k, v)
        strict = True
        with np.errstate(over="ignore"):  # v the largest finite value: t = inf, only infinities can still enter
            t = np.nextafter(v, x.dtype.type(np.inf)) if v < np.inf else v
        if cap < min(d, 1 << 22):
            cap = min(d, 2 * cap)
            idx = np.concatenate([idx[:n], np.empty(cap - n, np.int64)])
            val = np.concatenate([val[:n], np.empty(cap - n, x.dtype)])


def _topk_numpy(x: np.ndarray, k: int, t0, tiny) -> Sparse:
    """The numpy path of :func:`_topk_fast` (numba missing): candidates |x_i| >= t0, exact selection among them."""
    ax = np.abs(x)
    if np.isnan(ax.max()):
        raise _nan_error(x)
    cand = np.flatnonzero(ax >= t0)
    if cand.shape[0] < k and t0 > tiny:
        cand = np.flatnonzero(ax)
    sel = cand if cand.shape[0] <= k else cand[topk_select_indices(ax[cand], k)]
    sel = sel.astype(np.int64, copy=False)
    return Sparse(sel, x[sel], x.shape[0])


def _topk_partition(x: np.ndarray, k: int) -> Sparse:
    """The plain O(d) selection (np.partition over |x|; the only path before the threshold filter): kept for
    dtypes other than float32/float64 and as the benchmark's reference. Same result as :func:`topk`."""
    d = x.shape[0]
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

    Values: where both have an entry the sum is ``(0 + a_i) + b_i``, elsewhere ``0 + a_i`` or ``0 + b_i``, in
    ``np.result_type`` of the two value dtypes (the accumulation into a zero vector this operator was first
    written as; tests/test_merge_fast.py keeps that version as the reference and checks the bits).
    Cost O(m log m) in numpy with m = len(a) + len(b): one stable sort of the concatenated indices (a merge
    of two sorted runs), a compare of neighbours and one np.partition for the k-th magnitude.
    """
    if a.d != b.d:
        raise SparsimError(f"merge of vectors of dimension {a.d} and {b.d}: dimensions must match")
    k = _check_k(k, a.d)
    idx, val = _sum_on_union(a, b)
    keep = topk_positions(val, k)
    return Sparse(idx[keep], val[keep], a.d)


def _sum_on_union(a: Sparse, b: Sparse) -> tuple[np.ndarray, np.ndarray]:
    """(idx, val): the union of the supports of a and b, ascending, and a + b on it (see :func:`merge`)."""
    return sum_on_union(a.idx, a.val, b.idx, b.val)


def sum_on_union(ia: np.ndarray, va: np.ndarray, ib: np.ndarray, vb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(idx, val): the union of two supports ``ia``, ``ib`` (int arrays, each ascending without repeats) and the
    sum of the two sparse vectors on it: ``(0 + a_i) + b_i`` where both hold i, ``0 + a_i`` / ``0 + b_i``
    elsewhere, in ``np.result_type`` of the value dtypes (:func:`merge`'s values). idx ascending; exact zeros
    (cancellations) are kept. The same function for :func:`merge` and the DDP hook's all-units merge.

    A stable argsort of the concatenated indices puts each coordinate that both hold as two neighbours, a's
    entry first; their values are added there and the second of the pair is dropped."""
    rt = np.result_type(va.dtype, vb.dtype)
    cat = np.concatenate((ia, ib))
    order = np.argsort(cat, kind="stable")
    idx = cat[order]
    val = np.concatenate((va, vb), dtype=rt)[order]
    val += rt.type(0)  # 0 + x: the exact values the zero vector accumulated (only -0.0 changes, to +0.0)
    pair = np.flatnonzero(idx[1:] == idx[:-1])
    if pair.shape[0]:
        val[pair] = val[pair] + val[pair + 1]  # (0 + a_i) + b_i
        first = np.ones(idx.shape[0], dtype=bool)
        first[pair + 1] = False
        keep = np.flatnonzero(first)
        idx, val = idx[keep], val[keep]
    return idx, val


def topk_positions(val: np.ndarray, k: int) -> np.ndarray:
    """Ascending positions of the k largest |val| (ties to the lower position, as :func:`topk_select_indices`)
    that are not exactly zero: int64 array of at most k entries."""
    n = val.shape[0]
    keep = val != 0
    if n > k:
        absx = np.abs(val)
        thr = np.partition(absx, n - k)[n - k]
        top = absx > thr
        need = k - int(np.count_nonzero(top))
        top[np.flatnonzero(absx == thr)[:need]] = True
        keep &= top
    return np.flatnonzero(keep)

"""Numba kernel of the dense sum of sparse selections (:func:`sim.comm.collectives.sparse_sum`); imported lazily,
only when numba is installed.

:func:`sum_into` adds P sparse vectors (rank order) into a dense vector, walking the coordinates in chunks that
fit the L2 cache and, inside each chunk, the vectors in rank order: every coordinate still receives its terms
in rank order, one IEEE addition each (``g[i] = g[i] + v``, no fused or reordered arithmetic: numba compiles
without fastmath), so the result is the bits of ``for b in blocks: g[b.idx] += b.val``. Only the order in
which *different* coordinates are visited changes, which keeps the dense vector's chunk in cache instead of
sweeping all of it once per vector.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def sum_into(g, idxs, vals, chunk):
    """g[idxs[r][j]] += vals[r][j] for r = 0..P-1 in order, j ascending; idxs[r] must be strictly increasing
    in [0, len(g)). Returns True, or False (g partly summed) as soon as an index breaks that rule, so that the
    caller can redo the sum the plain way (which raises or sums as before)."""
    P = len(idxs)
    d = g.shape[0]
    cur = np.zeros(P, np.int64)
    lo = 0
    while lo < d:
        hi = min(d, lo + chunk)
        for r in range(P):
            ix = idxs[r]
            vv = vals[r]
            n = ix.shape[0]
            j = cur[r]
            while j < n:
                i = ix[j]
                if i >= hi:
                    break
                if (i < 0) if j == 0 else (i <= ix[j - 1]):
                    return False
                g[i] = g[i] + vv[j]
                j += 1
            cur[r] = j
        lo = hi
    for r in range(P):
        if cur[r] != idxs[r].shape[0]:  # an index >= d
            return False
    return True


@njit(cache=True, nogil=True)
def sum_into_by_rank(g, idxs, vals):
    """:func:`sum_into` without the chunks: vector r = 0..P-1 in turn, each one pass in index order (the bits of
    ``for b in blocks: g[b.idx] += b.val``, the same as :func:`sum_into`'s). Faster below about a thousand
    vectors when g lies in 4 KiB pages (the heap the CLI keeps, ``sim.base.malloc``): the chunked walk keeps 2P
    streams of indices and values open at once. Same index rule and return value as :func:`sum_into`."""
    d = g.shape[0]
    for r in range(len(idxs)):
        ix = idxs[r]
        vv = vals[r]
        prev = -1
        for j in range(ix.shape[0]):
            i = ix[j]
            if i <= prev or i >= d:
                return False
            g[i] = g[i] + vv[j]
            prev = i
    return True

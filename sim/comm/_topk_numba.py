"""Numba kernels of the exact top-k (:func:`sim.comm.compression.topk`); imported lazily, only when numba is installed.

:func:`scan` builds, per block of 64 entries, a 64-bit mask of the entries with |x_i| >= t (a vectorised
compare; NaN sets its bit too, since ``not (nan < t)``), then visits only the set bits (count trailing zeros):
each is a candidate, appended (index and value) in index order to a buffer. ``t`` comes from a sample (the caller's estimate of a
magnitude that a few times k entries reach). The buffer is bounded: when it fills, the scan returns, the caller
cuts it to its exact top k (:func:`cut`; ties to the lower index: the buffer is in index order) and resumes with
``strict``: only entries strictly above the k-th value can still enter, since an entry equal to it loses to the
k earlier ones. So the buffer ends holding the exact top k of the entries >= t whatever the input; the caller
checks that it found at least k. The k-th value itself is found by numpy's np.partition (C introselect; about
6x faster than numba's).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_ONE = np.uint64(1)
_ZERO = np.uint64(0)


@intrinsic
def _cttz(typingctx, v):
    """Count trailing zeros of a non-zero uint64 (llvm.cttz; one tzcnt instruction)."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.uint64(types.uint64), codegen


@njit(cache=True, nogil=True)
def cut(idx, val, n, k, v):
    """Cut the buffer to its top k: keep, in order, the entries of magnitude above v (the k-th largest of
    |val[:n]|) and then the first ones of magnitude v, k in all. Returns k."""
    above = 0
    for i in range(n):
        if abs(val[i]) > v:
            above += 1
    ties = k - above
    m = 0
    for i in range(n):
        a = abs(val[i])
        if a > v or (a == v and ties > 0):
            if a == v:
                ties -= 1
            idx[m] = idx[i]
            val[m] = val[i]
            m += 1
    return m


@njit(cache=True, nogil=True)
def scan(x, start, t, v, strict, idx, val, n):
    """Append to the buffer (idx: int64, val: x_i, n entries so far) the candidates among
    x[start:]: entries with |x_i| >= t, and, if ``strict``, |x_i| > v. Stops when the buffer is full.

    Returns (n, pos, nan): the buffer's new size and the position to resume from (len(x) when done), or, when
    ``nan``, pos is the first coordinate from ``start`` on whose value is NaN.
    """
    d = x.shape[0]
    cap = idx.shape[0]
    nb = (d - start) >> 6
    for b in range(nb):
        base = start + b * 64
        xb = x[base:base + 64]
        m = _ZERO
        for j in range(64):
            m |= np.uint64(not (abs(xb[j]) < t)) << np.uint64(j)
        while m != _ZERO:
            j = np.int64(_cttz(m))
            m &= m - _ONE
            a = abs(xb[j])
            if a != a:
                return n, base + j, True
            if strict and a <= v:
                continue
            idx[n] = base + j
            val[n] = xb[j]
            n += 1
            if n == cap:
                return n, base + j + 1, False
    for i in range(start + nb * 64, d):
        a = abs(x[i])
        if a < t:
            continue
        if a != a:
            return n, i, True
        if strict and a <= v:
            continue
        idx[n] = i
        val[n] = x[i]
        n += 1
        if n == cap:
            return n, i + 1, False
    return n, d, False


@njit(cache=True, nogil=True)
def select(idx, val, n, k, v):
    """The top k of the n > k candidates in the buffer, v the k-th largest of |val[:n]| (ties to the lower index:
    the buffer is in index order). Returns (indices int64 ascending, values), k each. Branch-free: about half
    of the candidates are kept, in no predictable pattern."""
    above = 0
    for i in range(n):
        above += abs(val[i]) > v
    ties = k - above
    out = np.empty(k + 1, np.int64)
    outv = np.empty(k + 1, val.dtype)
    m = 0
    for i in range(n):
        a = abs(val[i])
        eq = a == v
        take = (a > v) | (eq & (ties > 0))
        ties -= eq & take
        out[m] = idx[i]
        outv[m] = val[i]
        m += take
    return out[:k], outv[:k]


@njit(cache=True, nogil=True)
def sample_abs(x, m):
    """|x| at m positions spread over x: one per stratum of len(x) // m entries, at a hashed offset inside it
    (deterministic). Returns (sample, has_nan)."""
    d = x.shape[0]
    s = d // m
    out = np.empty(m, x.dtype)
    nan = False
    h = np.uint64(0x9E3779B97F4A7C15)
    for j in range(m):
        z = np.uint64(j + 1) * h
        z ^= z >> np.uint64(31)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(29)
        a = abs(x[j * s + np.int64(z % np.uint64(s))])
        if a != a:
            nan = True
        out[j] = a
    return out, nan

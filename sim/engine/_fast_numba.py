"""Numba kernels of the fast engine (:mod:`sim.engine.fastsim`); imported lazily through
:func:`sim.base.optional.kernels`, None without numba (the engine then takes its numpy path, the same bits).

Both evaluate runs of *rotation* rounds (rank r sends to (r + c) % P and receives from (r - c) % P) on a fabric with
no shared link, where a message costs its class's latency sum plus n times its class's 1 / slowest bandwidth
(:meth:`sim.engine.fastsim.FastCluster._class_table`). They do, element by element and in the same order, the float
operations of :meth:`FastCluster.exchange` and :meth:`FastCluster.compute` (rendezvous ``max``, ``start + cost``, the
receive ``max``, ``ready + seconds``), so their results are the numpy path's bits; only the Python overhead of a
round (tens of microseconds, P - 1 or 2(P - 1) times per collective) is gone.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _arrive(out, a, b, lat, sz, inv):
    """out[r] = max(a[r], b[r]) + (lat[r] + sz[r] * inv[r]) for r < len(out): a rotation's rendezvous and transfer
    (float64 1-D views of equal length, contiguous, so that the loop has no index arithmetic and vectorises)."""
    for r in range(out.shape[0]):
        x = a[r]
        y = b[r]
        out[r] = (x if x >= y else y) + (lat[r] + sz[r] * inv[r])


@njit(cache=True, nogil=True)
def _receive_reduce(out, busy, a, b, w, coeff):
    """out[r] = max(a[r], b[r]) + coeff * w[r], busy[r] += coeff * w[r]: the receive then the reduce of w[r]
    elements at coeff s each (float64 1-D contiguous views of equal length)."""
    for r in range(out.shape[0]):
        x = a[r]
        y = b[r]
        s = coeff * w[r]
        out[r] = (x if x >= y else y) + s
        busy[r] = busy[r] + s


@njit(cache=True, nogil=True)
def _receive(out, a, b):
    """out[r] = max(a[r], b[r]): the receive (float64 1-D contiguous views of equal length)."""
    for r in range(out.shape[0]):
        x = a[r]
        y = b[r]
        out[r] = x if x >= y else y


@njit(cache=True, nogil=True)
def ring_run(ready, c, lat, inv, sizes, offsets, coeff, works, work_offsets, busy_row):
    """A ring's rounds on ``ready`` (float64 (P,), s, updated in place): round i is the rotation by c (1 <= c < P)
    where rank r's message of ``sizes[offsets[i] + r]`` bytes costs ``lat[r] + sizes[offsets[i] + r] * inv[r]`` s
    (lat, inv: float64 (P,), the latency sum in s and 1 / slowest bandwidth in s/byte of r's path; sizes: float64,
    the ring's read-only size table, :func:`sim.comm.rounds.shifted_ring_rounds`, its integers converted as numpy
    converts them in ``n * inv``); then, if ``work_offsets[i] >= 0``, every rank reduces ``works[work_offsets[i] + r]``
    elements (float64) at ``coeff`` s each, the seconds added to ``ready`` and to ``busy_row`` (float64 (P,), in
    place). offsets / work_offsets: int64 (rounds,). Each rotation is split in two ranges without index wrap-around
    and each range is handed to a loop over contiguous views (no index arithmetic, hence no gathers: 2.2x over
    indexing ``sizes[off + r]`` in place, the same bits). Source: the rules of
    :meth:`sim.engine.fastsim.FastCluster.exchange`."""
    P = ready.shape[0]
    arrive = np.empty(P)
    m = P - c
    for i in range(offsets.shape[0]):
        off = offsets[i]
        sz = sizes[off:off + P]
        _arrive(arrive[:m], ready[:m], ready[c:], lat[:m], sz[:m], inv[:m])
        _arrive(arrive[m:], ready[m:], ready[:c], lat[m:], sz[m:], inv[m:])
        wo = work_offsets[i]
        if wo >= 0:
            w = works[wo:wo + P]
            _receive_reduce(ready[:c], busy_row[:c], arrive[:c], arrive[m:], w[:c], coeff)
            _receive_reduce(ready[c:], busy_row[c:], arrive[c:], arrive[:m], w[c:], coeff)
        else:
            _receive(ready[:c], arrive[:c], arrive[m:])
            _receive(ready[c:], arrive[c:], arrive[:m])


@njit(cache=True, nogil=True)
def rotations_folded(ready, shifts, nodes, cost):
    """Rotation rounds of one message size on a state periodic in the rank with period G (``ready``: float64 (G,),
    the clocks of local indices 0..G-1, the same on every node; updated in place): round i is the rotation by
    ``shifts[i]`` (int64 (rounds,)); the message of local index l costs ``cost[i, code]`` (float64 (rounds, 3)) with
    code 0 (to itself), 1 (inside its node) or 2 (to another node) as
    :meth:`sim.engine.fastsim.FastCluster._class_of` gives for a rotation. nodes: P / G.
    Every rank of the unfolded state does the same operations on the same values, so the state stays periodic and
    these G clocks are its exact values."""
    G = ready.shape[0]
    arrive = np.empty(G)
    for i in range(shifts.shape[0]):
        c = shifts[i]
        for l in range(G):
            q = l + c
            off_node = (q // G) % nodes != 0
            code = (1 if off_node else 0) + (1 if c != 0 else 0)
            a = ready[l]
            b = ready[q % G]
            arrive[l] = (a if a >= b else b) + cost[i, code]
        back = (-c) % G
        for l in range(G):
            a = arrive[l]
            b = arrive[(l + back) % G]
            ready[l] = a if a >= b else b

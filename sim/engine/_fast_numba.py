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
def _ring_step(out, busy, mid, right, left, lat1, sz1, inv1, lat0, sz0, inv0, w, coeff, reduce):
    """One ring round, rank by rank (float64 1-D contiguous views of equal length, no index arithmetic, so the loop
    vectorises; ``reduce`` is loop-invariant and hoisted): rank r's own send arrives at a1 = max(mid[r], right[r]) +
    (lat1[r] + sz1[r] * inv1[r]) (its clock, its receiver's), the message it receives at a0 = max(left[r], mid[r]) +
    (lat0[r] + sz0[r] * inv0[r]) (its sender's clock, its own, the sender's cost), and out[r] = max(a1, a0); with
    ``reduce``, + coeff * w[r], also added to busy[r] (w and busy are not read otherwise)."""
    for r in range(out.shape[0]):
        x = mid[r]
        y = right[r]
        a1 = (x if x >= y else y) + (lat1[r] + sz1[r] * inv1[r])
        z = left[r]
        a0 = (z if z >= x else x) + (lat0[r] + sz0[r] * inv0[r])
        m = a1 if a1 >= a0 else a0
        if reduce:
            s = coeff * w[r]
            out[r] = m + s
            busy[r] = busy[r] + s
        else:
            out[r] = m


@njit(cache=True, nogil=True)
def ring_run(ready, c, lat, inv, sizes, offsets, coeff, works, work_offsets, busy_row):
    """A ring's rounds on ``ready`` (float64 (P,), s, updated in place): round i is the rotation by c (1 <= c < P)
    where rank r's message of ``sizes[offsets[i] + r]`` bytes costs ``lat[r] + sizes[offsets[i] + r] * inv[r]`` s
    (lat, inv: float64 (P,), the latency sum in s and 1 / slowest bandwidth in s/byte of r's path; sizes: the
    ring's read-only size table, float64 or an integer type converted exactly, laid out twice, sizes[j] =
    sizes[j + P], as :func:`sim.comm.rounds.shifted_ring_rounds` makes it; offsets in [0, P]); then, if
    ``work_offsets[i] >= 0``, every rank reduces ``works[work_offsets[i] + r]`` elements at ``coeff`` s each, the
    seconds added to ``ready`` and to ``busy_row`` (float64 (P,), in place). offsets / work_offsets: int64 (rounds,).

    Rank r's new clock is max(its send's arrival, its receive's arrival) (+ the reduce), both computed from the old
    clocks of r - c, r and r + c, in one pass per round over clocks padded with their wrap-around (so the loop has
    no index arithmetic and vectorises, and no arrival array is stored and read back): the operations of
    :meth:`sim.engine.fastsim.FastCluster.exchange` and ``compute``, element by element, hence their bits. The
    sender's cost of r's receive is computed again at r (the same float operations on the same values).
    Source: the rules of :meth:`sim.engine.fastsim.FastCluster.exchange`."""
    P = ready.shape[0]
    n = sizes.shape[0]
    szp = np.empty(n + c)  # szp[j + c] = sizes[j]; szp[j] = sizes[j - c + P] for j < c (the table's period P)
    szp[c:] = sizes
    szp[:c] = sizes[n - c:]
    latx = np.empty(P + c)  # latx[x + c] = lat[x], latx[x] = lat[x - c + P]
    latx[c:] = lat
    latx[:c] = lat[P - c:]
    invx = np.empty(P + c)
    invx[c:] = inv
    invx[:c] = inv[P - c:]
    cur = np.empty(P + 2 * c)  # cur[x + c] = ready[x mod P] for x in [-c, P + c)
    nxt = np.empty(P + 2 * c)
    cur[c:c + P] = ready
    for i in range(offsets.shape[0]):
        cur[:c] = cur[P:P + c]
        cur[P + c:] = cur[c:2 * c]
        off = offsets[i]
        wo = work_offsets[i]
        _ring_step(nxt[c:c + P], busy_row, cur[c:c + P], cur[2 * c:2 * c + P], cur[:P],
                   latx[c:], szp[off + c:off + c + P], invx[c:], latx[:P], szp[off:off + P], invx[:P],
                   works[max(wo, 0):max(wo, 0) + P], coeff, wo >= 0)
        cur, nxt = nxt, cur
    ready[:] = cur[c:c + P]


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

"""Numba kernels of the fast engine (:mod:`sim.engine.fastsim`); imported lazily through
:func:`sim.base.optional.kernels`, None without numba (the engine then takes its numpy path, the same bits).

They evaluate runs of *rotation* rounds (rank r sends to (r + c) % P and receives from (r - c) % P) on a fabric
with no shared link, where a message costs its class's latency sum plus n times its class's 1 / slowest bandwidth
(:meth:`sim.engine.fastsim.FastCluster._class_table`). They do, element by element and in the same order for each
rank, the float operations of :meth:`FastCluster.exchange` and :meth:`FastCluster.compute` (rendezvous ``max``,
``start + cost``, the receive ``max``, ``ready + seconds``), so their results are the numpy path's bits; only the
Python overhead of a round (tens of microseconds, P - 1 or 2(P - 1) times per collective) is gone, and a ring's
ranks and rounds are visited in an order that keeps its data in cache (:func:`ring_run`; measured by
``benchmarks/bench_ring_kernel.py``).
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _copy(dst, d0, src, s0, n):
    """dst[d0:d0 + n] = src[s0:s0 + n] (float64 1-D; ranges that do not overlap) as a loop: numba's slice assignment
    compiles its broadcasting machinery anew in every function that uses it (seconds each)."""
    for x in range(n):
        dst[d0 + x] = src[s0 + x]


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
def _ring_rounds(ready, c, lat, inv, sizes, offsets, coeff, works, work_offsets, busy_row):
    """:func:`ring_run` one round at a time over all P ranks (its fallback, and the reference of its tests): a ring's
    rounds on ``ready`` (float64 (P,), s, updated in place): round i is the rotation by c (1 <= c < P)
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
    _copy(szp, c, sizes, 0, n)
    _copy(szp, 0, sizes, n - c, c)
    latx = np.empty(P + c)  # latx[x + c] = lat[x], latx[x] = lat[x - c + P]
    _copy(latx, c, lat, 0, P)
    _copy(latx, 0, lat, P - c, c)
    invx = np.empty(P + c)
    _copy(invx, c, inv, 0, P)
    _copy(invx, 0, inv, P - c, c)
    cur = np.empty(P + 2 * c)  # cur[x + c] = ready[x mod P] for x in [-c, P + c)
    nxt = np.empty(P + 2 * c)
    _copy(cur, c, ready, 0, P)
    for i in range(offsets.shape[0]):
        _copy(cur, 0, cur, P, c)
        _copy(cur, P + c, cur, c, c)
        off = offsets[i]
        wo = work_offsets[i]
        _ring_step(nxt[c:c + P], busy_row, cur[c:c + P], cur[2 * c:2 * c + P], cur[:P],
                   latx[c:], szp[off + c:off + c + P], invx[c:], latx[:P], szp[off:off + P], invx[:P],
                   works[max(wo, 0):max(wo, 0) + P], coeff, wo >= 0)
        cur, nxt = nxt, cur
    _copy(ready, 0, cur, c, P)


#: Most runs of equal values the size (or work) table of a ring may have, read cyclically over its period P, for
#: :func:`ring_run` to evaluate it by segments; more: :func:`_ring_rounds`. A chunk table of ``np.array_split`` has 2
#: (or 1); at 8 the segments' overhead made P = 1024 rings 2x slower than one pass per round (helper-28's review).
MAX_RUNS = 4
#: Fewest rounds a block of :func:`ring_run` may have (T = (P // K) // (2c), K = max(1, P // tile) tiles); fewer:
#: :func:`_ring_rounds`. At T = 4 (c = 128 at P = 1024) the tiles' overhead made it 1.2-1.7x slower.
MIN_BLOCK = 16
#: Ranks per tile of :func:`ring_run` (its clocks, two cost rows and the busy row of a tile, 5 x 8 KB, stay in a 48 KB
#: L1 cache over the tile's rounds; measured best of 512 .. 4096 by benchmarks/bench_ring_kernel.py).
TILE = 1024


@njit(cache=True, nogil=True)
def _runs(table, P):
    """The runs of equal values of ``table[0:P]`` (float64) read cyclically: (run starts, int64 (n,) ascending, n = 0
    when all are equal; the index of each position's value in ``values``, int64 (P,); the distinct values, float64;
    n). When n > :data:`MAX_RUNS` only n is meaningful (it is then MAX_RUNS + 1)."""
    starts = np.empty(MAX_RUNS + 1, np.int64)
    n = 0
    for j in range(P):
        if table[j] != table[(j - 1) % P]:
            if n == MAX_RUNS:
                return starts[:0], np.empty(0, np.int64), np.empty(0), MAX_RUNS + 1
            starts[n] = j
            n += 1
    values = np.empty(max(n, 1))
    which = np.empty(P, np.int64)
    nv = 0
    for j in range(P):
        k = -1
        for q in range(nv):
            if values[q] == table[j]:
                k = q
                break
        if k < 0:
            values[nv] = table[j]
            k = nv
            nv += 1
        which[j] = k
    return starts[:n], which, values[:nv], n


@njit(cache=True, nogil=True, inline="always")
def _seg_step(out, busy, mid, right, left, a1, a0, s, reduce):
    """:func:`_ring_step` on a segment of ranks whose send and receive costs were computed once (a1[r]: rank r's
    own send, a0[r]: its sender's, s: the reduce's seconds, one value on the segment): the same float operations
    on the same values, hence the same bits."""
    for r in range(out.shape[0]):
        x = mid[r]
        y = right[r]
        e1 = (x if x >= y else y) + a1[r]
        z = left[r]
        e0 = (z if z >= x else x) + a0[r]
        m = e1 if e1 >= e0 else e0
        if reduce:
            out[r] = m + s
            busy[r] = busy[r] + s
        else:
            out[r] = m


@njit(cache=True, nogil=True, inline="always")
def _span(out, prev, busyx, costx, i, lo, hi, P, c, E, Ec, seg_lo, seg_n, seg_v1, seg_v0, seg_s, reduce):
    """Block round i of :func:`ring_run` on the padded positions x in [lo, hi) (lo >= -P; x < 0 is rank x + P, kept
    at its ghost position), segment by segment: clocks ``prev`` -> ``out`` at x + E, costs at x + Ec."""
    for piece in range(2):
        a0, b0, shift = (lo, min(hi, 0), P) if piece == 0 else (max(lo, 0), hi, 0)
        if a0 >= b0:
            continue
        for q in range(seg_n[i]):
            a = max(seg_lo[i, q], a0 + shift) - shift
            b = min(seg_lo[i, q + 1], b0 + shift) - shift
            if a < b:
                _seg_step(out[E + a:E + b], busyx[E + a:E + b], prev[E + a:E + b], prev[E + a + c:E + b + c],
                          prev[E + a - c:E + b - c], costx[seg_v1[i, q], Ec + a:Ec + b],
                          costx[seg_v0[i, q], Ec + a - c:Ec + b - c], seg_s[i, q], reduce)


@njit(cache=True, nogil=True)
def _segments(g, Tb, P, c, offsets, work_offsets, s_starts, s_which, w_starts, w_which, wsec,
              seg_lo, seg_n, seg_v1, seg_v0, seg_s):
    """Rounds g .. g + Tb - 1 of :func:`ring_run` cut into segments of ranks [0, P) on which rank r's send size
    (table position offsets[i] + r), its sender's (offsets[i] + r - c) and, where the round reduces, its work
    (work_offsets[i] + r) each are one value: row t of the arrays (in place) holds round g + t's seg_n[t] segments
    [seg_lo[t, q], seg_lo[t, q + 1]), their cost rows (seg_v1, seg_v0) and reduce seconds (seg_s)."""
    bp = np.empty(seg_lo.shape[1], np.int64)
    for t in range(Tb):
        off = offsets[g + t]
        wo = work_offsets[g + t]
        nb = 1
        bp[0] = 0
        for j in range(s_starts.shape[0]):
            bp[nb] = (s_starts[j] - off) % P
            bp[nb + 1] = (s_starts[j] - off + c) % P
            nb += 2
        if wo >= 0:
            for j in range(w_starts.shape[0]):
                bp[nb] = (w_starts[j] - wo) % P
                nb += 1
        for j in range(1, nb):  # insertion sort (a few entries)
            v = bp[j]
            q = j - 1
            while q >= 0 and bp[q] > v:
                bp[q + 1] = bp[q]
                q -= 1
            bp[q + 1] = v
        n = 0
        for q in range(nb):
            lo = bp[q]
            if lo < (bp[q + 1] if q + 1 < nb else P):
                seg_lo[t, n] = lo
                seg_v1[t, n] = s_which[(off + lo) % P]
                seg_v0[t, n] = s_which[(off + lo - c) % P]
                seg_s[t, n] = wsec[w_which[(wo + lo) % P]] if wo >= 0 else 0.0
                n += 1
        seg_lo[t, n] = P
        seg_n[t] = n


def ring_run(ready, c, lat, inv, sizes, offsets, coeff, works, work_offsets, busy_row, tile=TILE):
    """A ring's rounds on ``ready`` (float64 (P,), s, updated in place): round i is the rotation by c (1 <= c < P)
    where rank r's message of ``sizes[offsets[i] + r]`` bytes costs ``lat[r] + sizes[offsets[i] + r] * inv[r]`` s
    (lat, inv: float64 (P,), the latency sum in s and 1 / slowest bandwidth in s/byte of r's path; sizes: float64
    (2P,), the ring's size table laid out twice, sizes[j] = sizes[j + P], as :func:`sim.comm.rounds.shifted_ring_rounds`
    makes it; offsets in [0, P]); then, if ``work_offsets[i] >= 0``, every rank reduces ``works[work_offsets[i] + r]``
    elements at ``coeff`` s each, the seconds added to ``ready`` and to ``busy_row`` (float64 (P,), in place).
    offsets / work_offsets: int64 (rounds,); works: float64 (2P,) laid out twice like sizes. tile: ranks per tile
    (tests use small ones).

    Rank r's new clock is max(its send's arrival, its receive's arrival) (+ the reduce), both from the old clocks of
    r - c, r and r + c: the operations of :meth:`sim.engine.fastsim.FastCluster.exchange` and ``compute``, element
    by element, hence their bits. Two things make it fast, neither changes an operation:

    * **Costs per distinct size.** A chunk table has a few runs of equal sizes (``np.array_split``: q + 1, then q),
      so a round's ranks fall in a few segments on which r's send size and its sender's are one value each; the
      cost ``lat[x] + v * inv[x]`` of every rank x is computed once per distinct size v (the same operations on the
      same values as computing it every round; sizes are whole numbers, so -0.0, which compares equal to 0.0 but
      could change a zero's sign, does not occur) and the reduce's ``coeff * w`` once per distinct w.
    * **Tiles of ranks over blocks of rounds** (time skewing): K = max(1, P // tile) tiles of about P / K ranks; a
      block of T = min(R, (P // K) // (2c)) rounds is evaluated tile by tile, each tile's rounds in order while its
      data stay in L1; tile 0 shrinks by c a round on both sides (an upright trapezoid, needing only its own
      clocks), the others are parallelograms skewed left by c a round (needing the previous tile's, already
      computed), and the wrap-around corner [P - tc, P) u [0, tc) at round t is evaluated last from ghost copies.
      Every (rank, round) is computed once from the clocks of the round before, and two clock buffers suffice
      (what a tile overwrites, no later step reads).

    Tables with more than :data:`MAX_RUNS` runs, tables not laid out twice, or (P // K) // (2c) < :data:`MIN_BLOCK`
    (c large for the tile): :func:`_ring_rounds` (one pass per round, the same bits). Source: the rules of
    :meth:`sim.engine.fastsim.FastCluster.exchange`; time skewing: Wolf & Lam, PLDI 1991; Frigo & Strumpen, ICS
    2005 (trapezoidal stencil decomposition)."""
    if not _ring_tiled(ready, c, lat, inv, sizes, offsets, coeff, works, work_offsets, busy_row, tile):
        _ring_rounds(ready, c, lat, inv, sizes, offsets, coeff, works, work_offsets, busy_row)


@njit(cache=True, nogil=True)
def _ring_tiled(ready, c, lat, inv, sizes, offsets, coeff, works, work_offsets, busy_row, tile):
    """:func:`ring_run`'s tiled evaluation; returns False, having changed nothing, where it does not apply (the
    caller then runs :func:`_ring_rounds`: compiled apart, only when first needed)."""
    P = ready.shape[0]
    R = offsets.shape[0]
    K = max(1, P // tile)
    T = (P // K) // (2 * c)
    if T < MIN_BLOCK or sizes.shape[0] != 2 * P or works.shape[0] != 2 * P:
        return False
    for j in range(P):
        if sizes[j] != sizes[j + P] or works[j] != works[j + P]:
            return False
    s_starts, s_which, s_values, ns = _runs(sizes, P)
    w_starts, w_which, w_values, nw = _runs(works, P)
    if ns > MAX_RUNS or nw > MAX_RUNS:
        return False
    T = min(T, R)
    E = (T + 1) * c  # clock ghosts: position x of a padded row holds rank x mod P at index x + E
    Ec = E + c
    costx = np.empty((s_values.shape[0], P + 2 * Ec))  # costx[v, x + Ec] = lat[x] + s_values[v] * inv[x], x mod P
    for v in range(s_values.shape[0]):
        for x in range(P):
            costx[v, x + Ec] = lat[x] + s_values[v] * inv[x]
        for x in range(Ec):
            costx[v, x] = costx[v, x + P]
            costx[v, Ec + P + x] = costx[v, Ec + x]
    wsec = np.empty(w_values.shape[0])
    for v in range(w_values.shape[0]):
        wsec[v] = coeff * w_values[v]
    nbm = 2 * ns + nw + 1
    seg_lo = np.empty((T, nbm + 1), np.int64)
    seg_n = np.empty(T, np.int64)
    seg_v1 = np.empty((T, nbm), np.int64)
    seg_v0 = np.empty((T, nbm), np.int64)
    seg_s = np.empty((T, nbm))
    cur = np.empty(P + 2 * E)
    nxt = np.empty(P + 2 * E)
    busyx = np.empty(P + 2 * E)
    _copy(cur, E, ready, 0, P)
    _copy(busyx, E, busy_row, 0, P)
    g = 0
    while g < R:
        Tb = min(T, R - g)
        _segments(g, Tb, P, c, offsets, work_offsets, s_starts, s_which, w_starts, w_which, wsec,
                  seg_lo, seg_n, seg_v1, seg_v0, seg_s)
        m = Tb * c
        for k in range(K + 1):  # tile 0: upright trapezoid; 1 .. K - 1: parallelograms skewed left by c a round;
            s = (k * P) // K  # K: the wrap-around corner [P - tc, P) u [0, tc), ranks P + x (x < 0) at ghosts x
            e = ((k + 1) * P) // K
            if k == K:
                _copy(busyx, E - m, busyx, E + P - m, m)
            for t in range(1, Tb + 1):
                prev, out = (cur, nxt) if t % 2 == 1 else (nxt, cur)
                if k == K:
                    _copy(prev, E - (t + 1) * c, prev, E + P - (t + 1) * c, 2 * c)
                    lo, hi = -t * c, t * c
                else:
                    lo, hi = (s + t * c if k == 0 else s - t * c), e - t * c
                _span(out, prev, busyx, costx, t - 1, lo, hi, P, c, E, Ec, seg_lo, seg_n, seg_v1, seg_v0, seg_s,
                      work_offsets[g + t - 1] >= 0)
        if Tb % 2 == 1:
            cur, nxt = nxt, cur
        _copy(cur, E + P - m, cur, E - m, m)
        _copy(busyx, E + P - m, busyx, E - m, m)
        g += Tb
    _copy(ready, 0, cur, E, P)
    _copy(busy_row, 0, busyx, E, P)
    return True


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

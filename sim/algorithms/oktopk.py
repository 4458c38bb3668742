"""Ok-Topk S-SGD: an O(k) sparse allreduce (split-and-reduce, then balance-and-allgatherv) with thresholds
re-estimated only every tau iterations.

Source: Shigang Li and Torsten Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP 2022
(Algorithm 1: the O(k) sparse allreduce, section 3.1.1 split and reduce, 3.1.2 balance and allgatherv, 3.1.3
threshold-based selection; Algorithm 2: Ok-Topk SGD with residuals; Eq. 1-3: the cost) and its reference code
(github.com/Shigangli/Ok-Topk, ``VGG/allreducer.py``, branch ``self._compression.name == 'oktopk'`` of
``AllReducer.run``, and ``VGG/compression.py``, class ``GaussianCompressor``), which this file follows where the
paper leaves a choice open. Per worker p, iteration t (c = t - 1 counts the sparse steps from 0, as the reference
code's counter after its dense warm-up, which is not modelled here), one segment acc_p of d_b elements:

1. **Local threshold** (Algorithm 1, "th_re_evaluate"): when c % tau == 0 (or no threshold is known yet), the
   exact k-th largest |acc_p| (``ratio2threshold``); otherwise the stored one, raised by the factor 1.03 at most 5
   times while more than floor(4k/3) entries exceed it (``add2residual``).
2. **Space repartition** every ``repartition_period`` iterations (tau' in the paper): every rank takes the
   indices of its entries above the local threshold (ascending, n of them), proposes the P - 1 boundaries
   idx[i floor(n/P)], i = 1..P-1 (its local top-k cut into P equal counts), and the boundaries are the floor of
   their mean over the ranks (an allreduce of P - 1 integers: recursive doubling). Region j is
   [bounds[j], bounds[j+1]) of the segment; the boundaries are the same on every rank. (A rank with nothing above
   its threshold proposes the even split j d_b / P; the reference code would index an empty array there.)
3. **Split and reduce** (section 3.1.1, Eq. 1): the local selection S_p = {i : |acc_p[i]| > local threshold}
   (strictly above, the reference code's ``compressbythreshold``; exact zeros are never selected) is cut by
   region; in round i = 1..P-1 rank p sends its part of region (p+i) mod P to that rank and receives region p's
   part from rank (p-i) mod P (the reference code's destination rotation, one peer per round). Rank p adds its
   own part, then the received ones in round order, into its region's dense sum R_p. The local threshold is then
   divided by 1.012 if |S_p| < 2k/3 or multiplied by 1.012 if |S_p| > 5k/4.
4. **Global selection** (section 3.1.2, Algorithm 1): when c % tau == 0, the candidates of rank p are all nonzero
   entries of R_p; otherwise those with |R_p[i]| > global threshold (the stored one).
5. **Balance and allgatherv** (section 3.1.2, Eq. 2): an allgather of the candidate counts (Bruck, one 4-byte
   integer per rank), then the concatenation of the candidates in rank order (= in index order) is re-cut into P
   blocks of floor(N/P) or ceil(N/P) entries and every rank sends the parts of its candidates that belong to
   another rank's block (round i: to (p+i) mod P, from (p-i) mod P; no message for an empty part), then the
   blocks are allgathered (Bruck allgatherv). Every rank now holds all N candidates, identically. (The released
   code comments the balancing out and allgathers the unbalanced candidates; the values and the result are the
   same, only the messages differ.)
6. **Result**: when c % tau == 0, g = the k largest candidates by magnitude (the project's tie rule: ties to the
   lower index) and the global threshold becomes the smallest selected magnitude (the reference code's
   ``k2globalthreshold``); otherwise g = all candidates and the global threshold is divided by 1.008 when
   N < 2k/3 or multiplied by 1.008 when N > 4k/3.
7. **Residual** (Algorithm 2): eps_p = acc_p with zeros at S_p intersected with the support of g (the reference
   code's ``update_residuals(intersect1d(local_topk_indexes, gindexes))``): a locally selected value whose index
   did not make the global selection stays in the residual.

Mass accounting is exact (``drops_mass`` is False): for i in supp(g), g_i = R[i] = sum of acc_p[i] over the
ranks p with i in S_p, whose residuals are zeroed at i, while the other ranks keep acc_p[i]; for i not in supp(g)
every rank keeps acc_p[i]. So sum_p acc_p = g + sum_p eps_p up to the rounding of the sums.

State (``ctx.state["oktopk"][segment]``): ``local_th`` (this rank's), ``global_th`` and ``bounds`` (int64 array
(P+1,), region offsets in the segment), the latter two identical on every rank.

Options: ``tau`` (threshold re-estimation period, integer >= 1, default 32 as the reference code's
``local_threshold_recompute_interval`` and ``global_threshold_recompute_interval``), ``repartition_period``
(tau', integer >= 1, default 64 as its ``region_repartition_interval``).

Compute: an exact k-th largest / top-k is ``select`` (elements scanned); a threshold filter or count over n
elements has no kind of its own in :data:`sim.base.ops.COMPUTE_KINDS` and is costed as ``reduce`` of n elements (a
linear elementwise pass, the closest kind); adding received entries into R_p and assembling g are ``reduce``.

Timing-only mode (:meth:`OkTopK.fast_rounds`) models a steady-state iteration
(c % tau != 0, no repartition; the re-estimation and repartition steps, 1 in tau and 1 in tau', add an
exact selection and a small allreduce) under this assumption: the regions are balanced, so every rank selects
kr = ceil(k/P) entries in every region (k rounded up to a multiple of P), no threshold needs raising, and the
global selection has kr entries in every region, so the balance step moves nothing. Then the time on a
contention-free network with zero compute is :func:`sim.comm.costs.oktopk_time`:
(P-1)(alpha + kr s beta) + ceil(lg P) alpha + 4 (P-1) beta + ceil(lg P) alpha + (P-1) kr s beta, with
s = value_bytes + index_bytes. With real data the counts vary around kr (the thresholds keep them between about
2k/3 and 5k/4 locally and 2k/3 and 4k/3 globally) and unbalanced selections add balance messages, bounded by
the paper's Eq. 2 (:func:`sim.comm.costs.oktopk_bound_time` is the paper's bound).
"""
from __future__ import annotations

import numpy as np

from sim.comm import collectives as C
from sim.comm import rounds as V
from sim.comm.compression import Sparse, topk
from sim.base.ops import Compute, Recv, Send, SendRecv
from sim.algorithms.base import Algorithm, Exchange, Option, register

#: Bytes of one integer of metadata on the wire (a candidate count, a region boundary): the reference code's
#: MPI int32 buffers.
INT_BYTES = 4
#: The reference code's threshold constants (VGG/allreducer.py, VGG/compression.py).
LOCAL_RAISE, LOCAL_RAISE_LOOPS = 1.03, 5      # add2residual: th *= 1.03 while count > floor(4k/3), at most 5 times
LOCAL_SCALE = 1.012                           # after selection: / if count < 2k/3, * if count > 5k/4
GLOBAL_SCALE = 1.008                          # after the allgatherv: / if count < 2k/3, * if count > 4k/3


def _take(s: Sparse, a: int, b: int) -> Sparse:
    """Entries a..b-1 of ``s`` (positions, not coordinates)."""
    return Sparse(s.idx[a:b], s.val[a:b], s.d)


def _concat(parts: list, d: int, dtype) -> Sparse:
    """The Sparse of ``parts`` (Sparse of dimension d, disjoint, each after the previous in index order)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return Sparse(np.empty(0, dtype=np.int64), np.empty(0, dtype=dtype), d)
    if len(parts) == 1:
        return parts[0]
    return Sparse(np.concatenate([p.idx for p in parts]), np.concatenate([p.val for p in parts]), d)


def split_reduce_rounds(rank: int, P: int, parts: list, nbytes_of):
    """The split-and-reduce exchange (Li and Hoefler 2022, section 3.1.1): ``parts[j]`` is this rank's payload for
    region j; in round i = 1..P-1 it is sent to rank (rank+i) mod P while region ``rank``'s part of rank
    (rank-i) mod P is received (SendRecv). Returns ``[parts[rank], from rank-1, from rank-2, ...]``, the reference
    code's reduction order. P - 1 messages per rank; no message for P = 1."""
    out = [parts[rank]]
    for i in range(1, P):
        dst, src = (rank + i) % P, (rank - i) % P
        got = yield SendRecv(dst, parts[dst], nbytes_of(parts[dst]), src)
        out.append(got)
    return out


def balance_rounds(rank: int, P: int, counts: np.ndarray, cand: Sparse, nbytes_of):
    """The balance step of balance-and-allgatherv (section 3.1.2): ``counts`` (int array (P,), the candidates of
    every rank, from the counts allgather) and this rank's ``cand`` (Sparse, counts[rank] entries). The
    concatenation of all candidates in rank order is cut into P blocks of floor(N/P) + [j < N mod P] entries;
    round i = 1..P-1 sends this rank's part of block (rank+i) mod P there and receives its own block's part of rank
    (rank-i) mod P (Send / Recv / SendRecv as the non-empty parts need; nothing when both are empty). Returns
    this rank's block (Sparse, its parts in rank order)."""
    counts = np.asarray(counts, dtype=np.int64)
    N = int(counts.sum())
    start = np.concatenate([[0], np.cumsum(counts)])
    sizes = N // P + (np.arange(P) < N % P)
    bstart = np.concatenate([[0], np.cumsum(sizes)])

    def piece(j, r):
        """Positions [a, b) of rank j's candidates that belong to block r, or None."""
        a, b = max(start[j], bstart[r]), min(start[j + 1], bstart[r + 1])
        return (int(a - start[j]), int(b - start[j])) if b > a else None

    got = {}
    own = piece(rank, rank)
    if own:
        got[rank] = _take(cand, *own)
    for i in range(1, P):
        dst, src = (rank + i) % P, (rank - i) % P
        out, inc = piece(rank, dst), piece(src, rank)
        if out:
            data = _take(cand, *out)
            if inc:
                got[src] = yield SendRecv(dst, data, nbytes_of(data), src)
            else:
                yield Send(dst, data, nbytes_of(data))
        elif inc:
            got[src] = yield Recv(src)
    return _concat([got[j] for j in sorted(got)], cand.d, cand.val.dtype)


def balance_and_allgatherv(rank: int, P: int, cand: Sparse, value_bytes: int, index_bytes: int):
    """Balance-and-allgatherv (section 3.1.2, Eq. 2) of this rank's candidates ``cand``: counts allgather (Bruck,
    :data:`INT_BYTES` per rank), :func:`balance_rounds`, then a Bruck allgather of the balanced blocks. Returns the
    P blocks in rank order (list of Sparse), identical on every rank."""
    nbytes_of = lambda s_: s_.nbytes(value_bytes, index_bytes)  # noqa: E731
    counts = yield from C.bruck_allgather(rank, P, np.array([len(cand)], dtype=np.int64), lambda c: INT_BYTES)
    counts = np.concatenate(counts)
    block = yield from balance_rounds(rank, P, counts, cand, nbytes_of)
    return (yield from C.bruck_allgather(rank, P, block, nbytes_of))


def _kth_largest(absx: np.ndarray, k: int) -> float:
    """The k-th largest entry of ``absx`` (float array (n,), n >= k >= 1) as a Python float."""
    n = absx.shape[0]
    return float(np.partition(absx, n - k)[n - k])


@register
class OkTopK(Algorithm):
    """Ok-Topk S-SGD (Li and Hoefler, PPoPP 2022, Algorithms 1-2): split-and-reduce over P balanced index regions,
    balance-and-allgatherv of the values above the global threshold, thresholds re-estimated every ``tau``
    iterations and regions every ``repartition_period``. See the module docstring for each step."""

    name = "oktopk"
    collectives = ("split_reduce_allgatherv",)
    summary = ("Ok-Topk S-SGD: split-and-reduce over balanced regions, balance-and-allgatherv above a "
               "global threshold re-estimated every tau steps")
    source = "Li and Hoefler, PPoPP 2022, Algorithms 1-2, Eq. 1-3; reference code Shigangli/Ok-Topk VGG/allreducer.py"
    options = {
        "tau": Option(32, "threshold re-estimation period tau (iterations): the local and global thresholds are "
                          "recomputed exactly every tau steps and reused (threshold filter) in between",
                      kind=int, lo=1),
        "repartition_period": Option(64, "region repartition period tau' (iterations): the region boundaries "
                                         "follow the local top-k index distribution every tau' steps",
                                     kind=int, lo=1),
    }

    # ------------------------------------------------------------------ numerics
    cost_kinds = ("select", "reduce")  # exact selections every tau steps, threshold passes; nothing is merged

    def compression_work(self, spec, d_b, k_b):
        """Nothing before the collective: Ok-Topk's selection is part of its exchange (an exact top-k every ``tau``
        steps, else threshold passes, Li and Hoefler PPoPP 2022 Algorithm 1), and its timing-only form
        (:meth:`fast_rounds`, the steady state) charges those passes as ``reduce`` work inside the collective, which
        the timeline's collective timer keeps. Charging a Top-k selection before it as well (the default) counted
        the selection twice in the timeline and not at all on the fast engine."""
        return ()

    def exchange(self, spec, acc, k, ctx):
        P, rank = ctx.P, ctx.rank
        n = acc.shape[0]
        c = ctx.iteration - 1
        tau, tau_r = spec.opt("tau"), spec.opt("repartition_period")
        st = ctx.state.setdefault("oktopk", {}).setdefault(ctx.segment, {})
        absacc = np.abs(acc)
        # 1. local threshold: exact every tau steps, else the stored one raised while too many exceed it
        if c % tau == 0 or "local_th" not in st:
            yield Compute("select", n)
            lth = _kth_largest(absacc, k)
        else:
            lth = st["local_th"]
            for _ in range(LOCAL_RAISE_LOOPS):
                yield Compute("reduce", n)
                if np.count_nonzero(absacc > lth) > 4 * k // 3:
                    lth *= LOCAL_RAISE
                else:
                    break
        # 2. space repartition: mean of the ranks' equal-count cuts of their local selections
        if c % tau_r == 0 or "bounds" not in st:
            yield Compute("reduce", n)
            idx = np.flatnonzero(absacc > lth)
            if idx.shape[0]:
                cand = idx[(idx.shape[0] // P) * np.arange(1, P)]
            else:
                cand = (np.arange(1, P, dtype=np.int64) * n) // P
            total = yield from C.rd_allreduce(rank, P, cand.astype(np.int64), INT_BYTES)
            st["bounds"] = np.concatenate([[0], np.asarray(total, dtype=np.int64) // P, [n]]).astype(np.int64)
        bounds = st["bounds"]
        # 3. split and reduce of the entries strictly above the local threshold
        yield Compute("reduce", n)
        sel_idx = np.flatnonzero(absacc > lth)
        sel = Sparse(sel_idx, acc[sel_idx], n)
        ctx.scratch.setdefault("oktopk_selected", {})[ctx.segment] = sel_idx  # this step's S_p (for inspection)
        cuts = np.searchsorted(sel_idx, bounds)
        parts = [_take(sel, int(cuts[j]), int(cuts[j + 1])) for j in range(P)]
        m = len(sel)
        st["local_th"] = lth / LOCAL_SCALE if m < 2 * k / 3 else lth * LOCAL_SCALE if m > 5 * k / 4 else lth
        vb, ib = spec.value_bytes, spec.index_bytes
        got = yield from split_reduce_rounds(rank, P, parts, lambda s_: s_.nbytes(vb, ib))
        lo, hi = int(bounds[rank]), int(bounds[rank + 1])
        yield Compute("reduce", sum(len(p) for p in got))
        region = np.zeros(hi - lo, dtype=acc.dtype)
        for p in got:  # own part first, then rank-1, rank-2, ... (the reference code's order)
            region[p.idx - lo] += p.val
        # 4. global candidates: every nonzero (re-estimation) or those above the global threshold
        reestimate = c % tau == 0 or "global_th" not in st
        yield Compute("reduce", hi - lo)
        keep = np.flatnonzero(region) if reestimate else np.flatnonzero(np.abs(region) > st["global_th"])
        cand = Sparse(keep + lo, region[keep], n)
        # 5. balance and allgatherv
        blocks = yield from balance_and_allgatherv(rank, P, cand, vb, ib)
        allc = _concat(blocks, n, acc.dtype)
        N = len(allc)
        # 6. the result
        if reestimate:
            yield Compute("select", N)
            gsel = topk(allc.to_dense(), min(k, N)) if N else allc
            st["global_th"] = float(np.min(np.abs(gsel.val))) if len(gsel) else 0.0
        else:
            gsel = allc
            gth = st["global_th"]
            st["global_th"] = gth / GLOBAL_SCALE if N < 2 * k / 3 else gth * GLOBAL_SCALE if N > 4 * k / 3 else gth
        yield Compute("reduce", len(gsel))
        g = gsel.to_dense()
        # 7. residual: zero where this rank's selection reached g
        applied = sel_idx[np.isin(sel_idx, gsel.idx, assume_unique=True)]
        res = acc.copy()
        res[applied] = 0.0
        return Exchange(g, res, m, int(applied.shape[0]))

    # ------------------------------------------------------------------ timing only (vectorised)
    def fast_rounds(self, spec, P, d, it, G):
        R = np.arange(P, dtype=np.int64)
        kr = -(-int(spec.k) // P)
        m = kr * (spec.value_bytes + spec.index_bytes)
        yield V.Work("reduce", d)
        yield V.Work("reduce", d)
        R2 = np.concatenate((R, R))  # slices of it are the rotations: R2[i:i + P] = (R + i) % P
        for i in range(1, P):
            yield V.Round(R2[i:i + P], R2[P - i:2 * P - i], m, ("rotation", i))
        yield V.Work("reduce", P * kr)
        yield V.Work("reduce", V.chunk_size(d, P, R))
        for dst, src, cnt in C.bruck_schedule(R, P):  # the counts allgather
            yield V.Round(dst, src, cnt * INT_BYTES)
        # balance: every rank holds kr candidates, its balanced block already: no message
        for dst, src, cnt in C.bruck_schedule(R, P):  # the allgatherv of the blocks
            yield V.Round(dst, src, cnt * m)
        yield V.Work("reduce", P * kr)

    def closed_form_s(self, spec, P, d, alpha, beta, cluster=None):
        from sim.comm import costs

        return costs.oktopk_time(P, spec.k, alpha, beta, spec.value_bytes, spec.index_bytes)

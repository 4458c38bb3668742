"""SparCML's sparse allreduce over Top-k selections with error feedback.

acc_p = eps_p + alpha_t G_p; g = sum_q TopK(acc_q), computed exactly by a sparse allreduce; eps_p = acc_p -
TopK(acc_p). The same g as Top-k's allgather (every selected entry reaches g, nothing is truncated as in
gTop-k), with different messages: the P selections are summed on the way, in sparse streams that switch to a
dense representation once their sparse encoding would not be smaller than the dense vector.

Source: Renggli, Ashkboos, Aghagolzadeh, Alistarh and Hoefler, "SparCML: High-Performance Sparse Communication
for Machine Learning", SC 2019 (arXiv:1802.08021): the static sparse allreduces SSAR_Recursive_double and
SSAR_Split_allgather, the sparse stream with its switch to dense, and Top-k SGD with error accumulation; the
authors' C/MPI code (``c_allreduce_recdoubling`` and ``c_allreduce_small`` with ``c_common.h``'s
``sum_streams``, ``sum_into_stream`` and ``split_stream``) fixes the details the paper leaves open
(docs/algorithms/sparcml.md). The collectives are :func:`sim.comm.collectives.ssar_recursive_doubling` and
:func:`sim.comm.collectives.ssar_split_allgather`.

Collectives: ``ssar_recursive_doubling`` (default) and ``ssar_split_allgather``. Options
(``[algorithm.sparcml]``): ``dense_threshold`` t in (0, 1] (a stream of c entries over w coordinates is dense iff
c (value_bytes + index_bytes) >= t w value_bytes; 1 = the paper's switch at the break-even) and ``dense_rule``
("union": the rule on the merged stream's entries; "bound": on the two inputs' entries before the merge, as the
authors' code). Compute kinds: "select" for the Top-k, "merge" for a merge of two sparse streams (the closest
kind: no top-k follows it here), "reduce" for additions into a dense stream.

Timing-only mode (:class:`PhantomStreams`): the worst case of disjoint supports. Every rank selects k entries,
no two selections share a coordinate, so a merge of streams of a and b entries holds a + b (at most the
window), and the split variant's pieces are spread evenly (every piece of a stream of c entries holds
ceil(c / pof2) and takes the size of the largest region). The messages then double each round until they switch
to dense; the simulated time equals :func:`sim.comm.costs.sparcml_rd_time` / :func:`sim.comm.costs.sparcml_split_time`
exactly. Real supports overlap, so real messages are smaller: the numerics' messages are at most these.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.comm import collectives as C
from sim.comm import rounds as V
from sim.comm.compression import topk
from sim.base.ops import Compute
from sim.algorithms.base import Algorithm, Exchange, Option, register


@register
class SparCML(Algorithm):
    """Top-k with error feedback whose selections are summed by SparCML's sparse allreduce (exact:
    g = sum_q TopK(acc_q), eps_p = acc_p - TopK(acc_p))."""

    name = "sparcml"
    collectives = ("ssar_recursive_doubling", "ssar_split_allgather")
    summary = "SparCML: Top-k selections summed by a sparse allreduce whose streams switch to dense"
    source = ("Renggli et al. SC 2019 (SparCML), SSAR_Recursive_double and SSAR_Split_allgather; "
              "authors' c_allreduce_recdoubling / c_allreduce_small")
    options = {
        "dense_threshold": Option(
            1.0, "t: a stream of c entries over w coordinates turns dense iff c (value_bytes + index_bytes) >= "
                 "t w value_bytes; 1 = the paper's break-even", float, lo=0.0, hi=1.0, lo_open=True),
        "dense_rule": Option(
            "union", "apply the switch to the merged stream's entries (union) or to the inputs' entries before the "
                     "merge (bound, as the authors' code)", str, choices=("union", "bound")),
    }

    def label_tags(self, spec):
        tags = []
        if spec.collective != self.collectives[0]:
            tags.append("split")
        if spec.opt("dense_threshold") != 1.0:
            tags.append(f"t={spec.opt('dense_threshold'):g}")
        if spec.opt("dense_rule") != "union":
            tags.append("bound")
        return tags

    def _coll(self, spec):
        return C.ssar_split_allgather if spec.collective == "ssar_split_allgather" else C.ssar_recursive_doubling

    def exchange(self, spec, acc, k, ctx):
        yield Compute("select", acc.shape[0])
        sel = topk(acc, k)
        ops = C.SparseStreams(acc.shape[0], sel.val.dtype, spec.value_bytes, spec.index_bytes,
                              spec.opt("dense_threshold"), spec.opt("dense_rule"))
        out = yield from self._coll(spec)(ctx.rank, ctx.P, sel, streams=ops)
        res = acc.copy()
        res[sel.idx] = 0.0
        return Exchange(ops.finish(out), res, len(sel), len(sel))

    # ------------------------------------------------------------------ timing only (vectorised)
    def fast_rounds(self, spec, P, d, it, G):
        yield V.Work("select", d)
        yield from _ssar_rounds(spec, P, d, split=spec.collective == "ssar_split_allgather")

    def closed_form_s(self, spec, P, d, alpha, beta, cluster=None):
        from sim.comm import costs

        f = costs.sparcml_split_time if spec.collective == "ssar_split_allgather" else costs.sparcml_rd_time
        return f(P, spec.k, d, alpha, beta, spec.value_bytes, spec.index_bytes, spec.opt("dense_threshold"))


# ----------------------------------------------------------------------------- timing-only streams


@dataclass(frozen=True)
class PhantomStream:
    """A stream's size without its data: ``count`` entries (at most ``width``), ``dense`` or not, over ``width``
    coordinates. On the wire: width * value_bytes if dense, else count * (value_bytes + index_bytes)."""

    count: int
    dense: bool
    width: int


class PhantomStreams:
    """The stream algebra of :class:`sim.comm.collectives.SparseStreams` under the timing-only assumption of disjoint
    supports spread evenly: a merge of a and b entries holds min(a + b, width) and is dense iff either input is or
    the rule holds for a + b (for t <= 1 the same as for min(a + b, width), so "union" and "bound" agree); a
    stream of c entries split into parts regions gives every region a piece of ceil(c / parts) entries over the
    largest region's width ceil(n / parts), dense if the stream is or the rule holds; a region sum enters the
    allgather with its entries, dense iff the rule holds over n. Compute kinds and work as the numeric algebra."""

    def __init__(self, n: int, value_bytes: int = 4, index_bytes: int = 4, dense_threshold: float = 1.0):
        self.n = int(n)
        self.vb, self.ib, self.t = int(value_bytes), int(index_bytes), float(dense_threshold)

    def dense(self, count, width) -> bool:
        return C.ssar_is_dense(count, width, self.vb, self.ib, self.t)

    def start(self, sel: PhantomStream) -> PhantomStream:
        return PhantomStream(min(sel.count, self.n), self.dense(sel.count, self.n), self.n)

    def nbytes(self, s: PhantomStream) -> int:
        return s.width * self.vb if s.dense else s.count * (self.vb + self.ib)

    def merge(self, lower: PhantomStream, upper: PhantomStream, lo: int, width: int):
        width = max(lower.width, upper.width)  # a region's pieces are all of the largest region's width
        total = lower.count + upper.count
        out = PhantomStream(min(total, width), lower.dense or upper.dense or self.dense(total, width), width)
        if lower.dense and upper.dense:
            return out, "reduce", width
        if lower.dense or upper.dense:
            return out, "reduce", upper.count if lower.dense else lower.count
        return out, "merge", total

    def split(self, s: PhantomStream, bounds) -> list:
        parts = len(bounds) - 1
        m = -(-self.n // parts)
        p = -(-s.count // parts)
        return [PhantomStream(p, s.dense or self.dense(p, m), m)] * parts

    def to_full(self, region: PhantomStream, lo: int, width: int) -> PhantomStream:
        return PhantomStream(region.count, self.dense(region.count, self.n), self.n)

    def finish(self, s):
        return None


def _ssar_rounds(spec, P: int, d: int, split: bool):
    """Both SparCML collectives on every rank at once (:mod:`sim.comm.rounds`: Work and Round data for an engine),
    with the sizes of :class:`PhantomStreams`: per-rank entry counts and dense flags, a round at a time."""
    R = np.arange(P, dtype=np.int64)
    vb, ib, t = spec.value_bytes, spec.index_bytes, spec.opt("dense_threshold")
    s_el = vb + ib

    def dense_of(c, w):
        """C.ssar_is_dense of every count c (int array (P,)) over the scalar width w, evaluated once per distinct
        count (the ranks' counts take few values)."""
        u, inv = np.unique(c, return_inverse=True)
        return np.array([C.ssar_is_dense(int(x), int(w), vb, ib, t) for x in u.tolist()], dtype=bool)[inv]
    k = min(int(spec.k), d)
    cnt = np.full(P, k, dtype=np.int64)
    dns = np.full(P, C.ssar_is_dense(k, d, vb, ib, t))

    def nbytes(c, dn, w):
        return np.where(dn, w * vb, c * s_el)

    def merge(mask, pc, pd, w):
        """Ranks in ``mask`` merge the stream (pc, pd) into theirs: the counts, flags and compute of PhantomStreams."""
        nonlocal cnt, dns
        total = cnt + pc
        both, one = dns & pd, dns ^ pd
        yield V.Work("merge", np.where(mask & ~dns & ~pd, total, 0))
        yield V.Work("reduce", np.where(mask & both, w, np.where(mask & one, np.where(dns, pc, cnt), 0)))
        new_d = dns | pd | dense_of(total, w)
        cnt = np.where(mask, np.minimum(total, w), cnt)
        dns = np.where(mask, new_d, dns)

    pof2, rem = C.pof2_split(P)
    split_done = False
    for phase, dst, src in C.rd_schedule(R, P):
        if phase == "exchange" and split and not split_done:
            region = yield from _split_phase_rounds(R, pof2, rem, cnt, dns, d, vb, s_el, t, dst >= 0)
            cnt = np.where(dst >= 0, region, cnt)
            dns = np.where(dst >= 0, C.ssar_is_dense(region, d, vb, ib, t), dns)
            split_done = True
        nb = nbytes(cnt, dns, d)
        yield V.Round(dst, src, nb)
        got = src >= 0
        sc, sd = cnt[np.maximum(src, 0)], dns[np.maximum(src, 0)]
        if phase in ("fold", "exchange"):
            yield from merge(got, sc, sd, d)
        else:  # unfold: the result
            cnt, dns = np.where(got, sc, cnt), np.where(got, sd, dns)


def _split_phase_rounds(R, pof2, rem, cnt, dns, d, vb, s_el, t, active):
    """The split phase of SSAR_Split_allgather on every rank at once (Work and Round data): pof2 - 1 pairwise rounds (newranks u and
    u XOR j) of each survivor's uniform piece, then the pof2 - 1 merges of the owner's region sum (the same on
    every survivor: one piece from each). Returns the region sum's entries."""
    m = -(-d // pof2)
    p = -(-cnt // pof2)
    ib = s_el - vb
    u_p, inv_p = np.unique(p, return_inverse=True)  # C.ssar_is_dense once per distinct piece count
    piece_dense = dns | np.array([C.ssar_is_dense(int(c), m, vb, ib, t) for c in u_p.tolist()], dtype=bool)[inv_p]
    b = np.where(piece_dense, m * vb, p * s_el)
    everyone = bool(active.all())
    if np.all(b == b[0]):
        b = int(b[0])  # the same piece size on every rank: a scalar (cheaper for an engine, the same bytes)
    u = C._rd_newrank(R, rem)
    for j in range(1, pof2):
        # with no fold (rem = 0) every rank is a survivor and _rd_real is the identity: the partner is u ^ j
        peer = u ^ j if everyone and rem == 0 else np.where(active, C._rd_real(u ^ j, rem), -1)
        yield V.Round(peer, peer, b, ("ssar-split", j))  # peer depends on P and j only (rem and active: on P)
    # the owner's merges in newrank order: the pieces of survivor w are those of real rank _rd_real(w)
    order = C._rd_real(np.arange(pof2), rem)
    pc, pd = p[order], piece_dense[order]
    rc, rd = int(pc[0]), bool(pd[0])

    def on_active(x):  # x on the survivors, 0 elsewhere (a scalar when every rank is one)
        return x if everyone else np.where(active, x, 0)

    for w in range(1, pof2):
        total = rc + int(pc[w])
        if not rd and not pd[w]:
            yield V.Work("merge", on_active(total))
        elif rd and pd[w]:
            yield V.Work("reduce", on_active(m))
        else:
            yield V.Work("reduce", on_active(int(pc[w]) if rd else rc))
        rd = rd or bool(pd[w]) or C.ssar_is_dense(total, m, vb, ib, t)
        rc = min(total, m)
    return rc

"""ScaleCom's CLT-k S-SGD: a cyclic leader's top-k indices, then an allreduce of the values at those indices.

Source: Chen, Ni, Lu, Cui, Chen, Sun, Wang, Venkataramani, Srinivasan, Zhang and Gopalakrishnan, "ScaleCom:
Scalable Sparsified Gradient Compression for Communication-Efficient Distributed Training", NeurIPS 2020,
Algorithm 1 (ScaleCom) with its low-pass filter at beta = 1 (plain error feedback), and its cyclic local top-k
compressor CLT-k: at iteration t the leader l = t mod P selects I_t = TopK indices of its own accumulator and
every worker p compresses with that index set, CLT-k(acc_p) = acc_p on I_t, 0 elsewhere. Because every worker
uses the same indices, compression commutes with the sum (sum_p CLT-k(acc_p) = CLT-k(sum_p acc_p) on I_t), so
the sum is a dense allreduce of |I_t| values (the paper's point: no gradient build-up, all-reduce compatible).

Per iteration t and worker p: acc_p = eps_p + alpha_t G_p; leader l = t mod P selects I_t = TopK(acc_l).idx
(:func:`sim.comm.compression.topk`: ties to the lower index, exact zeros never selected, so |I_t| <= k) and
broadcasts it (binomial tree rooted at l, |I_t| index_bytes bytes per message); every worker allreduces the
|I_t| values acc_p[I_t] (``ring`` or ``recursive_doubling``, value_bytes each); g = that sum scattered to I_t;
eps_p = acc_p with I_t zeroed (on every worker, leader or not). Mass is conserved: sum_p acc_p = g + sum_p eps_p.
With layer-wise segments every segment of a step has the same leader.

Not modelled: ScaleCom's low-pass filter m_p <- (1 - beta) m_p + beta (acc_p - CLT-k(acc_p)) for beta < 1
(beta = 1 here). There is no public code of the authors to compare with (docs/algorithms/cltk.md).

Cost (contention-free, zero compute; :func:`sim.comm.costs.cltk_time`): ceil(lg P) (alpha + k index_bytes beta) plus
the allreduce of k values. The timing-only mode, the fast engine and the closed form assume |I_t| = k; the
timing-only leader also rotates (t mod P, t counted from 1 per simulation). Compute: the leader's ``select``
over d_b elements; the allreduce's ``reduce`` of the values.
"""
from __future__ import annotations

import numpy as np

from sim.comm import collectives as C
from sim.comm import rounds as V
from sim.comm.compression import topk
from sim.base.ops import Compute, Recv, Send
from sim.algorithms.base import Algorithm, Exchange, register

__all__ = ["CLTK", "leader", "bcast_from"]


def leader(iteration: int, P: int) -> int:
    """The CLT-k leader of iteration t (>= 1) among P ranks: t mod P (ScaleCom's cyclic rule)."""
    return int(iteration) % int(P)


def bcast_from(rank: int, P: int, root: int, item, nbytes_of):
    """Binomial-tree broadcast of ``item`` (``nbytes_of(item)`` bytes on the wire) from ``root`` to every rank,
    the tree of :func:`sim.comm.collectives.binomial_bcast_schedule` on ranks relative to the root ((rank - root) mod
    P): ceil(lg P) rounds, the root sending in each. ``item`` is read on the root only. A sans-I/O program
    returning the item on every rank; cost :func:`sim.comm.costs.binomial_bcast_time`."""
    pos = (rank - root) % P
    for _, dst, src in C.binomial_bcast_schedule(pos, P):
        if src >= 0:
            item = yield Recv((src + root) % P)
        if dst >= 0:
            yield Send((dst + root) % P, item, nbytes_of(item))
    return item


@register
class CLTK(Algorithm):
    """ScaleCom's CLT-k (NeurIPS 2020, Algorithm 1 at beta = 1): leader t mod P's top-k indices broadcast, the
    values at them allreduced (ring or recursive doubling); eps_p = acc_p with those indices zeroed."""

    name = "cltk"
    cost_kinds = ("select", "reduce")  # the leader's selection and the allreduce's additions; nothing is merged
    collectives = ("ring", "recursive_doubling")
    summary = "ScaleCom's CLT-k: a cyclic leader's top-k indices broadcast, the k values at them allreduced"
    source = "Chen et al. NeurIPS 2020 (ScaleCom), Algorithm 1 with beta = 1, cyclic local top-k (CLT-k)"

    def _allreduce(self, spec, rank, P, vals):
        if spec.collective == "ring":
            return (yield from C.ring_allreduce(rank, P, vals, spec.value_bytes))
        return (yield from C.rd_allreduce(rank, P, vals, spec.value_bytes))

    def exchange(self, spec, acc, k, ctx):
        rank, P = ctx.rank, ctx.P
        root = leader(ctx.iteration, P)
        idx = None
        if rank == root:
            yield Compute("select", acc.shape[0])
            idx = topk(acc, k).idx
        ib = spec.index_bytes
        idx = yield from bcast_from(rank, P, root, idx, lambda a: a.shape[0] * ib)
        s = yield from self._allreduce(spec, rank, P, acc[idx])
        g = np.zeros_like(acc)
        g[idx] = s
        res = acc.copy()
        res[idx] = 0.0
        m = int(idx.shape[0])
        return Exchange(g, res, m, m)

    def fast_rounds(self, spec, P, d, it, G):
        R = np.arange(P, dtype=np.int64)
        root = leader(it, P)
        k, vb = spec.k, spec.value_bytes
        yield V.Work("select", np.where(R == root, d, 0))
        yield from V.bcast_rounds(R, P, root, k * spec.index_bytes)
        if spec.collective == "ring":
            yield from V.ring_allreduce_rounds(R, P, k, vb)
        else:
            yield from V.rd_allreduce_rounds(R, P, k, vb)

    def closed_form_s(self, spec, P, d, alpha, beta, cluster=None):
        from sim.comm import costs

        return costs.cltk_time(P, spec.k, alpha, beta, spec.value_bytes, spec.index_bytes, spec.collective)

    def payload_bytes(self, spec, numel, k):
        """k values per rank (the leader also broadcasts its k indices)."""
        return int(k) * spec.value_bytes

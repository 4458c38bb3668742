"""gTop-k S-SGD: a global top-k of the summed selections, merged pairwise along a tree.

acc_p = eps_p + alpha_t G_p; (g, gMask_p) = gTopK(TopK(acc_1), ..., TopK(acc_P)); eps_p = acc_p * (1 - gMask_p)
(Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for Low Bandwidth
Networks", ICDCS 2019, Algorithms 2-3; convergence: Shi et al. IJCAI 2019, Algorithm 1). Every merge of two
k-entry vectors sums them and keeps the k largest magnitudes. Collectives: ``tree`` (binomial reduce +
broadcast, 2 lg P rounds), ``recursive_doubling`` (lg P rounds) and ``hierarchical`` (node tree, inter-node
recursive doubling, node broadcast). Mask rule ``exact`` (gMask_p: the local entries that reached g; mass is
conserved) or ``reference`` (the released code's rule: every local top-k entry whose index is in g's support,
which can lose mass on purpose so the loss can be measured).
"""
from __future__ import annotations

import numpy as np

from sim.comm import collectives as C
from sim.comm import rounds as V
from sim.comm.compression import Sparse, topk
from sim.base.ops import Compute
from sim.algorithms.base import Algorithm, Exchange, register


@register
class GTopK(Algorithm):
    """gTop-k S-SGD (ICDCS 2019 Algorithms 2-3) with the exact or the released code's residual mask."""

    name = "gtopk"
    collectives = ("tree", "recursive_doubling", "hierarchical")
    cost_kinds = ("select", "merge")  # the local selection and the pairwise merges; no dense reduction
    predict_columns = {"gtopk_tree": "tree", "gtopk_rd": "recursive_doubling", "hier_gtopk": "hierarchical"}
    summary = "gTop-k S-SGD: global top-k by pairwise merges along a tree / recursive doubling"
    source = "Shi et al. ICDCS 2019, Algorithms 2-3; Shi et al. IJCAI 2019, Algorithm 1"

    aliases = {"gtopk_reference": {"mask": "reference"}}
    uses_mask = True
    hook_combine = "gtopk"
    hook_collectives = ("tree", "recursive_doubling")
    hook_checks_all = False

    def hook_select(self, acc, k, hook_state=None):
        from sim.algorithms.topk import select_topk_torch

        return select_topk_torch(acc, k)

    def scenario_settings(self, compression):
        return {"collective": compression.gtopk_collective, "mask": compression.gtopk_mask}

    def label_tags(self, spec):
        return ["reference"] if spec.mask == "reference" else []

    def drops_mass(self, spec):
        return spec.mask == "reference"

    def exchange(self, spec, acc, k, ctx):
        for kind, work in self.compression_work(spec, acc.shape[0], k):  # its top-k selection
            yield Compute(kind, work)
        sel = topk(acc, k)
        res = yield from gtopk_collective(spec, ctx.rank, ctx.P, sel, k)
        new_res = acc.copy()
        # res.applied already follows the mask rule: exact (what reached g) or the released
        # reference code's (every local top-k entry whose index is in g)
        new_res[sel.idx[res.applied]] = 0.0
        return Exchange(res.g.to_dense(), new_res, len(sel), int(res.applied.sum()))

    def fast_rounds(self, spec, P, d, it, G):
        for kind, work in self.compression_work(spec, d, spec.k):  # its top-k selection
            yield V.Work(kind, work)
        R = np.arange(P, dtype=np.int64)
        k = spec.k
        s_el = spec.value_bytes + spec.index_bytes
        b = C.mask_nbytes(k) if spec.mask == "exact" else 0
        if spec.collective == "tree":
            yield from V.gtopk_tree_rounds(R, P, k, s_el, b)
        elif spec.collective == "recursive_doubling":
            yield from V.gtopk_rd_rounds(R, P, k, s_el, b)
        else:  # hierarchical
            yield from V.hier_gtopk_rounds(R, P, G, k, s_el, b)

    def closed_form_s(self, spec, P, d, alpha, beta, cluster=None):
        from sim.comm import costs
        from sim.algorithms.dense import hier_params

        vb, ib, exact = spec.value_bytes, spec.index_bytes, spec.mask == "exact"
        if spec.collective == "hierarchical":
            G, _, (ai, bi), (ae, be) = hier_params(spec, alpha, beta, cluster)
            return costs.hier_gtopk_time(P // G, G, spec.k, ai, bi, ae, be, vb, ib, exact)
        if spec.collective == "tree":
            return costs.gtopk_tree_time(P, spec.k, alpha, beta, vb, ib, exact)
        return costs.gtopk_rd_time(P, spec.k, alpha, beta, vb, ib, exact)


def gtopk_collective(spec, rank: int, P: int, sel: Sparse, k: int | None = None):
    """The gTop-k collective ``spec.collective`` (tree, recursive_doubling or hierarchical) on ``sel`` (this rank's
    selection), keeping k entries (default ``spec.k``; a segment's k_b with layer-wise selection). A sans-I/O
    program returning :class:`sim.comm.collectives.GTopKResult`."""
    k = spec.k if k is None else k
    kw = dict(exact=spec.mask == "exact", value_bytes=spec.value_bytes, index_bytes=spec.index_bytes)
    if spec.collective == "hierarchical":
        return (yield from C.hier_gtopk(rank, P, spec.gpus_per_node, sel, k, **kw))
    coll = C.gtopk_tree if spec.collective == "tree" else C.gtopk_rd
    return (yield from coll(rank, P, sel, k, **kw))

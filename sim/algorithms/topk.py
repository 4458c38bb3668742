"""Top-k S-SGD with error feedback: every worker sends its k largest-magnitude accumulator entries,
the selections are allgathered and summed.

acc_p = eps_p + alpha_t G_p; g = sum_q TopK(acc_q) (allgather); eps_p = acc_p - TopK(acc_p)
(Shi et al. IJCAI 2019, Algorithm 1 with TopK in place of gTopK; Aji and Heafield 2017; the
allgather as in Renggli et al. SC 2019's Top-k baseline). Collectives: ``allgather`` (Bruck: ceil(lg P)
rounds) and ``hierarchical`` (node gather, inter-node Bruck, node broadcast).
"""
from __future__ import annotations

import numpy as np

from sim.comm import collectives as C
from sim.comm import rounds as V
from sim.comm.compression import Sparse, topk
from sim.base.ops import Compute
from sim.algorithms.base import Algorithm, Exchange, register


class AllgatherSparse(Algorithm):
    """Shared shape of the algorithms that allgather each worker's own k-entry selection and sum it
    (Top-k, rand-k, Gaussian-k, DGC): subclasses define :meth:`select`, and their compression cost
    (:meth:`~sim.algorithms.base.Algorithm.compression_work`, charged before the selection) where it is not a
    top-k's."""

    trace_name = "allgather"
    collectives = ("allgather", "hierarchical")
    cost_kinds = ("select", "reduce")  # the selection, and the sum of the P gathered selections; no merge

    def scenario_settings(self, compression):
        return {"collective": compression.topk_collective}

    def select(self, spec, acc: np.ndarray, k: int, ctx) -> Sparse:
        """This worker's k entries of the segment ``acc`` (float array (d_b,))."""
        raise NotImplementedError

    def exchange(self, spec, acc, k, ctx):
        for kind, work in self.compression_work(spec, acc.shape[0], k):
            yield Compute(kind, work)
        sel = self.select(spec, acc, k, ctx)
        vb, ib = spec.value_bytes, spec.index_bytes
        if spec.collective == "hierarchical":
            g = yield from C.hier_topk_allgather_sum(ctx.rank, ctx.P, spec.gpus_per_node, sel, vb, ib)
        else:
            g = yield from C.topk_allgather_sum(ctx.rank, ctx.P, sel, vb, ib)
        res = acc.copy()
        res[sel.idx] = 0.0
        return Exchange(g, res, len(sel), len(sel))

    def fast_rounds(self, spec, P, d, it, G):
        for kind, work in self.compression_work(spec, d, spec.k):
            yield V.Work(kind, work)
        R = np.arange(P, dtype=np.int64)
        s_el = spec.value_bytes + spec.index_bytes
        if spec.collective == "hierarchical":
            yield from V.hier_topk_allgather_rounds(R, P, G, spec.k, s_el)
        else:
            yield from V.topk_allgather_rounds(R, P, spec.k, s_el)

    def closed_form_s(self, spec, P, d, alpha, beta, cluster=None):
        from sim.comm import costs
        from sim.algorithms.dense import hier_params

        vb, ib = spec.value_bytes, spec.index_bytes
        if spec.collective == "hierarchical":
            G, _, (ai, bi), (ae, be) = hier_params(spec, alpha, beta, cluster)
            return costs.hier_topk_time(P // G, G, spec.k, ai, bi, ae, be, vb, ib)
        return costs.topk_allgather_time(P, spec.k, alpha, beta, vb, ib)


@register
class TopK(AllgatherSparse):
    """Top-k S-SGD: the k largest |acc_p| entries (ties to the lower index, exact zeros never selected),
    allgathered and summed; eps_p = acc_p - TopK(acc_p)."""

    name = "topk"
    predict_columns = {"allgather": "allgather", "hier_topk": "hierarchical"}
    summary = "Top-k S-SGD with error feedback: allgather of each worker's k largest entries"
    source = "Shi et al. IJCAI 2019, Algorithm 1 (TopK); Aji and Heafield 2017"

    hook_combine = "sum"
    hook_checks_all = False

    def select(self, spec, acc, k, ctx):
        return topk(acc, k)

    def hook_select(self, acc, k, hook_state=None):
        return select_topk_torch(acc, k)


def select_topk_torch(acc, k: int):
    """TopK(acc) on a torch tensor: the k largest |acc_i|, ties to the lower index, exact zeros never selected.

    acc: 1-D float tensor (n,), no NaN; k: 1 <= k <= n. Returns (idx, val): int64 tensor (m,) ascending,
    m <= k, and acc at idx (acc's dtype and device). On CPU (float32/float64) it is
    :func:`sim.comm.compression.topk` (the exact one-pass selection) on a zero-copy numpy view of acc; elsewhere
    :func:`sim.comm.torch_kernels.topk_torch` (``torch.topk`` for the k-th magnitude, then the tie rule) -- the
    same indices and values. Raises NonFiniteError naming the first NaN coordinate. Used by the DDP hooks of
    Top-k and gTop-k (:mod:`sim.distributed.ddp_hooks`)."""
    import torch

    if acc.device.type == "cpu" and acc.dtype in (torch.float32, torch.float64):
        s = topk(acc.detach().numpy(), int(k))
        return torch.from_numpy(s.idx), torch.from_numpy(s.val)
    from sim.comm.torch_kernels import topk_torch

    return topk_torch(acc, int(k))

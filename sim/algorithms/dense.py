"""Dense S-SGD: every worker's full gradient summed by an allreduce (the baseline).

g = allreduce(alpha_t G_p), residual 0 (Shi et al. IJCAI 2019, section 2; docs/theory.md section 2).
Collectives: ``ring`` (Patarasuk and Yuan 2009; the ring of Baidu / NCCL), ``recursive_doubling``
(Thakur, Rabenseifner and Gropp 2005), ``hierarchical`` (intra-node reduce-scatter, inter-node ring,
intra-node allgather: :func:`sim.comm.collectives.hier_allreduce`), and ``backend_allreduce`` (the torch
backend's ``dist.all_reduce``; not a message-level model, so the simulated drivers refuse it).
"""
from __future__ import annotations

import numpy as np

from sim.comm import collectives as C
from sim.comm import rounds as V
from sim.base.errors import SparsimError
from sim.base.ops import AllReduce
from sim.algorithms.base import Algorithm, Exchange, register


@register
class Dense(Algorithm):
    """Dense S-SGD: allreduce of the whole accumulator (alpha_t G_p); the residual stays 0."""

    name = "dense"
    trace_name = "allreduce"
    collectives = ("ring", "recursive_doubling", "backend_allreduce", "hierarchical")
    sparse = False
    segmented = False
    cost_kinds = ("reduce",)  # the allreduce's additions; nothing selected or merged
    predict_columns = {"ring": "ring", "recursive_doubling": "recursive_doubling", "hier_dense": "hierarchical"}
    summary = "dense S-SGD: allreduce of the full gradient (ring, recursive doubling, hierarchical)"
    source = "Shi et al. IJCAI 2019, section 2; Thakur, Rabenseifner and Gropp 2005 (allreduce costs)"

    def scenario_settings(self, compression):
        return {"collective": compression.dense_collective}

    def label_tags(self, spec):
        return ["backend_allreduce"] if spec.collective == "backend_allreduce" else []

    def exchange(self, spec, acc, k, ctx):
        rank, P, vb = ctx.rank, ctx.P, spec.value_bytes
        if spec.collective == "ring":
            g = yield from C.ring_allreduce(rank, P, acc, vb)
        elif spec.collective == "hierarchical":
            g = yield from C.hier_allreduce(rank, P, spec.gpus_per_node, acc, vb)
        elif spec.collective == "backend_allreduce":  # torch backend only: dist.all_reduce
            g = yield AllReduce(acc, acc.shape[0] * vb)
        else:
            g = yield from C.rd_allreduce(rank, P, acc, vb)
        n = acc.shape[0]
        return Exchange(g, np.zeros_like(acc), n, n)

    def fast_rounds(self, spec, P, d, it, G):
        R = np.arange(P, dtype=np.int64)
        vb = spec.value_bytes
        coll = spec.collective
        if coll == "ring":
            return V.ring_allreduce_rounds(R, P, d, vb)
        if coll == "recursive_doubling":
            return V.rd_allreduce_rounds(R, P, d, vb)
        if coll == "hierarchical":
            return V.hier_allreduce_rounds(R, P, G, d, vb)
        raise SparsimError(f"collective = {coll!r} has no timing-only mode: valid ring, recursive_doubling, hierarchical")

    def closed_form_s(self, spec, P, d, alpha, beta, cluster=None):
        from sim.comm import costs

        vb = spec.value_bytes
        if spec.collective == "hierarchical":
            G, share, (ai, bi), (ae, be) = hier_params(spec, alpha, beta, cluster)
            return costs.hier_allreduce_time(P // G, G, d, ai, bi, ae, be, vb, nic_share=share)
        if spec.collective == "ring":
            return costs.ring_allreduce_time(P, d, alpha, beta, vb)
        if spec.collective == "recursive_doubling":
            return costs.rd_allreduce_time(P, d * vb, alpha, beta)
        raise SparsimError(f"collective = {spec.collective!r} has no closed form: valid ring, recursive_doubling, "
                           "hierarchical")

    def payload_bytes(self, spec, numel, k):
        return int(numel) * spec.value_bytes


def hier_params(spec, alpha, beta, cluster):
    """(G, nic_share, (alpha_i, beta_i), (alpha_e, beta_e)) of a hierarchical closed form: the cluster's when
    given, else ``spec.gpus_per_node`` ranks per node with alpha and beta everywhere."""
    if cluster is not None:
        return (cluster.gpus_per_node, cluster.gpus_per_node // cluster.nics_per_node, cluster.intra_alpha_beta(),
                cluster.inter_alpha_beta())
    return spec.gpus_per_node, 1, (alpha, beta), (alpha, beta)

"""Message-level collectives on the SimPy network equal their closed forms (docs/costs.md)."""
import numpy as np
import pytest

from sim.comm import costs
from sim.engine.cluster import SimCluster
from sim.comm.collectives import bruck_allgather, gtopk_rd, gtopk_tree, rd_allreduce, ring_allreduce, topk_allgather_sum
from sim.comm.compression import topk
from sim.machine.network import NetworkSpec

PS = list(range(1, 17)) + [31, 32, 33]
ALPHA, BETA = 0.436e-3, 9e-9  # the 1 GbE preset


def _time(P, make, topology="star", alpha=ALPHA, beta=BETA):
    cl = SimCluster(P, NetworkSpec.from_alpha_beta(alpha, beta, topology))
    res, finish = cl.run_programs([make(r) for r in range(P)])
    return res, float(finish.max())


def _sels(P, d, k, seed=0):
    rng = np.random.default_rng(seed)
    # distinct non-zero magnitudes so every selection and every merge holds exactly k entries
    return [topk(rng.standard_normal(d) + 0.0, k) for _ in range(P)]


@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("topology", ["star", "direct"])
def test_dense_allreduce_closed_forms(P, topology):
    d = 12 * P  # n divisible by P
    xs = np.random.default_rng(P).standard_normal((P, d))
    _, t = _time(P, lambda r: ring_allreduce(r, P, xs[r]), topology)
    n = 4 * d
    assert t == pytest.approx(2 * (P - 1) * ALPHA + 2 * n * (P - 1) / P * BETA, rel=1e-12, abs=1e-15)
    assert t == pytest.approx(costs.ring_allreduce_time(P, d, ALPHA, BETA), rel=1e-12, abs=1e-15)
    _, t = _time(P, lambda r: rd_allreduce(r, P, xs[r]), topology)
    assert t == pytest.approx(costs.rd_allreduce_time(P, n, ALPHA, BETA), rel=1e-12, abs=1e-15)
    if P & (P - 1) == 0:
        assert t == pytest.approx(np.log2(P) * (ALPHA + n * BETA), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("P", [3, 5, 7, 12])
def test_ring_allreduce_uneven_chunks_paced_by_largest(P):
    d = 10 * P + 3
    xs = np.random.default_rng(P).standard_normal((P, d))
    _, t = _time(P, lambda r: ring_allreduce(r, P, xs[r]))
    assert t == pytest.approx(costs.ring_allreduce_time(P, d, ALPHA, BETA), rel=1e-12)


@pytest.mark.parametrize("P", PS)
def test_sparse_collectives_closed_forms(P):
    d, k = 400, 16
    sels = _sels(P, d, k)
    _, t = _time(P, lambda r: topk_allgather_sum(r, P, sels[r]))
    assert t == pytest.approx(costs.topk_allgather_time(P, k, ALPHA, BETA), rel=1e-12, abs=1e-15)
    if P & (P - 1) == 0:
        assert t == pytest.approx(np.log2(P) * ALPHA + (P - 1) * k * 8 * BETA, rel=1e-12, abs=1e-15)
    for exact in (True, False):
        _, t = _time(P, lambda r: gtopk_tree(r, P, sels[r], k, exact=exact))
        assert t == pytest.approx(costs.gtopk_tree_time(P, k, ALPHA, BETA, exact=exact), rel=1e-12, abs=1e-15)
        if P & (P - 1) == 0 and not exact:  # ICDCS 2019: 2 lg P (alpha + k s beta)
            assert t == pytest.approx(2 * np.log2(P) * (ALPHA + k * 8 * BETA), rel=1e-12, abs=1e-15)
        _, t = _time(P, lambda r: gtopk_rd(r, P, sels[r], k, exact=exact))
        assert t == pytest.approx(costs.gtopk_rd_time(P, k, ALPHA, BETA, exact=exact), rel=1e-12, abs=1e-15)
        if P & (P - 1) == 0:
            assert t == pytest.approx(np.log2(P) * (ALPHA + k * 8 * BETA), rel=1e-12, abs=1e-15)


def test_message_sizes_come_from_payload_and_element_bytes():
    """16-byte elements (the released code's int64+fp32 packed as fp64 pairs) double the beta term."""
    P, d, k = 8, 300, 10
    sels = _sels(P, d, k)
    _, t8 = _time(P, lambda r: gtopk_rd(r, P, sels[r], k))
    _, t16 = _time(P, lambda r: gtopk_rd(r, P, sels[r], k, value_bytes=8, index_bytes=8))
    assert t16 - t8 == pytest.approx(3 * k * 8 * BETA, rel=1e-9)


def test_bruck_allgather_variable_sizes_identical_everywhere():
    P = 6
    items = [list(range(r)) for r in range(P)]  # rank r contributes r elements (rank 0: empty)
    cl = SimCluster(P, NetworkSpec.from_alpha_beta(ALPHA, BETA))
    res, _ = cl.run_programs([bruck_allgather(r, P, items[r], len) for r in range(P)])
    assert all(x == items for x in res)

"""Timing-only mode (sim.engine.timing): collective times equal the closed forms; equal to real-data runs at small d."""
import numpy as np
import pytest

from sim.comm import costs
from sim.algorithms import AlgorithmSpec, sgd_step
from sim.engine.cluster import SimCluster
from sim.comm.collectives import ring_allreduce
from sim.machine.compute import ComputeModel
from sim.base.errors import SparsimError
from sim.machine.network import PRESETS, NetworkSpec
from sim.comm.payloads import phantom_dense, random_selection
from sim.engine.timing import closed_form_comm_s, simulate_timing

NET = PRESETS["1GbE"]
ALPHA, BETA = NET.end_to_end_alpha_beta()
PS = list(range(1, 10)) + [16, 32]


def _specs(k):
    return [AlgorithmSpec("dense", collective="ring"), AlgorithmSpec("dense", collective="recursive_doubling"),
            AlgorithmSpec("topk", k=k), AlgorithmSpec("gtopk", k=k, collective="tree"),
            AlgorithmSpec("gtopk", k=k, collective="tree", mask="reference", value_bytes=8, index_bytes=8),
            AlgorithmSpec("gtopk", k=k, collective="recursive_doubling")]


@pytest.mark.parametrize("P", PS)
def test_timing_only_collective_equals_closed_form(P):
    d, k = 10_007, 37  # d not divisible by P: the ring is paced by the largest chunk
    for spec in _specs(k):
        t = simulate_timing(spec, P, d, network=NET).iter_s[0]  # zero compute: the collective alone
        assert t == pytest.approx(closed_form_comm_s(spec, P, d, ALPHA, BETA), rel=1e-12, abs=1e-15), spec
    # and the named closed forms of sim.comm.costs for the three ICDCS algorithms
    assert simulate_timing(_specs(k)[0], P, d, network=NET).iter_s[0] == pytest.approx(
        costs.ring_allreduce_time(P, d, ALPHA, BETA), rel=1e-12, abs=1e-15)
    assert simulate_timing(_specs(k)[2], P, d, network=NET).iter_s[0] == pytest.approx(
        costs.topk_allgather_time(P, k, ALPHA, BETA), rel=1e-12, abs=1e-15)
    assert simulate_timing(_specs(k)[3], P, d, network=NET).iter_s[0] == pytest.approx(
        costs.gtopk_tree_time(P, k, ALPHA, BETA), rel=1e-12, abs=1e-15)
    # rand-k allgathers its k entries exactly as Top-k does (it once ran gTop-k's collective here)
    rk = simulate_timing(AlgorithmSpec("randk", k=k), P, d, network=NET)
    assert rk.iter_s[0] == pytest.approx(costs.topk_allgather_time(P, k, ALPHA, BETA), rel=1e-12, abs=1e-15)
    assert rk.messages == simulate_timing(_specs(k)[2], P, d, network=NET).messages


def test_full_size_models_without_memory():
    """AlexNet's d = 61M: the phantom holds no bytes, the ring still moves 4 bytes per value."""
    d = 61_000_000
    x = phantom_dense(d)
    assert x.shape[0] == d and x.nbytes == 0
    for P in (4, 32):
        t = simulate_timing(AlgorithmSpec("dense"), P, d, network=NET).iter_s[0]
        assert t == pytest.approx(costs.ring_allreduce_time(P, d, ALPHA, BETA), rel=1e-12)
        assert t == pytest.approx(2 * (P - 1) * ALPHA + 2 * 4 * d * (P - 1) / P * BETA, rel=1e-12)
    t = simulate_timing(AlgorithmSpec("gtopk", k=61_000), 8, d, network=NET).iter_s[0]
    assert t == pytest.approx(costs.gtopk_tree_time(8, 61_000, ALPHA, BETA), rel=1e-12)


def test_phantom_runs_ring_allreduce_unchanged():
    P, d = 5, 23
    cl = SimCluster(P, NET)
    res, _ = cl.run_programs([ring_allreduce(r, P, phantom_dense(d)) for r in range(P)])
    assert all(r.shape == (d, 0) for r in res)
    assert int(cl.net.bytes_sent.sum()) == 2 * (P - 1) * d * 4  # every value crosses 2(P-1)/P links, P ranks


def test_random_selection():
    s = random_selection(50, 1000, np.random.default_rng(0))
    assert len(s) == 50 and s.d == 1000 and np.all(np.diff(s.idx) > 0) and np.all(s.val > 0)
    with pytest.raises(SparsimError):
        random_selection(0, 10, np.random.default_rng(0))
    with pytest.raises(SparsimError):
        phantom_dense(0)


CM = ComputeModel(forward_backward_s=0.013, select_coeff_s=2.19e-10, merge_coeff_s=3e-9, reduce_coeff_s=2e-9,
                  update_coeff_s=1e-9)


def _real_time(spec, P, d, iterations=2):
    """Simulated iteration times of the real sgd_step (real gradients, accumulators and selections)."""
    cl = SimCluster(P, NET, CM)
    v = np.zeros(d)
    res = [np.zeros(d) for _ in range(P)]
    times = []
    for it in range(1, iterations + 1):
        grads = [np.random.default_rng([7, r, it]).standard_normal(d) for r in range(P)]
        t0 = cl.env.now
        outs, fin = cl.run_programs([sgd_step(spec, r, P, v, res[r], (lambda g: lambda _v: g)(grads[r]), 8, 0.1, it)
                                     for r in range(P)], iteration=it)
        times.append(float(fin.max()) - t0)
        v, res = outs[0].v, [o.residual for o in outs]
    return np.array(times)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 6, 8])
def test_timing_only_equals_real_data_run(P):
    """Same compute model, same d: timing-only and the real S-SGD step give the same simulated time."""
    d, k = 3000, 30
    for spec in _specs(k):
        real = _real_time(spec, P, d)
        timing = simulate_timing(spec, P, d, network=NET, compute=CM, batch_size=8, iterations=2).iter_s
        np.testing.assert_allclose(timing, real, rtol=1e-12, atol=1e-15, err_msg=spec.label)


def test_iterations_are_identical_and_categories_add_up():
    spec = AlgorithmSpec("gtopk", k=100)
    r = simulate_timing(spec, 8, 100_000, network=NET, compute=CM, iterations=3)
    assert np.ptp(r.iter_s) < 1e-12
    # rank 0 (the tree's root) is on the critical path: compute + compress + comm = the iteration
    assert r.compute_s + r.compress_s + r.comm_s == pytest.approx(r.iter_s[0], rel=1e-12)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_derived_timing_program_equals_real_data_run_beyond_the_icdcs_three(P):
    """The timing-only per-rank programs are derived from each algorithm's one vectorised definition
    (sim.engine.timing.rank_program of fast_rounds): for the collectives whose sizes do not depend on the data
    (CLT-k's leader broadcast and allreduce, PowerSGD's two allreduces, rand-k's allgather) they give the real
    S-SGD step's simulated time, compute included."""
    d, k = 3000, 30
    for spec in (AlgorithmSpec("cltk", k=k, collective="ring"), AlgorithmSpec("cltk", k=k, collective="recursive_doubling"),
                 AlgorithmSpec("powersgd", collective="ring"), AlgorithmSpec("randk", k=k)):
        iters = 2 * P + 1 if spec.name == "cltk" else 2  # CLT-k's leader visits every rank
        real = _real_time(spec, P, d, iterations=iters)
        timing = simulate_timing(spec, P, d, network=NET, compute=CM, batch_size=8, iterations=iters).iter_s
        np.testing.assert_allclose(timing, real, rtol=1e-12, atol=1e-15, err_msg=spec.label)

"""ScaleCom's CLT-k (sim/algorithms/cltk.py): the exact identities of the paper's compressor (the leader's top-k
indices applied by every worker, compression commuting with the sum, CLT-k = Top-k when every worker holds the
same accumulator or P = 1), error feedback's mass, the rotating leader, and the closed form (broadcast of k
indices + allreduce of k values) against the timing-only simulation with a compute model."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sim.comm import costs
from sim.algorithms import AlgorithmSpec, StepContext, get
from sim.algorithms.cltk import leader
from sim.comm.compression import topk
from sim.machine.compute import ComputeModel
from sim.workloads.data import shard_indices
from sim.engine.drivers import run_lockstep
from sim.base.errors import ConfigError
from sim.machine.network import PRESETS
from sim.workloads.objectives import make_objective
from sim.engine.runner import Workers, run_algorithm
from sim.engine.timing import closed_form_comm_s, simulate_timing

NET = PRESETS["1GbE"]
ALPHA, BETA = NET.end_to_end_alpha_beta()
#: small integers times powers of two: every sum below is exact, so identities hold bit for bit
dyadic = st.integers(-64, 64).map(lambda i: i / 4.0)


def _exchange(spec, accs, k, t):
    algo = get("cltk")
    n = accs[0].shape[0]
    P = len(accs)
    return run_lockstep([algo.exchange(spec, a, k, StepContext(p, P, t, n, 0, 0, n)) for p, a in enumerate(accs)])


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(1, 30), st.integers(1, 20), st.sampled_from(["ring", "recursive_doubling"]),
       st.data())
def test_the_leaders_indices_commute_with_the_sum_and_mass_is_conserved(P, n, t, coll, data):
    """I = TopK(acc_{t mod P}).idx; g = (sum_p acc_p) on I, 0 elsewhere, on every rank; eps_p = acc_p off I, 0 on I;
    sum_p acc_p = g + sum_p eps_p exactly (dyadic values)."""
    k = data.draw(st.integers(1, n))
    accs = [data.draw(hnp.arrays(np.float64, n, elements=dyadic)) for _ in range(P)]
    outs = _exchange(AlgorithmSpec("cltk", k=k, collective=coll), accs, k, t)
    idx = topk(accs[leader(t, P)], k).idx
    total = sum(accs)
    expect = np.zeros(n)
    expect[idx] = total[idx]
    for p, o in enumerate(outs):
        np.testing.assert_array_equal(o.g, expect)
        res = accs[p].copy()
        res[idx] = 0.0
        np.testing.assert_array_equal(o.residual, res)
        assert o.n_selected == o.n_applied == idx.shape[0] <= k
    np.testing.assert_array_equal(total, outs[0].g + sum(o.residual for o in outs))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 30), st.integers(1, 20), st.data())
def test_identical_accumulators_make_cltk_topk(P, n, t, data):
    """Every worker holds the same accumulator: whoever leads, CLT-k selects Top-k's indices, g = P TopK(acc)
    and eps_p = acc - TopK(acc) (the case where the paper's contraction is Top-k's: 1 - k/d)."""
    k = data.draw(st.integers(1, n))
    acc = data.draw(hnp.arrays(np.float64, n, elements=dyadic))
    outs = _exchange(AlgorithmSpec("cltk", k=k), [acc.copy() for _ in range(P)], k, t)
    sel = topk(acc, k)
    dense = sel.to_dense()
    for o in outs:
        np.testing.assert_array_equal(o.g, P * dense)
        np.testing.assert_array_equal(o.residual, acc - dense)
    s = P * acc
    assert float((s - outs[0].g) @ (s - outs[0].g)) <= (1 - k / n) * float(s @ s)


def test_one_worker_is_topk():
    """P = 1: CLT-k is Top-k S-SGD with error feedback (Mem-SGD), row for row."""
    obj = make_objective("sines", d=40, n=32, seed=2)
    w = Workers(obj, shard_indices(obj.n, 1, seed=2), 4, 2)
    a = run_algorithm(AlgorithmSpec("cltk", k=6), w, T=10, lr=lambda t: 0.05, x0=obj.x0(2), driver="lockstep")
    b = run_algorithm(AlgorithmSpec("topk", k=6), w, T=10, lr=lambda t: 0.05, x0=obj.x0(2), driver="lockstep")
    keys = ("loss", "residual_norm_sq", "delta", "applied_fraction", "mass_error")
    assert [[r[c] for c in keys] for r in a] == [[r[c] for c in keys] for r in b]


def test_the_leader_rotates_over_iterations():
    """Step t uses rank t mod P's top-k indices (P = 3, distinct accumulators)."""
    rng = np.random.default_rng(0)
    accs = [rng.standard_normal(50) for _ in range(3)]
    for t in range(1, 7):
        outs = _exchange(AlgorithmSpec("cltk", k=5), accs, 5, t)
        np.testing.assert_array_equal(np.flatnonzero(outs[0].g), topk(accs[t % 3], 5).idx)


@pytest.mark.parametrize("coll", ["ring", "recursive_doubling"])
@pytest.mark.parametrize("P", [1, 2, 3, 6, 8, 13])
def test_closed_form_is_a_broadcast_of_k_indices_plus_an_allreduce_of_k_values(P, coll):
    d, k = 20_011, 301
    spec = AlgorithmSpec("cltk", k=k, collective=coll, index_bytes=4, value_bytes=4)
    ar = costs.ring_allreduce_time(P, k, ALPHA, BETA, 4) if coll == "ring" else costs.rd_allreduce_time(
        P, 4 * k, ALPHA, BETA)
    cf = costs.ceil_lg(P) * (ALPHA + 4 * k * BETA) + ar
    assert closed_form_comm_s(spec, P, d, ALPHA, BETA) == pytest.approx(cf, rel=1e-15)
    for engine in ("message", "fast"):
        assert simulate_timing(spec, P, d, network=NET, engine=engine).iter_s[0] == pytest.approx(cf, rel=1e-12)
    # with a selection cost only the leader pays it, once per iteration, and the leader rotates in both engines
    cm = ComputeModel(select_coeff_s=1e-9, reduce_coeff_s=1e-9, jitter="lognormal", jitter_scale=0.3,
                      forward_backward_s=1e-3)
    msg = simulate_timing(spec, P, d, network=NET, compute=cm, iterations=2 * P + 1, engine="message")
    fast = simulate_timing(spec, P, d, network=NET, compute=cm, iterations=2 * P + 1, engine="fast")
    np.testing.assert_allclose(fast.iter_s, msg.iter_s, rtol=1e-9)
    assert (fast.messages, fast.bytes) == (msg.messages, msg.bytes)


def test_bad_collective_is_one_line():
    with pytest.raises(ConfigError, match="collective = 'allgather' is not available for cltk: valid ring, "
                                          "recursive_doubling"):
        AlgorithmSpec("cltk", k=3, collective="allgather")

"""S-SGD numerics: mass conservation, the auxiliary sequence, gTop-k against a dense reference, equivalences."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.algorithms import AlgorithmSpec, sgd_step
from sim.comm.collectives import gtopk_rd, gtopk_tree, pof2_split
from sim.comm.compression import topk
from sim.workloads.data import shard_indices
from sim.engine.drivers import run_lockstep
from sim.machine.network import PRESETS
from sim.workloads.objectives import make_objective
from sim.engine.runner import Workers, run_algorithm

SPARSE_SPECS = [
    ("topk", None, "exact"),
    ("gtopk", "tree", "exact"),
    ("gtopk", "recursive_doubling", "exact"),
]

# values with many ties and zeros: small integers times a power of two, plus exact zeros
tie_values = st.sampled_from([0.0, 0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, 1e-300, -1e300 / 1e300])


@st.composite
def accumulators(draw):
    P = draw(st.integers(1, 9))
    d = draw(st.integers(1, 24))
    k = draw(st.integers(1, d))
    acc = np.array(draw(st.lists(st.lists(tie_values | st.floats(-4, 4, allow_subnormal=True), min_size=d, max_size=d),
                                 min_size=P, max_size=P)), dtype=np.float64)
    return P, d, k, acc


def _one_step(spec, accs, residuals=None, lr=1.0):
    P, d = accs.shape
    residuals = np.zeros_like(accs) if residuals is None else residuals
    progs = [sgd_step(spec, r, P, np.zeros(d), residuals[r], (lambda a: (lambda v: a))(accs[r]), 1, lr, 1)
             for r in range(P)]
    return run_lockstep(progs)


@settings(deadline=None)
@given(accumulators(), st.sampled_from(SPARSE_SPECS))
def test_mass_conservation_every_algorithm(case, which):
    """sum_p acc_p = g + sum_p eps_p, for hypothesis accumulators with ties and zeros, any P (docs/theory.md 1-2)."""
    P, d, k, acc = case
    name, coll, mask = which
    spec = AlgorithmSpec(name, k=k, collective=coll, mask=mask)
    outs = _one_step(spec, acc)
    g = outs[0].update
    for o in outs:
        assert np.array_equal(o.update, g)  # identical on every rank
    lhs = acc.sum(axis=0)
    rhs = g + np.sum([o.residual for o in outs], axis=0)
    scale = np.abs(acc).sum(axis=0) + 1e-300
    assert np.all(np.abs(lhs - rhs) <= 1e-14 * scale)
    for o, a in zip(outs, acc):
        # residual is the accumulator with the applied entries removed: each entry either kept or zeroed
        assert np.all((o.residual == a) | (o.residual == 0))
    if name == "gtopk":
        assert np.count_nonzero(g) <= k


@settings(deadline=None)
@given(st.integers(1, 9), st.integers(1, 5))
def test_dense_mass_and_identity(P, seed):
    acc = np.random.default_rng(seed).standard_normal((P, 13))
    for coll in ("ring", "recursive_doubling"):
        outs = _one_step(AlgorithmSpec("dense", collective=coll), acc)
        assert np.allclose(outs[0].update, acc.sum(axis=0), rtol=1e-13, atol=1e-13)
        assert all(np.array_equal(o.update, outs[0].update) for o in outs)


# ---------------------------------------------------------------- gTop-k against a dense numpy reference


def _dense_topk(x, k):
    order = np.lexsort((np.arange(x.shape[0]), -np.abs(x)))[:k]
    out = np.zeros_like(x)
    out[order] = x[order]
    return out


def _dense_merge(a, b, k):
    return _dense_topk(a + b, k)


def _ref_binomial(xs, k):
    """Binomial tree to rank 0: at mask m, rank r (r % 2m == 0) merges what r + m holds."""
    P = len(xs)
    cur = [_dense_topk(x, k) for x in xs]
    m = 1
    while m < P:
        for r in range(0, P, 2 * m):
            if r + m < P:
                cur[r] = _dense_merge(cur[r], cur[r + m], k)
        m *= 2
    return cur[0]


def _ref_butterfly(xs, k):
    """Fold the first 2*rem ranks pairwise, then merge groups of 2^j new ranks, lower half first."""
    P = len(xs)
    pof2, rem = pof2_split(P)
    sel = [_dense_topk(x, k) for x in xs]
    cur = [_dense_merge(sel[2 * i], sel[2 * i + 1], k) for i in range(rem)] + sel[2 * rem:]
    m = 1
    while m < pof2:
        # new rank i and its partner i ^ m both end the round with (lower group) T (upper group)
        cur = [_dense_merge(cur[min(i, i ^ m)], cur[max(i, i ^ m)], k) for i in range(pof2)]
        m *= 2
    return cur[0]


@pytest.mark.parametrize("P", list(range(1, 18)) + [31, 32, 33])
@pytest.mark.parametrize("exact", [True, False])
def test_gtopk_equals_dense_reference_on_every_rank(P, exact):
    rng = np.random.default_rng(P)
    d, k = 40, 5
    xs = [np.round(rng.standard_normal(d), 1) for _ in range(P)]  # rounding creates ties
    sels = [topk(x, k) for x in xs]
    for coll, ref in ((gtopk_tree, _ref_binomial), (gtopk_rd, _ref_butterfly)):
        res = run_lockstep([coll(r, P, sels[r], k, exact=exact) for r in range(P)])
        for x in res:
            assert np.array_equal(x.g.idx, res[0].g.idx) and np.array_equal(x.g.val, res[0].g.val)
        expect = ref(xs, k)
        assert np.allclose(res[0].g.to_dense(), expect, rtol=0, atol=1e-12)


def test_reference_mask_loses_mass_where_exact_does_not():
    """Worker 0's value at index 0 is dropped in the first merge but index 0 re-enters via workers 2-3.

    k = 1, binomial tree: 0T1 keeps index 1 (1.0 > 0.5); 2T3 keeps index 0 (2.0); the root keeps
    index 0. The reference rule zeroes worker 0's residual at index 0 (its local top-1 is in the final
    support) although its 0.5 never reached g: 0.5 is lost. The exact mask keeps it.
    """
    acc = np.array([[0.5, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 0.1]])
    lost = {}
    for mask in ("exact", "reference"):
        for coll in ("tree", "recursive_doubling"):
            outs = _one_step(AlgorithmSpec("gtopk", k=1, collective=coll, mask=mask), acc)
            assert np.array_equal(outs[0].update, [2.0, 0.0])
            total = outs[0].update + np.sum([o.residual for o in outs], axis=0)
            lost[mask, coll] = acc.sum(axis=0) - total
    assert np.array_equal(lost["exact", "tree"], [0.0, 0.0])
    assert np.array_equal(lost["exact", "recursive_doubling"], [0.0, 0.0])
    assert np.array_equal(lost["reference", "tree"], [0.5, 0.0])
    assert np.array_equal(lost["reference", "recursive_doubling"], [0.5, 0.0])


# ---------------------------------------------------------------- runs


def _workers(P, b=4, seed=0, name="softmax"):
    from sim.workloads.data import load_dataset

    obj = make_objective(name, dataset=load_dataset("digits"), lam=1e-3, mu=0.0)
    return obj, Workers(obj, shard_indices(obj.n, P, seed=seed), b, seed)


@pytest.mark.parametrize("spec", [AlgorithmSpec("topk", k=7), AlgorithmSpec("gtopk", k=7),
                                  AlgorithmSpec("gtopk", k=7, collective="recursive_doubling")])
@pytest.mark.parametrize("P", [1, 3, 4])
def test_aux_sequence_identity_and_mass_over_a_run(spec, P):
    """v_t - x_t = mean residual exactly (docs/theory.md section 3) and mass is conserved at every step."""
    obj, w = _workers(P)
    rows = run_algorithm(spec, w, T=30, lr=lambda t: 0.5, x0=obj.x0(0), driver="lockstep", eval_every=10)
    assert max(r["aux_gap"] for r in rows) < 1e-12
    assert max(r["mass_error"] for r in rows) < 1e-12
    assert all(r["residual_norm_sq"] > 0 for r in rows[1:])  # the identity is not vacuous


def test_dense_P_workers_equals_one_worker_with_batch_Pb():
    P, b = 4, 5
    obj, w = _workers(P, b)
    v_multi, v_single = {}, {}
    run_algorithm(AlgorithmSpec("dense"), w, T=15, lr=lambda t: 0.3, x0=obj.x0(0), driver="lockstep",
                  on_step=lambda t, outs: v_multi.__setitem__(t, outs[0].v))

    class OneWorker:
        objective = obj
        shards = [np.arange(obj.n)]
        b = P * w.b

        def grad_fn(self, rank, t):
            from sim.workloads.data import minibatch

            idx = np.concatenate([minibatch(w.shards[r], w.b, w.seed, r, t) for r in range(P)])
            return lambda v: obj.batch_grad(v, idx)

    run_algorithm(AlgorithmSpec("dense"), OneWorker(), T=15, lr=lambda t: 0.3, x0=obj.x0(0), driver="lockstep",
                  on_step=lambda t, outs: v_single.__setitem__(t, outs[0].v))
    for t in v_multi:
        assert np.allclose(v_multi[t], v_single[t], rtol=1e-12, atol=1e-14)
    assert not np.allclose(v_multi[15], obj.x0(0))


def test_topk_with_k_equal_d_is_dense():
    obj, w = _workers(3)
    d = obj.d
    vs = {}
    for spec in (AlgorithmSpec("dense"), AlgorithmSpec("topk", k=d), AlgorithmSpec("gtopk", k=d)):
        got = {}
        run_algorithm(spec, w, T=10, lr=lambda t: 0.5, x0=obj.x0(0), driver="lockstep",
                      on_step=lambda t, outs: got.__setitem__(t, outs[0].v))
        vs[spec.name] = got
    for t in range(1, 11):
        assert np.allclose(vs["topk"][t], vs["dense"][t], rtol=1e-12, atol=1e-14)
        assert np.allclose(vs["gtopk"][t], vs["dense"][t], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("spec", [AlgorithmSpec("dense"), AlgorithmSpec("topk", k=5), AlgorithmSpec("gtopk", k=5)])
def test_simpy_and_lockstep_drivers_compute_identical_numbers(spec):
    obj, w = _workers(5)
    a = run_algorithm(spec, w, T=8, lr=lambda t: 0.5, x0=obj.x0(0), driver="lockstep")
    b = run_algorithm(spec, w, T=8, lr=lambda t: 0.5, x0=obj.x0(0), driver="simpy", network=PRESETS["1GbE"])
    for ra, rb in zip(a, b):
        assert ra["loss"] == rb["loss"] and ra["grad_norm_sq"] == rb["grad_norm_sq"]
    assert b[-1]["sim_time_s"] > 0


def test_simulated_iteration_time_is_compute_plus_closed_form():
    """With constant compute and zero compression costs, each iteration costs forward_backward_s + the collective."""
    from sim.machine.compute import ComputeModel
    from sim.comm.costs import gtopk_tree_time, ring_allreduce_time, topk_allgather_time

    P, k = 8, 6
    obj, w = _workers(P)
    alpha, beta = PRESETS["1GbE"].end_to_end_alpha_beta()
    cm = ComputeModel(forward_backward_s=0.01, select_coeff_s=0.0)
    for spec, comm in ((AlgorithmSpec("dense"), ring_allreduce_time(P, obj.d, alpha, beta)),
                       (AlgorithmSpec("topk", k=k), topk_allgather_time(P, k, alpha, beta)),
                       (AlgorithmSpec("gtopk", k=k), gtopk_tree_time(P, k, alpha, beta))):
        rows = run_algorithm(spec, w, T=3, lr=lambda t: 0.1, x0=obj.x0(0), network=PRESETS["1GbE"], compute=cm)
        expect = 0.01 + comm
        for r in rows[1:]:
            assert r["iter_time_s"] == pytest.approx(expect, rel=1e-9)
            assert r["compute_s"] == pytest.approx(0.01, rel=1e-12)
            assert r["comm_s"] == pytest.approx(expect - 0.01, rel=1e-9)


def test_backend_allreduce_is_rejected_by_the_simulated_drivers():
    """The torch-only fast path cannot be simulated message by message: a clear SparsimError, not a hang."""
    from sim.base.errors import SparsimError

    obj, w = _workers(2)
    spec = AlgorithmSpec("dense", collective="backend_allreduce")
    for driver in ("lockstep", "simpy"):
        with pytest.raises(SparsimError, match="backend_allreduce runs only on the torch backend"):
            run_algorithm(spec, w, T=1, lr=lambda t: 0.1, x0=obj.x0(0), driver=driver, network=PRESETS["1GbE"])


# ---------------------------------------------------------------- rand-k (Mem-SGD's random sparsifier)


@settings(deadline=None)
@given(accumulators(), st.integers(0, 3))
def test_randk_conserves_mass(case, seed):
    """Rand-k with error feedback: sum_p acc_p = g + sum_p eps_p; each entry is either sent or kept."""
    P, d, k, acc = case
    outs = _one_step(AlgorithmSpec("randk", k=k, seed=seed), acc)
    g = outs[0].update
    for o in outs:
        assert np.array_equal(o.update, g)
        assert o.n_selected <= k
    lhs = acc.sum(axis=0)
    rhs = g + np.sum([o.residual for o in outs], axis=0)
    assert np.all(np.abs(lhs - rhs) <= 1e-14 * (np.abs(acc).sum(axis=0) + 1e-300))
    for o, a in zip(outs, acc):
        assert np.all((o.residual == a) | (o.residual == 0))
        assert np.count_nonzero(o.residual != a) <= k


def test_randk_is_deterministic_for_a_seed_and_varies_with_it():
    obj, w = _workers(2)
    run = lambda s: run_algorithm(AlgorithmSpec("randk", k=5, seed=s), w, T=15, lr=lambda t: 0.5, x0=obj.x0(0),
                                  driver="lockstep")
    a, b, c = run(3), run(3), run(4)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["residual_norm_sq"] for r in a] == [r["residual_norm_sq"] for r in b]
    assert [r["residual_norm_sq"] for r in a] != [r["residual_norm_sq"] for r in c]
    assert max(r["mass_error"] for r in a) < 1e-12 and max(r["aux_gap"] for r in a) < 1e-12


def test_randk_selects_uniformly_not_by_magnitude():
    """Over many iterations every coordinate is drawn about k/d of the time, large or small."""
    d, k = 10, 2
    acc = np.array([[100.0] + [1.0] * (d - 1)])
    hits = np.zeros(d)
    for t in range(1, 2001):
        progs = [sgd_step(AlgorithmSpec("randk", k=k, seed=1), 0, 1, np.zeros(d), np.zeros(d), lambda v: acc[0], 1, 1.0, t)]
        hits += run_lockstep(progs)[0].update != 0
    assert np.all(np.abs(hits / 2000 - k / d) < 0.05)


def test_randk_seed_must_be_non_negative():
    with pytest.raises(Exception, match="seed"):
        AlgorithmSpec("randk", k=1, seed=-1)


def test_nan_gradient_names_worker_and_iteration():
    from sim.base.errors import NonFiniteError

    class NaNAtWorker2Iter3:
        objective = make_objective("sines", d=20, n=64, seed=0)
        shards = shard_indices(64, 4, seed=0)
        b = 2

        def grad_fn(self, rank, t):
            g = self.objective.batch_grad
            return (lambda v: np.full(20, np.nan)) if (rank, t) == (2, 3) else (lambda v: g(v, np.arange(2)))

    w = NaNAtWorker2Iter3()
    for driver in ("lockstep", "simpy"):
        with pytest.raises(NonFiniteError, match="gradient of worker 2 at iteration 3 is not finite"):
            run_algorithm(AlgorithmSpec("gtopk", k=3), w, T=5, lr=lambda t: 0.01, x0=w.objective.x0(0),
                          driver=driver, network=PRESETS["1GbE"])


def test_delta_is_zero_when_nothing_accumulated():
    """Issue #13: with sum_p acc_p = 0 and g = 0 Assumption 1 holds trivially: delta is 0, not NaN."""
    from sim.engine.runner import step_stats
    from sim.algorithms import StepOutput

    d = 10
    z = np.zeros(d)
    outs = [StepOutput(z, z, z, z, z, 1, 1) for _ in range(3)]
    assert step_stats(AlgorithmSpec("topk", k=1), outs).delta == 0.0
    acc = [np.eye(d)[0], -np.eye(d)[0], z]  # cancelling accumulators, yet a non-zero g: undefined
    g = np.eye(d)[0]
    outs = [StepOutput(z, a - (g if i == 0 else 0), a, z, g, 1, 1) for i, a in enumerate(acc)]
    import math

    assert math.isnan(step_stats(AlgorithmSpec("topk", k=1), outs).delta)

"""Layer-wise (per-segment) selection: AlgorithmSpec.segments in sim.algorithms.sgd_step.

Per segment b of size d_b each sparse algorithm selects k_b = min(d_b, max(1, round(k / d * d_b))) coordinates
of that segment's accumulator and runs one collective on it (Shi et al. IJCAI 2019, Algorithm 1, per
segment; Stich et al. 2018 for rand-k). Checked here: a single segment reproduces whole-model selection
bit for bit (numbers and messages, lock-step driver and SimPy cluster); each segment is an independent
instance of the whole-model algorithm on that segment; mass is conserved per segment; the metrics use
sum_b k_b; the timing-only mode and the fast engine refuse segments.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.algorithms import RANDK_STREAM, AlgorithmSpec, sgd_step
from sim.engine.cluster import SimCluster
from sim.comm.compression import Sparse, topk
from sim.workloads.data import shard_indices
from sim.engine.drivers import run_lockstep
from sim.base.errors import ConfigError, SparsimError
from sim.machine.network import PRESETS
from sim.workloads.objectives import make_objective
from sim.base.ops import Compute
from sim.engine.runner import Workers, run_algorithm, step_stats
from sim.engine.timeline import bucket_k

NET = PRESETS["1GbE"]

#: (name, collective, mask, gpus_per_node) of every sparse variant; hierarchical ones need G | P.
FLAT_SPARSE = [
    ("topk", "allgather", "exact", 1),
    ("randk", "allgather", "exact", 1),
    ("gtopk", "tree", "exact", 1),
    ("gtopk", "tree", "reference", 1),
    ("gtopk", "recursive_doubling", "exact", 1),
    ("gtopk", "recursive_doubling", "reference", 1),
]
HIER_SPARSE = [
    ("topk", "hierarchical", "exact", 2),
    ("randk", "hierarchical", "exact", 2),
    ("gtopk", "hierarchical", "exact", 2),
    ("gtopk", "hierarchical", "reference", 2),
]

tie_values = st.sampled_from([0.0, 0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, 1e-300])


def _spec(which, k, segments=None, seed=3):
    name, coll, mask, G = which
    return AlgorithmSpec(name, k=k, collective=coll, mask=mask, gpus_per_node=G, seed=seed, segments=segments)


def _recorded(prog, log: list):
    """Run ``prog`` unchanged, appending every operation it yields to ``log``."""
    value = None
    while True:
        try:
            op = prog.send(value)
        except StopIteration as stop:
            return stop.value
        log.append(op)
        value = yield op


def _canon(x):
    """A comparable, bit-exact form of an operation or a payload (arrays by dtype, shape and bytes)."""
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, Sparse):
        return ("sparse", _canon(x.idx), _canon(x.val), x.d)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_canon(i) for i in x))
    if dataclasses.is_dataclass(x):
        return (type(x).__name__,) + tuple(_canon(getattr(x, f.name)) for f in dataclasses.fields(x))
    return x


def _step(spec, accs, residuals=None, lr=1.0, iteration=1):
    """One lock-step iteration with gradient = accs[r] on rank r; returns (outs, per-rank op logs)."""
    P, d = accs.shape
    residuals = np.zeros_like(accs) if residuals is None else residuals
    logs = [[] for _ in range(P)]
    progs = [_recorded(sgd_step(spec, r, P, np.zeros(d), residuals[r], (lambda a: (lambda v: a))(accs[r]), 1, lr,
                                iteration), logs[r]) for r in range(P)]
    return run_lockstep(progs), logs


def _same_outputs(a, b):
    for oa, ob in zip(a, b, strict=True):
        for f in ("v", "residual", "acc", "grad", "update"):
            x, y = getattr(oa, f), getattr(ob, f)
            assert x.dtype == y.dtype and np.array_equal(x, y), f
        assert (oa.n_selected, oa.n_applied) == (ob.n_selected, ob.n_applied)


def _rand_accs(P, d, seed):
    rng = np.random.default_rng(seed)
    acc = rng.standard_normal((P, d))
    acc[rng.random((P, d)) < 0.2] = 0.0  # exact zeros
    acc[:, ::5] = 1.0  # ties across ranks and within a rank
    return acc


# ---------------------------------------------------------------- the spec


def test_segments_validation_names_value_and_range():
    spec = AlgorithmSpec("topk", k=10, segments=[30, 60, np.int64(10)])
    assert spec.segments == (30, 60, 10) and all(type(n) is int for n in spec.segments)
    spec.check_dim(100)
    for bad in ((), (0, 5), (3, -1), (1.5, 2), (True, 3), "ab", 7):
        with pytest.raises(ConfigError, match=r"segments = .* is out of range: valid None or a non-empty sequence"):
            AlgorithmSpec("gtopk", k=1, segments=bad)
    with pytest.raises(SparsimError, match=r"segments = \(30, 60, 10\) sum to 100: valid .* sum to d = 99"):
        spec.check_dim(99)
    with pytest.raises(SparsimError, match=r"\(40 segments\) sum to 40: valid .* d = 41"):
        AlgorithmSpec("gtopk", k=1, segments=(1,) * 40).check_dim(41)
    with pytest.raises(SparsimError, match="sum to d = 99"):
        AlgorithmSpec("dense", segments=(30, 60, 10)).check_dim(99)  # checked for dense as well
    assert AlgorithmSpec("topk", k=5).segments is None


def test_segment_ks_rule_examples():
    spec = AlgorithmSpec("topk", k=10, segments=(30, 60, 10))
    assert spec.segment_ks(100) == (3, 6, 1) and spec.total_k(100) == 10
    assert list(spec.segment_bounds(100)) == [0, 30, 90, 100]
    tiny = AlgorithmSpec("gtopk", k=3, segments=(1, 1, 98))
    assert tiny.segment_ks(100) == (1, 1, 3) and tiny.total_k(100) == 5  # at least one per segment
    half = AlgorithmSpec("randk", k=1, segments=(2, 2))  # k d_b / d = 1/2: round gives 0, at least 1
    assert half.segment_ks(4) == (1, 1)
    even = AlgorithmSpec("topk", k=5, segments=(10, 10))  # 2.5 rounds to even: the total is 4, not k = 5
    assert even.segment_ks(20) == (2, 2) and even.total_k(20) == 4
    assert AlgorithmSpec("topk", k=7).segment_ks(50) == (7,) and AlgorithmSpec("topk", k=7).total_k(50) == 7
    assert AlgorithmSpec("dense", segments=(3, 4)).segment_ks(7) == (3, 4)
    assert AlgorithmSpec("dense").total_k(9) == 9


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=12), st.data())
def test_segment_ks_rule_property(sizes, data):
    d = sum(sizes)
    k = data.draw(st.integers(1, d))
    ks = AlgorithmSpec("topk", k=k, segments=tuple(sizes)).segment_ks(d)
    spec = AlgorithmSpec("topk", k=k, segments=tuple(sizes))
    for n, kb in zip(sizes, ks, strict=True):
        assert 1 <= kb <= n
        assert abs(kb - max(1, Fraction(k * n, d))) <= Fraction(1, 2) + Fraction(1, 10**9) or kb == n
        assert kb == bucket_k(spec, d, n)  # the iteration timeline's per-bucket k: same counts
    assert AlgorithmSpec("topk", k=k, segments=(d,)).segment_ks(d) == (k,)


# ---------------------------------------------------------------- one segment = whole model, bit for bit


@pytest.mark.parametrize("which,P", [(w, P) for w in FLAT_SPARSE + HIER_SPARSE for P in (1, 2, 3, 4, 6)
                                     if P % w[3] == 0],
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else f"P{x}")
def test_single_segment_equals_whole_model_lockstep(which, P):
    """segments = (d,) gives the same g, residual, counts and messages (payloads included) bit for bit
    (hierarchical collectives with gpus_per_node = 2 where 2 divides P)."""
    d = 23
    for k in (1, 4, d):
        for it, seed in ((1, 0), (2, 1)):
            acc = _rand_accs(P, d, seed)
            res = _rand_accs(P, d, seed + 10) * 0.1
            whole, wlogs = _step(_spec(which, k), acc, res, lr=0.5, iteration=it)
            seg, slogs = _step(_spec(which, k, (d,)), acc, res, lr=0.5, iteration=it)
            _same_outputs(whole, seg)
            for wl, sl in zip(wlogs, slogs, strict=True):
                assert [_canon(op) for op in wl] == [_canon(op) for op in sl]


@pytest.mark.parametrize("which", FLAT_SPARSE, ids=lambda w: "-".join(map(str, w)))
def test_single_segment_equals_whole_model_simpy(which):
    """On the SimPy cluster: same numbers, same finish times, busy seconds and bytes (one step, P = 5)."""
    P, d, k = 5, 31, 6
    acc = _rand_accs(P, d, 4)
    got = []
    for spec in (_spec(which, k), _spec(which, k, (d,))):
        cl = SimCluster(P, NET)
        logs = [[] for _ in range(P)]
        progs = [_recorded(sgd_step(spec, r, P, np.zeros(d), np.zeros(d), (lambda a: (lambda v: a))(acc[r]), 1, 0.5, 1),
                           logs[r]) for r in range(P)]
        outs, finish = cl.run_programs(progs, 1)
        got.append((outs, finish, cl.busy.copy(), cl.net.bytes_sent.copy(), logs))
    (wo, wf, wb, wbytes, wl), (so, sf, sb, sbytes, sl) = got
    _same_outputs(wo, so)
    assert np.array_equal(wf, sf) and np.array_equal(wb, sb) and np.array_equal(wbytes, sbytes)
    assert [[_canon(op) for op in lg] for lg in wl] == [[_canon(op) for op in lg] for lg in sl]


def _workers(P, b=4, seed=0):
    from sim.workloads.data import load_dataset

    obj = make_objective("softmax", dataset=load_dataset("digits"), lam=1e-3, mu=0.0)
    return obj, Workers(obj, shard_indices(obj.n, P, seed=seed), b, seed)


def _same_rows(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            x, y = ra[key], rb[key]
            assert x == y or (isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y)), key


@pytest.mark.parametrize("spec", [AlgorithmSpec("topk", k=9), AlgorithmSpec("randk", k=9, seed=2),
                                  AlgorithmSpec("gtopk", k=9), AlgorithmSpec("gtopk", k=9, mask="reference"),
                                  AlgorithmSpec("gtopk", k=9, collective="recursive_doubling"),
                                  AlgorithmSpec("gtopk", k=9, collective="recursive_doubling", mask="reference")],
                         ids=lambda s: f"{s.label}-{s.collective}")
def test_single_segment_run_equals_whole_model_run_on_both_drivers(spec):
    """Whole runs (T = 6, P = 3): every metrics row and every step's outputs equal, lock-step and SimPy."""
    P = 3
    obj, w = _workers(P)
    one = dataclasses.replace(spec, segments=(obj.d,))
    for driver in ("lockstep", "simpy"):
        outs = {}
        rows = [run_algorithm(s, w, T=6, lr=lambda t: 0.5, x0=obj.x0(0), driver=driver, network=NET, eval_every=2,
                              on_step=lambda t, o, s=s: outs.setdefault(s.segments, []).append(o))
                for s in (spec, one)]
        _same_rows(*rows)
        for a, b in zip(outs[None], outs[(obj.d,)], strict=True):
            _same_outputs(a, b)


# ---------------------------------------------------------------- several segments


@st.composite
def layered(draw):
    P = draw(st.integers(1, 6))
    sizes = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=5)))
    d = sum(sizes)
    k = draw(st.integers(1, d))
    acc = np.array(draw(st.lists(st.lists(tie_values | st.floats(-4, 4), min_size=d, max_size=d),
                                 min_size=P, max_size=P)), dtype=np.float64)
    return P, sizes, k, acc


@settings(deadline=None)
@given(layered(), st.sampled_from(FLAT_SPARSE), st.integers(0, 3))
def test_layerwise_mass_conservation_per_segment(case, which, seed):
    """sum_p acc_p = g + sum_p eps_p on every segment (up to rounding; the gTop-k reference mask may lose
    mass), residual entries kept or zeroed, g identical on every rank, at most P k_b (Top-k, rand-k) or k_b
    (gTop-k) nonzeros of g per segment; step_stats' per-segment mass errors and their max."""
    P, sizes, k, acc = case
    spec = _spec(which, k, sizes, seed)
    d = sum(sizes)
    outs, _ = _step(spec, acc)
    g = outs[0].update
    assert all(np.array_equal(o.update, g) for o in outs)
    for o, a in zip(outs, acc):
        assert np.all((o.residual == a) | (o.residual == 0))
    bounds, ks = spec.segment_bounds(d), spec.segment_ks(d)
    lhs = acc.sum(axis=0)
    rhs = g + np.sum([o.residual for o in outs], axis=0)
    scale = np.abs(acc).sum(axis=0) + 1e-300
    st_ = step_stats(spec, outs)
    err = np.abs(sum(o.acc for o in outs) - g - sum(o.residual for o in outs))  # step_stats' order of additions
    assert st_.segment_mass_errors.shape == (len(sizes),)
    assert st_.mass_error == float(np.max(st_.segment_mass_errors))
    for b, kb in enumerate(ks):
        seg = slice(int(bounds[b]), int(bounds[b + 1]))
        if which[2] == "exact":
            assert np.all(np.abs(lhs[seg] - rhs[seg]) <= 1e-14 * scale[seg])
        assert st_.segment_mass_errors[b] == float(np.max(err[seg]))
        assert np.count_nonzero(g[seg]) <= (kb if which[0] == "gtopk" else P * kb)
        for o in outs:  # each worker sends at most k_b entries of each segment
            assert np.count_nonzero(o.acc[seg] != o.residual[seg]) <= kb


@settings(deadline=None)
@given(layered(), st.sampled_from([w for w in FLAT_SPARSE if w[0] != "randk"]))
def test_each_segment_is_the_whole_model_algorithm_on_that_segment(case, which):
    """Top-k and gTop-k (every collective and mask): segment b of the layer-wise step equals the whole-model
    step run on acc[:, b] alone with k = k_b, bit for bit (g, residuals, counts, and the messages)."""
    P, sizes, k, acc = case
    spec = _spec(which, k, sizes)
    d = sum(sizes)
    outs, logs = _step(spec, acc)
    bounds, ks = spec.segment_bounds(d), spec.segment_ks(d)
    expect_logs = [[logs[r][0]] for r in range(P)]  # forward_backward
    n_sel, n_app = [0] * P, [0] * P
    for b, kb in enumerate(ks):
        seg = slice(int(bounds[b]), int(bounds[b + 1]))
        alone, alogs = _step(_spec(which, kb), np.ascontiguousarray(acc[:, seg]))
        for r in range(P):
            assert np.array_equal(outs[r].update[seg], alone[r].update)
            assert np.array_equal(outs[r].residual[seg], alone[r].residual)
            n_sel[r] += alone[r].n_selected
            n_app[r] += alone[r].n_applied
            expect_logs[r] += alogs[r][1:-1]  # without its forward_backward and update
    for r in range(P):
        assert (outs[r].n_selected, outs[r].n_applied) == (n_sel[r], n_app[r])
        assert logs[r][-1] == Compute("update", d)
        assert [_canon(op) for op in logs[r]] == [_canon(op) for op in expect_logs[r] + [logs[r][-1]]]


@settings(deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.data())
def test_layerwise_topk_with_one_worker_is_the_concatenation_of_segment_topks(sizes, data):
    d = sum(sizes)
    k = data.draw(st.integers(1, d))
    acc = np.array([data.draw(st.lists(tie_values | st.floats(-4, 4), min_size=d, max_size=d))])
    spec = AlgorithmSpec("topk", k=k, segments=tuple(sizes))
    (out,), _ = _step(spec, acc)
    b = spec.segment_bounds(d)
    expect = np.concatenate([topk(acc[0, b[i]:b[i + 1]], kb).to_dense() for i, kb in enumerate(spec.segment_ks(d))])
    assert np.array_equal(out.update, expect)
    assert np.array_equal(out.residual, acc[0] - expect)


def test_layerwise_selection_differs_from_whole_model():
    """Per-layer budgets change what is selected: the small second layer gets its own coordinate."""
    acc = np.array([[10.0, 9.0, 1.0, 0.5]])
    whole, _ = _step(AlgorithmSpec("topk", k=2), acc)
    layer, _ = _step(AlgorithmSpec("topk", k=2, segments=(2, 2)), acc)
    assert np.array_equal(whole[0].update, [10.0, 9.0, 0.0, 0.0])
    assert np.array_equal(layer[0].update, [10.0, 0.0, 1.0, 0.0])
    assert np.array_equal(layer[0].residual, [0.0, 9.0, 0.0, 0.5])


def test_layerwise_randk_draws_segments_in_order_from_one_stream():
    """Rand-k: rank r at iteration t draws rng.choice(d_b, k_b) for b = 1..B from the one generator
    default_rng([seed, r, t, RANDK_STREAM]), offset to global coordinates."""
    P, sizes, k, seed, t = 3, (5, 12, 3, 20), 10, 7, 4
    d = sum(sizes)
    acc = np.random.default_rng(0).uniform(1.0, 2.0, (P, d))  # no zeros: every draw is sent
    spec = AlgorithmSpec("randk", k=k, seed=seed, segments=sizes)
    outs, _ = _step(spec, acc, iteration=t)
    bounds, ks = spec.segment_bounds(d), spec.segment_ks(d)
    g = np.zeros(d)
    for r in range(P):
        rng = np.random.default_rng([seed, r, t, RANDK_STREAM])
        chosen = np.concatenate([bounds[b] + np.sort(rng.choice(n, size=kb, replace=False))
                                 for b, (n, kb) in enumerate(zip(sizes, ks))])
        assert np.array_equal(np.flatnonzero(outs[r].residual == 0), chosen)
        g[chosen] += acc[r, chosen]
    assert np.array_equal(outs[0].update, g)


def test_one_collective_per_segment_in_segment_order():
    """Top-k on P = 4 (Bruck: 2 rounds per allgather): select d_b then 2 SendRecvs, per segment in order."""
    sizes = (6, 10, 4)
    acc = _rand_accs(4, sum(sizes), 2)
    spec = AlgorithmSpec("topk", k=5, segments=sizes)
    _, logs = _step(spec, acc)
    kinds = [(type(op).__name__, op.kind if isinstance(op, Compute) else None) for op in logs[0]]
    per_seg = [("Compute", "select"), ("SendRecv", None), ("SendRecv", None), ("Compute", "reduce")]
    assert kinds == [("Compute", "forward_backward")] + per_seg * 3 + [("Compute", "update")]
    assert [op.work for op in logs[0] if isinstance(op, Compute) and op.kind == "select"] == list(sizes)


def test_dense_is_unaffected_by_segments():
    acc = _rand_accs(5, 17, 3)
    for coll in ("ring", "recursive_doubling"):
        a, la = _step(AlgorithmSpec("dense", collective=coll), acc)
        b, lb = _step(AlgorithmSpec("dense", collective=coll, segments=(4, 13)), acc)
        _same_outputs(a, b)
        assert [[_canon(op) for op in lg] for lg in la] == [[_canon(op) for op in lg] for lg in lb]


# ---------------------------------------------------------------- metrics and runs


def test_step_stats_delta_uses_the_total_selected_k():
    """delta = ||sum acc - g||^2 / ((1 - K/d) ||sum acc||^2) with K = sum_b k_b (here 5, not k = 3)."""
    d = 100
    acc = _rand_accs(2, d, 5)
    spec = AlgorithmSpec("topk", k=3, segments=(1, 1, 98))
    assert spec.total_k(d) == 5
    outs, _ = _step(spec, acc)
    st_ = step_stats(spec, outs)
    s, g = acc.sum(axis=0), outs[0].update
    assert st_.delta == pytest.approx(float((s - g) @ (s - g)) / ((1 - 5 / d) * float(s @ s)), rel=1e-12)
    assert st_.segment_mass_errors.shape == (3,) and st_.mass_error < 1e-13
    full = AlgorithmSpec("topk", k=1, segments=(1, 1, 1, 1))  # every k_b = d_b = 1: nothing is compressed
    outs, _ = _step(full, _rand_accs(2, 4, 1))
    assert full.total_k(4) == 4 and step_stats(full, outs).delta is None


@pytest.mark.parametrize("spec", [AlgorithmSpec("topk", k=8), AlgorithmSpec("randk", k=8, seed=1),
                                  AlgorithmSpec("gtopk", k=8),
                                  AlgorithmSpec("gtopk", k=8, collective="recursive_doubling")],
                         ids=lambda s: f"{s.name}-{s.collective}")
def test_layerwise_run_conserves_mass_and_drivers_agree(spec):
    """A layered softmax model (weights in three parts, biases): aux identity and mass over a run, and the
    lock-step and SimPy drivers compute the same rows (SimPy's time columns aside)."""
    P = 4
    obj, w = _workers(P)
    d = obj.d
    third = (d - 10) // 3
    spec = dataclasses.replace(spec, segments=(third, third, d - 10 - 2 * third, 10))
    a = run_algorithm(spec, w, T=12, lr=lambda t: 0.5, x0=obj.x0(0), driver="lockstep", eval_every=4)
    b = run_algorithm(spec, w, T=12, lr=lambda t: 0.5, x0=obj.x0(0), driver="simpy", network=NET, eval_every=4)
    assert max(r["aux_gap"] for r in a) < 1e-12
    assert max(r["mass_error"] for r in a) < 1e-12
    assert all(r["residual_norm_sq"] > 0 for r in a[1:])
    numeric = ("algorithm", "iteration", "lr", "loss", "grad_norm_sq", "stoch_grad_norm_sq", "residual_norm_sq",
               "delta", "applied_fraction", "mass_error", "aux_gap")  # not the clock's columns
    _same_rows([{c: r[c] for c in numeric} for r in a], [{c: r[c] for c in numeric} for r in b])
    assert b[-1]["sim_time_s"] > 0
    whole = run_algorithm(dataclasses.replace(spec, segments=None), w, T=12, lr=lambda t: 0.5, x0=obj.x0(0),
                          driver="lockstep", eval_every=4)
    assert whole[-1]["loss"] != a[-1]["loss"]  # the segments change what is selected


def test_run_rejects_segments_that_do_not_sum_to_d():
    obj, w = _workers(2)
    with pytest.raises(SparsimError, match=f"sum to d = {obj.d}"):
        run_algorithm(AlgorithmSpec("topk", k=3, segments=(5, 5)), w, T=1, lr=lambda t: 0.1, x0=obj.x0(0),
                      driver="lockstep")


# ---------------------------------------------------------------- timing-only mode and fast engine refuse segments


def test_timing_only_mode_and_fast_engine_refuse_segments():
    from sim.engine.fastsim import FastCluster, fast_iteration
    from sim.engine.timing import simulate_timing_fast
    from sim.comm.payloads import random_selection
    from sim.engine.timing import closed_form_comm_s, simulate_timing, timing_program

    d, P = 100, 4
    for spec in (AlgorithmSpec("topk", k=10, segments=(50, 50)), AlgorithmSpec("gtopk", k=10, segments=(100,)),
                 AlgorithmSpec("dense", segments=(40, 60))):
        for engine in ("message", "fast"):
            with pytest.raises(ConfigError, match=r"segments = .*sim/engine/timeline\.py"):
                simulate_timing(spec, P, d, network=NET, engine=engine)
        with pytest.raises(ConfigError, match="fast engine"):
            simulate_timing_fast(spec, P, d, network=NET)
        with pytest.raises(ConfigError, match="fast engine"):
            fast_iteration(FastCluster(P, NET), spec, d, 1, 1)
        with pytest.raises(ConfigError, match="timing-only mode"):
            next(timing_program(spec, 0, P, d, 1, random_selection(10, d, np.random.default_rng(0))))
        with pytest.raises(ConfigError, match="closed forms"):
            closed_form_comm_s(spec, P, d, 1e-6, 1e-9)


# ---------------------------------------------------------------- torch.distributed runs the same layer-wise programs


def _torch_specs():
    seg = (10, 10, 4)  # d = 24 of the sines objective
    return [AlgorithmSpec("topk", k=5, segments=seg), AlgorithmSpec("randk", k=5, seed=4, segments=seg),
            AlgorithmSpec("gtopk", k=5, segments=seg),
            AlgorithmSpec("gtopk", k=5, collective="recursive_doubling", mask="reference", segments=seg)]


def _torch_workers(P):
    obj = make_objective("sines", d=24, n=48, seed=3)
    return Workers(obj, shard_indices(obj.n, P, seed=3), 4, 3), obj.x0(3)


def _const_lr(t):
    """alpha_t = 0.3 (module level so spawned ranks can unpickle it)."""
    return 0.3


def layerwise_torch_job(ctx):
    """Per-rank body: every layer-wise spec for 4 iterations over gloo; the parameter trajectories."""
    from sim.distributed.backend import run_worker

    w, x0 = _torch_workers(ctx.P)
    return [run_worker(ctx.rank, ctx.P, spec, w, T=4, lr=_const_lr, x0=x0, transport=ctx.transport,
                       keep_trajectory=True).trajectory for spec in _torch_specs()]


def test_layerwise_torch_backend_bit_identical_to_lockstep():
    pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]'")
    from sim.distributed.backend import launch_local

    P = 3
    got = launch_local(P, layerwise_torch_job, (), timeout_s=60.0)
    w, x0 = _torch_workers(P)
    for i, spec in enumerate(_torch_specs()):
        traj = []
        run_algorithm(spec, w, T=4, lr=_const_lr, x0=x0, driver="lockstep",
                      on_step=lambda t, outs: traj.append([o.v.copy() for o in outs]))
        for r in range(P):
            assert len(got[r][i]) == 4
            for t in range(4):
                assert np.array_equal(got[r][i][t], traj[t][r]), f"{spec} rank {r} iteration {t + 1}"

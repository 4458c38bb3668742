"""DGC (sim/algorithms/dgc.py; Lin et al., ICLR 2018): checked against the official code's recorded behaviour
(tests/fixtures/peers/dgc.npz, written by benchmarks/peers/dgc_peer.py from synxlin/deep-gradient-compression),
against its own definition (momentum correction, masking, clipping, warm-up), against Top-k at momentum 0, and
for the contraction property of its exact selection (Stich et al. 2018, Lemma A.1)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sim.algorithms import AlgorithmSpec, StepContext, check_options, sgd_step
from sim.algorithms.dgc import DGC_STREAM, PAPER_WARMUP_DENSITIES, sample_layout, sampled_select, warmup_k
from sim.comm.compression import topk
from sim.engine.drivers import run_lockstep
from sim.base.errors import ConfigError

from _shared import peer_fixture, peer_module

PEER = peer_module("dgc")


@pytest.fixture(scope="module")
def fx():
    return peer_fixture("dgc")


def _run(spec, P, T, x0, grads, lr):
    """Run T steps of ``spec`` on P lock-step workers with the given gradients grads[t][p] (fresh copies).
    Yields (t, outs, states) after each step."""
    vs = [x0.copy() for _ in range(P)]
    res = [np.zeros_like(x0) for _ in range(P)]
    states = [{} for _ in range(P)]
    for t in range(1, T + 1):
        progs = [sgd_step(spec, r, P, vs[r], res[r], lambda v, g=grads[t - 1][r]: g.copy(), 1, lr, t, states[r])
                 for r in range(P)]
        outs = run_lockstep(progs)
        vs = [o.v for o in outs]
        res = [o.residual for o in outs]
        yield t, outs, states


# ------------------------------------------------------------------ the official code's memory, bit for bit

@pytest.mark.parametrize("case", list(PEER.MEM_CASES))
def test_memory_and_update_equal_the_official_code(fx, case):
    """Momentum correction u = m u + G, v = v + u (Nesterov variant), masking, local clipping, the allgathered
    update: our u, v (the residual) and parameters equal DGCSGDMemory's momentums, velocities and DGCSGD's
    parameters bit for bit at every step and worker, with exact selection (their sample_ratio = 1 path)."""
    dtype, P, m, masking, nesterov, c, lr, integer = PEER.MEM_CASES[case]
    sizes = tuple(int(np.prod(s)) for s in PEER.mem_shapes(PEER.MEM_CASES[case]))
    d = sum(sizes)
    ks = fx[f"mem_{case}_ks"]
    x0 = np.random.default_rng([PEER.MEM_SEED, 999]).standard_normal(d).astype(dtype)
    grads = [[PEER.gradient("exact" if integer else "normal", PEER.MEM_SEED, p, t, d, dtype)
              for p in range(P)] for t in range(1, PEER.MEM_T + 1)]
    assert np.array_equal(PEER.digest(x0, *[g for step in grads for g in step]), fx[f"mem_{case}_inputs"]), \
        "numpy no longer draws the fixture's inputs: rerun benchmarks/peers/dgc_peer.py"
    opts = (("selection", "exact"), ("momentum_masking", "on" if masking else "off"),
            ("nesterov", "on" if nesterov else "off"), ("clip_norm", c))
    spec = AlgorithmSpec("dgc", k=int(ks.sum()), segments=sizes, momentum=m, options=opts)
    assert spec.segment_ks(d) == tuple(int(k) for k in ks)
    scale = 1.0 / lr  # theirs keep u and v in gradient units; ours in parameter units (exact: lr = 2^-j)
    dig, sent = fx[f"mem_{case}_digests"], fx[f"mem_{case}_sent"]
    for t, outs, states in _run(spec, P, PEER.MEM_T, x0, grads, lr):
        for p, o in enumerate(outs):
            u = states[p]["dgc_u"]
            assert u.dtype == np.dtype(dtype) and o.residual.dtype == np.dtype(dtype)
            assert np.array_equal(PEER.digest(u * scale), dig[t - 1, p, 0]), (case, t, p, "momentum u")
            assert np.array_equal(PEER.digest(o.residual * scale), dig[t - 1, p, 1]), (case, t, p, "velocity v")
            ours = np.flatnonzero((o.acc != 0) & (o.residual == 0))
            theirs = sent[t - 1, p][sent[t - 1, p] >= 0]
            assert np.array_equal(ours, theirs), (case, t, p)
            assert o.n_selected == len(theirs)
            if P & (P - 1) == 0:
                assert np.array_equal(PEER.digest(o.v), dig[t - 1, p, 2]), (case, t, p, "parameters")
    if P & (P - 1):
        # their update multiplies the sum by 1/P, ours divides by P: one rounding apart per step
        np.testing.assert_allclose(outs[0].v, fx[f"mem_{case}_final_x"], rtol=1e-14, atol=1e-15)


# ------------------------------------------------------------------ the official threshold rule

@pytest.mark.parametrize("case", list(PEER.THR_CASES))
def test_sampled_threshold_reproduces_the_official_selection(fx, case):
    """The sampled threshold and its adaptation (_sparsify) on the same vector and the same sample: the same
    layout, the same selected count and the same indices for every recorded draw."""
    numel, ratio, dist, strided, resample, draws = PEER.THR_CASES[case]
    x = PEER.vector(dist, PEER.THR_SEED, numel)
    assert np.array_equal(PEER.digest(x), fx[f"thr_{case}_input"])
    num_selects, num_samples, top_k_samples, stride = fx[f"thr_{case}_layout"]
    assert sample_layout(numel, ratio, 0.01) == (num_samples, top_k_samples, stride)
    k = int(math.ceil(numel * ratio))
    assert k == num_selects and k / numel == ratio  # our ratio k / d_b is their compress_ratio
    picks, counts, digs = fx[f"thr_{case}_picks"], fx[f"thr_{case}_counts"], fx[f"thr_{case}_digests"]
    for j in range(draws):
        pick = dict(start=int(picks[j])) if strided else dict(sample_idx=picks[j])
        idx, passes = sampled_select(x, k, k / numel, sample_ratio=0.01, strided=strided, resample=resample, **pick)
        assert len(idx) == counts[j] and np.array_equal(PEER.digest(idx), digs[j]), (case, j)
        assert 1 <= passes <= 11
    assert counts.min() < k  # the rule selects data-dependent counts (below k here)


def test_sample_layout_equals_the_official_initialize(fx):
    for (ratio, sratio), (numel, num_selects, num_samples, top, stride) in zip(fx["layout_grid"], fx["layout_rows"]):
        assert sample_layout(int(numel), float(ratio), float(sratio)) == (num_samples, top, stride), (numel, ratio)
        assert math.ceil(int(numel) * float(ratio)) == num_selects


@pytest.mark.parametrize("case", list(PEER.WARMUP_CASES))
def test_warmup_counts_equal_the_official_schedule(fx, case):
    """Their epoch e <-> our iterations e E + 1 .. (e + 1) E (E = warmup_iters; E = 1 and 3 here): the same
    count per stage, given their stage ratios as our warmup_densities, then k."""
    epochs = int(fx[f"warmup_{case}_epochs"])
    ratios, selects = fx[f"warmup_{case}_ratios"], fx[f"warmup_{case}_selects"]
    d = PEER.WARMUP_NUMEL
    k = int(math.ceil(d * 0.001))
    dens = AlgorithmSpec("dgc", k=k, options=(("warmup_densities", [float(r) for r in ratios[:epochs]]),
                                              ("warmup_iters", 1))).opt("warmup_densities")
    for E in (1, 3):
        for e, want in enumerate(selects):
            for t in range(e * E + 1, (e + 1) * E + 1):
                assert warmup_k(k, d, t, E, dens)[0] == want, (case, E, e, t)


# ------------------------------------------------------------------ definition

def _grads(P, T, d, seed=0, dtype=np.float64):
    return [[np.random.default_rng([seed, p, t]).standard_normal(d).astype(dtype) for p in range(P)]
            for t in range(1, T + 1)]


def test_momentum_zero_exact_is_topk_bit_for_bit():
    """m = 0, exact selection: u = alpha G, v = eps + u -- error-feedback Top-k, to the bit."""
    P, T, d, k = 3, 5, 200, 7
    x0 = np.random.default_rng(1).standard_normal(d)
    grads = _grads(P, T, d)
    a = list(_run(AlgorithmSpec("dgc", k=k, options=(("selection", "exact"),)), P, T, x0, grads, 0.1))
    b = list(_run(AlgorithmSpec("topk", k=k), P, T, x0, grads, 0.1))
    for (_, oa, _), (_, ob, _) in zip(a, b):
        for x, y in zip(oa, ob):
            assert np.array_equal(x.v, y.v) and np.array_equal(x.residual, y.residual)
            assert np.array_equal(x.update, y.update) and x.n_selected == y.n_selected


@pytest.mark.parametrize("masking", ["on", "off"])
def test_momentum_correction_and_masking_follow_eq_5(masking):
    """u_t = m u_{t-1} + lr G_t, v_t = v_{t-1} + u_t; sent coordinates: v = 0, and u = 0 with masking on."""
    P, T, d, k, m, lr = 2, 6, 60, 4, 0.9, 0.05
    x0 = np.zeros(d)
    grads = _grads(P, T, d, seed=4)
    spec = AlgorithmSpec("dgc", k=k, momentum=m, options=(("selection", "exact"), ("momentum_masking", masking)))
    u = [np.zeros(d) for _ in range(P)]
    v = [np.zeros(d) for _ in range(P)]
    x = x0.copy()
    for t, outs, states in _run(spec, P, T, x0, grads, lr):
        g = np.zeros(d)
        for p, o in enumerate(outs):
            u[p] = m * u[p] + lr * grads[t - 1][p]
            v[p] = v[p] + u[p]
            np.testing.assert_array_equal(o.acc, v[p])
            sel = topk(v[p], k)
            g[sel.idx] += sel.val
            v[p][sel.idx] = 0.0
            if masking == "on":
                u[p][sel.idx] = 0.0
            np.testing.assert_array_equal(o.residual, v[p])
            np.testing.assert_array_equal(states[p]["dgc_u"], u[p])
        x = x - g / P
        np.testing.assert_allclose(outs[0].v, x, rtol=1e-13, atol=1e-15)


def test_local_clipping_scales_each_segment_to_c_over_sqrt_p():
    P, d, c = 4, 50, 1.0
    x0 = np.zeros(d)
    grads = _grads(P, 1, d, seed=2)
    spec = AlgorithmSpec("dgc", k=d, segments=(30, 20), options=(("clip_norm", c), ("selection", "exact")))
    (_, outs, states), = _run(spec, P, 1, x0, grads, 1.0)
    for p, o in enumerate(outs):
        np.testing.assert_array_equal(o.grad, grads[0][p])  # the reported gradient is the unclipped one
        for lo, hi in ((0, 30), (30, 50)):
            n = np.linalg.norm(grads[0][p][lo:hi])
            assert n > c / 2  # clipped: every segment's norm is above c / sqrt(4)
            np.testing.assert_allclose(o.acc[lo:hi], grads[0][p][lo:hi] * (c / 2) / (n + 1e-6), rtol=1e-12)


def test_warmup_schedule_and_sampled_counts_in_a_run():
    """Warm-up: k(t) = ceil(r_s d) for stage s = (t - 1) // E, then k; the sampled selection sends at most that."""
    P, d, k, E = 2, 4000, 4, 2
    dens = (0.25, 0.0625, 0.015625, 0.004)
    grads = _grads(P, 10, d, seed=7)
    want = [1000, 1000, 250, 250, 63, 63, 16, 16, 4, 4]
    for selection in ("exact", "sampled"):
        spec = AlgorithmSpec("dgc", k=k, momentum=0.9,
                             options=(("selection", selection), ("warmup_iters", E), ("warmup_densities", dens)))
        got = [[o.n_selected for o in outs] for _, outs, _ in _run(spec, P, 10, np.zeros(d), grads, 0.1)]
        if selection == "exact":
            assert got == [[w] * P for w in want]
        else:
            assert all(0 < n <= w for row, w in zip(got, want) for n in row)
    assert spec.opt("warmup_densities") == PAPER_WARMUP_DENSITIES


def test_sampled_draws_are_seeded_per_worker_and_iteration():
    d, k = 30000, 30
    x = np.random.default_rng(0).standard_normal(d)
    spec = AlgorithmSpec("dgc", k=k, seed=5)
    ctx = StepContext(rank=1, P=2, iteration=3, d=d, hi=d)
    a = spec.algorithm.select(spec, x, k, ctx)
    num_samples, top, stride = sample_layout(d, k / d, 0.01)
    start = int(np.random.default_rng([5, 1, 3, DGC_STREAM]).integers(0, stride))
    idx, _ = sampled_select(x, k, k / d, start=start)
    assert np.array_equal(a.idx, idx) and np.array_equal(a.val, x[idx]) and 0 < len(idx) <= k


# ------------------------------------------------------------------ contraction (Stich et al. 2018, Lemma A.1)

@settings(max_examples=60, deadline=None)
@given(arrays(np.float64, st.integers(1, 80), elements=st.floats(-1e6, 1e6, allow_subnormal=False)),
       st.integers(1, 80), st.floats(0.0, 0.99), st.integers(1, 4))
def test_exact_selection_is_a_k_over_d_contraction_of_the_accumulated_v(g0, k, m, steps):
    """||v - C(v)||^2 <= (1 - k/d) ||v||^2 for the accumulated velocity v, whatever the momentum history."""
    d = g0.shape[0]
    k = min(k, d)
    spec = AlgorithmSpec("dgc", k=k, momentum=m, options=(("selection", "exact"),))
    algo = spec.algorithm
    ctx = StepContext(rank=0, P=1, iteration=1, d=d, hi=d)
    res = np.zeros(d)
    for s in range(steps):
        v = algo.accumulate(spec, np.roll(g0, s), 1.0, res, ctx)
        sel = algo.select(spec, v, k, ctx)
        res = v.copy()
        res[sel.idx] = 0.0
        assert res @ res <= (1 - k / d) * (v @ v) * (1 + 1e-12) + 1e-300
        ctx.state["dgc_u"][sel.idx] = 0.0


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("opts,needle", [
    ({"warmup_densities": [0.25, 0.5]}, "dgc.warmup_densities = [0.25, 0.5] is not decreasing in density: valid"),
    ({"warmup_densities": [0.25, 0.25]}, "is not decreasing in density"),
    ({"warmup_densities": [1.0, 0.5]}, "dgc.warmup_densities = [1.0, 0.5] is out of range: valid"),
    ({"warmup_densities": "0.25, 0.5"}, "dgc.warmup_densities = '0.25, 0.5' is not decreasing in density"),
    ({"warmup_densities": "0.25, x"}, "dgc.warmup_densities = '0.25, x' is out of range: valid"),
    ({"sample_ratio": 0.001}, "dgc.sample_ratio = 0.001 is out of range: valid 0.01 <= dgc.sample_ratio <= 1.0"),
    ({"selection": "approx"}, "dgc.selection = 'approx' is unknown: valid sampled, exact"),
    ({"clip_norm": -1.0}, "dgc.clip_norm = -1.0 is out of range"),
    ({"warmup_iters": -1}, "dgc.warmup_iters = -1 is out of range"),
    ({"compress_upper_bound": 1.0}, "is out of range: valid 1.0 < dgc.compress_upper_bound"),
])
def test_bad_options_are_one_line_config_errors(opts, needle):
    with pytest.raises(ConfigError) as e:
        check_options("dgc", opts)
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="dgc"):
        AlgorithmSpec("dgc", k=3, options=tuple(opts.items()))


def test_densities_as_a_scenario_string_and_a_bad_schedule_exits_2(tmp_path):
    assert AlgorithmSpec("dgc", k=3, options=(("warmup_densities", " 0.5,0.1 "),)).opt("warmup_densities") == (0.5, 0.1)
    assert AlgorithmSpec("dgc", k=3, options=(("warmup_densities", ""),)).opt("warmup_densities") == ()
    from click.testing import CliRunner

    from experiments.cli import main

    scenario = tmp_path / "s.toml"
    scenario.write_text('[algorithm.dgc]\nwarmup_densities = "0.25, 0.5"\n')
    r = CliRunner().invoke(main, ["run", str(scenario), "--out", str(tmp_path / "o"), "--algorithms", "dgc",
                                  "--quiet"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "is not decreasing in density: valid" in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ torch backend (momentum, warm-up, clip, sampling)

def _torch_specs():
    return [AlgorithmSpec("dgc", k=8, momentum=0.9, options=(("warmup_iters", 1), ("clip_norm", 5.0))),
            AlgorithmSpec("dgc", k=8, momentum=0.9, segments=(1000, 1000), options=(("sampling", "uniform"),))]


def _torch_workers(P):
    from sim.workloads.data import shard_indices
    from sim.workloads.objectives import make_objective
    from sim.engine.runner import Workers

    obj = make_objective("sines", d=2000, n=48, seed=3)
    return Workers(obj, shard_indices(obj.n, P, seed=3), 4, 3), obj.x0(3)


def _torch_lr(t):
    return 0.3


def _torch_job(ctx, P):
    from sim.distributed.backend import run_worker

    w, x0 = _torch_workers(ctx.P)
    return [run_worker(ctx.rank, ctx.P, s, w, T=5, lr=_torch_lr, x0=x0, transport=ctx.transport,
                       keep_trajectory=True).trajectory for s in _torch_specs()]


def test_torch_backend_equals_the_simulator_with_sampling_warmup_and_clipping():
    """At d = 2000 the sampled threshold really samples (and selects varying counts); P = 2, float64."""
    pytest.importorskip("torch")
    from sim.engine.runner import run_algorithm
    from sim.distributed.backend import launch_local

    P = 2
    got = launch_local(P, _torch_job, (P,), timeout_s=60.0)
    w, x0 = _torch_workers(P)
    for i, spec in enumerate(_torch_specs()):
        traj, counts = [], set()
        run_algorithm(spec, w, T=5, lr=_torch_lr, x0=x0, driver="lockstep",
                      on_step=lambda t, outs: (traj.append([o.v.copy() for o in outs]),
                                               counts.update(o.n_selected for o in outs)))
        for r in range(P):
            for t in range(5):
                assert np.array_equal(got[r][i][t], traj[t][r]), (spec.label, r, t + 1)
        if i == 0:
            assert {500, 125, 8} <= counts  # the warm-up stages (d = 2000: 0.25 d, 0.0625 d), then k

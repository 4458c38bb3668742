"""The hybrid per-bucket policy (#22 item 3; sim/engine/hybrid.py, docs/hybrid.md).

1. The optimiser (:func:`sim.engine.hybrid.choose_hybrid`, dynamic programming) against brute force: every one of the
   (1 + J)^B plans timed by :func:`sim.engine.timeline.simulate_timeline`, the least iteration among those within the
   bound equals the optimiser's, exactly, for each bound (density cap, density floor, measured error), blocking or not,
   with stragglers, flat and hierarchical clusters.
2. The plan file round-trips; bad files are one-line errors.
3. The timeline: an all-compressed plan at density k / d is sparse_policy = "bucket", an all-dense plan dense "ddp",
   both exactly.
4. The numerics: dense segments are the dense allreduce with a zero residual (exact error feedback), compressed ones
   the algorithm at their own k_b; a [model] run with the plan equals the DDP hook with the plan bit for bit in float64
   (torch: skipped without it, failed under CI=true).
5. The command: ``sparsim workload hybrid-plan`` writes a plan that ``sparsim run`` times at the iteration the planner
   reported; bad input is one line, exit code 2.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.algorithms import AlgorithmSpec, sgd_step
from sim.base.errors import ConfigError
from sim.engine.drivers import run_lockstep
from sim.engine.hybrid import (DiscardTable, HybridPlan, check_plan_algorithm, choose_hybrid, discarded_fractions,
                               hybrid_algorithms, load_plan, plan_segments, resource_table, save_plan)
from sim.engine.timeline import CollectiveTimer, TimelinePolicy, ddp_buckets, simulate_timeline
from sim.machine.compute import ComputeModel
from sim.machine.network import get_preset
from sim.machine.topology import get_cluster_preset
from sim.workloads import LayerCost, ParamTensor, Workload

ROOT = Path(__file__).resolve().parents[1]
FMNIST = "/usr/share/datasets/fashion-mnist"


def toy(sizes=(300_000, 60_000, 900_000, 20_000), bwd=(2e-3, 1e-3, 4e-3, 5e-4), fwd=1e-3, name="toy"):
    """Layers with one weight tensor each (and a small bias), their backward seconds given: one DDP bucket per layer
    with caps of 0.001 MiB (POL)."""
    layers = [LayerCost(f"l{i}", forward_s=fwd, backward_s=b) for i, b in enumerate(bwd)]
    tensors = []
    for i, n in enumerate(sizes):
        tensors.append(ParamTensor(f"l{i}.weight", n, f"l{i}"))
        tensors.append(ParamTensor(f"l{i}.bias", 10, f"l{i}"))
    return Workload(name, layers, tensors, measured_batch=32)


POL = TimelinePolicy(bucket_cap_mb=0.001, first_bucket_mb=0.001)  # 262 float32 elements: a bucket per layer


def brute_force(wl, net, spec, P, dens, bound, value, errors=None, policy=POL, compute=None, dense="ring"):
    """The least first-iteration time over every plan within the bound (simulate_timeline of each), and the plans
    reaching it."""
    compute = compute or ComputeModel()
    buckets = ddp_buckets(wl, policy, spec.value_bytes)
    cost, cap = resource_table(bound, value, [b.numel for b in buckets], dens, errors)
    timer = CollectiveTimer(P, net, compute, "auto")
    best, arg = None, []
    for combo in itertools.product(range(1 + len(dens)), repeat=len(buckets)):
        used = 0.0
        for b, c in enumerate(combo):
            used += cost[b, c]
        if not used <= cap:
            continue
        plan = HybridPlan(wl.name, wl.d, tuple(b.numel for b in buckets),
                          tuple(None if c == 0 else dens[c - 1] for c in combo), dense, spec.value_bytes,
                          policy.bucket_cap_mb, policy.first_bucket_mb)
        t = float(simulate_timeline(spec, wl, P, network=net, policy=plan.policy(policy), compute=compute,
                                    timer=timer).iter_s[0])
        if best is None or t < best:
            best, arg = t, [combo]
        elif t == best:
            arg.append(combo)
    return best, arg


def _choice_of(plan, dens):
    return tuple(0 if r is None else 1 + dens.index(r) for r in plan.densities)


# ------------------------------------------------------------------------------------ 1. the optimiser


CASES = {
    # name: (network, P, algorithm, bound, value, blocking, compute)
    "10GbE-topk-floor": (get_preset("10GbE"), 8, "topk", "min_density", 0.05, False, None),
    "10GbE-gtopk-floor-blocking": (get_preset("10GbE"), 8, "gtopk", "min_density", 0.05, True, None),
    "1GbE-gtopk-cap": (get_preset("1GbE"), 16, "gtopk", "density", 0.3, False, None),
    "1GbE-topk-cap-blocking": (get_preset("1GbE"), 4, "topk", "density", 0.5, True, None),
    "icdcs-gtopk-floor": (get_cluster_preset("gtopk-icdcs", 8), 8, "gtopk", "min_density", 0.2, False, None),
    "10GbE-gtopk-floor-stragglers": (get_preset("10GbE"), 8, "gtopk", "min_density", 0.05, False,
                                     ComputeModel(straggler_prob=0.3, straggler_factor=2.0, seed=3)),
    "10GbE-topk-floor-stragglers-blocking": (get_preset("10GbE"), 4, "topk", "min_density", 0.05, True,
                                             ComputeModel(jitter="lognormal", jitter_scale=0.5, seed=1)),
    # compression that depends on k (Algorithm.compression_work): the optimiser must price each candidate density's
    # compression as the timeline does (it priced a Top-k selection for every algorithm)
    "10GbE-randk-floor-scan": (get_preset("10GbE"), 8, "randk", "min_density", 0.05, False,
                               ComputeModel(scan_coeff_s=2e-8)),
    "10GbE-gaussiank-cap-scan-blocking": (get_preset("10GbE"), 4, "gaussiank", "density", 0.3, True,
                                          ComputeModel(scan_coeff_s=2e-9)),
}
DENS = (0.01, 0.1)


@pytest.mark.parametrize("case", list(CASES))
def test_optimiser_equals_brute_force(case):
    net, P, algo, bound, value, blocking, compute = CASES[case]
    wl = toy()
    G = getattr(net, "gpus_per_node", 1)
    spec = AlgorithmSpec(algo, k=1, gpus_per_node=G, collective="tree" if algo == "gtopk" and G == 1 else None)
    pol = dataclasses.replace(POL, blocking=blocking)
    ch = choose_hybrid(wl, net, spec, P, densities=DENS, bound=bound, value=value, policy=pol, compute=compute)
    best, arg = brute_force(wl, net, spec, P, DENS, bound, value, policy=pol, compute=compute)
    assert len(ch.plan.bucket_sizes) == 4
    assert ch.iter_s == best, (case, ch.iter_s, best)
    assert _choice_of(ch.plan, DENS) in arg
    assert ch.best_uniform is not None and ch.gain == ch.best_uniform.iter_s / ch.iter_s


def test_optimiser_finds_a_mixed_plan_faster_than_every_uniform_one():
    """A case where the answer is neither uniform nor all dense: 10 GbE, Top-k, overall density >= 0.05 -- the
    small, late-launched buckets go dense or at 0.1 behind backward and the big ones at 0.01."""
    net, P, algo, bound, value, blocking, compute = CASES["10GbE-topk-floor"]
    ch = choose_hybrid(toy(), net, AlgorithmSpec(algo, k=1), P, densities=DENS, bound=bound, value=value, policy=POL)
    assert len(set(ch.plan.densities)) > 1
    assert ch.gain > 1.0
    assert ch.plan.nominal_density() >= value


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(2_000, 400_000), min_size=1, max_size=4),
       bwd=st.lists(st.floats(1e-5, 5e-3), min_size=4, max_size=4),
       errs=st.lists(st.floats(0.0, 0.4), min_size=8, max_size=8),
       value=st.floats(0.0, 1.0), blocking=st.booleans())
def test_optimiser_under_the_error_bound_equals_brute_force(sizes, bwd, errs, value, blocking):
    wl = toy(tuple(sizes), tuple(bwd[:len(sizes)]))
    net = get_preset("10GbE")
    spec = AlgorithmSpec("gtopk", k=1)
    pol = dataclasses.replace(POL, blocking=blocking)
    B = len(ddp_buckets(wl, pol))
    tab = np.array(errs[:2 * B]).reshape(B, 2)
    tab[:, 1] = tab[:, 1] * 0.5  # the denser candidate discards less
    table = DiscardTable(DENS, tab, np.full(2, np.nan), np.full(2, np.nan))
    ch = choose_hybrid(wl, net, spec, 8, densities=DENS, bound="error", value=value, errors=table, policy=pol)
    best, arg = brute_force(wl, net, spec, 8, DENS, "error", value, table, policy=pol)
    assert ch.iter_s == best
    assert _choice_of(ch.plan, DENS) in arg
    assert ch.resource <= value + 1e-12


def test_resource_table_states_each_bound():
    cost, cap = resource_table("density", 0.1, [100, 300], (0.01, 0.5))
    assert cost.tolist() == [[100, 1, 50], [300, 3, 150]] and cap == pytest.approx(40)
    cost, cap = resource_table("min_density", 0.1, [100, 300], (0.01, 0.5))
    assert cost.tolist() == [[0, 99, 50], [0, 297, 150]] and cap == pytest.approx(360)
    tab = DiscardTable((0.01, 0.5), np.array([[0.2, 0.1], [0.3, 0.05]]), np.zeros(2), np.zeros(2))
    cost, cap = resource_table("error", 0.25, [100, 300], (0.01, 0.5), tab)
    assert cost.tolist() == [[0, 0.2, 0.1], [0, 0.3, 0.05]] and cap == pytest.approx(0.25)


def test_discarded_fractions_closed_form():
    acc = np.array([3.0, -1.0, 0.5, 2.0, 0.0, -4.0])  # ||acc||^2 = 9 + 1 + 0.25 + 4 + 0 + 16 = 30.25
    got = discarded_fractions(acc, [0, 3, 6], (0.34, 1.0))  # k = round(0.34 x 3) = 1, then 3
    assert got.tolist() == [[(1 + 0.25) / 30.25, 0.0], [(0 + 4) / 30.25, 0.0]]
    assert discarded_fractions(np.zeros(4), [0, 4], (0.5,)).tolist() == [[0.0]]


# ------------------------------------------------------------------------------------ 2. the plan file


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10**7), st.one_of(st.none(), st.floats(1e-6, 1.0))), min_size=1,
                max_size=12),
       st.sampled_from(["ring", "recursive_doubling", "hierarchical"]), st.sampled_from([4, 8]),
       st.one_of(st.none(), st.floats(0.01, 100.0)), st.sampled_from(hybrid_algorithms()))
def test_plan_file_round_trips(tmp_path_factory, buckets, coll, eb, cap, algo):
    plan = HybridPlan("net", sum(n for n, _ in buckets), tuple(n for n, _ in buckets), tuple(r for _, r in buckets),
                      coll, eb, cap, None, algo, made_with=json.dumps({"P": 8}))
    path = tmp_path_factory.mktemp("plan") / "p.json"
    save_plan(plan, path)
    back = load_plan(path)
    assert back == plan and back.ks() == plan.ks() and json.loads(back.made_with) == {"P": 8} and back.algorithm == algo
    assert not list(path.parent.glob("*.partial"))
    with pytest.raises(ConfigError, match="exists"):
        save_plan(plan, path)


def _write(tmp_path, **change):
    plan = HybridPlan("toy", 300, (100, 200), (None, 0.1), algorithm="gtopk")
    raw = plan.to_dict()
    for k, v in change.items():
        if k.startswith("bucket1_"):
            raw["buckets"][1][k[8:]] = v
        elif v is None:
            raw.pop(k)
        else:
            raw[k] = v
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(raw))
    return p


@pytest.mark.parametrize("change, match", [
    ({"format": "other/1"}, "format = 'other/1'"),
    ({"bucket1_density": 1.5}, "bucket 1 density = 1.5 is out of range: valid 0 < density <= 1"),
    ({"bucket1_density": 0.0}, "bucket 1 density = 0.0 is out of range"),
    ({"bucket1_mode": "sparse"}, "mode = 'sparse' is unknown: valid dense, compressed"),
    ({"bucket1_k": 7}, "k = 7 but its density gives 20"),
    ({"d": 301}, "bucket sizes sum to 300: valid a sum of d = 301"),
    ({"dense_collective": "tree"}, "dense_collective = 'tree' is unknown"),
    ({"extra": 1}, "unknown key 'extra'"),
    ({"model": None}, "missing key 'model'"),
    ({"algorithm": None}, "missing key 'algorithm'"),
    ({"algorithm": "dgc"}, "algorithm = 'dgc': valid topk, gtopk"),
    ({"algorithm": 3}, "algorithm = 3: valid topk, gtopk"),
    ({"format": "sparsim.hybrid_plan/1"}, "written before plans named their algorithm"),
])
def test_bad_plan_files_are_one_line(tmp_path, change, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_plan(_write(tmp_path, **change))
    assert "\n" not in str(err.value)


def test_missing_and_non_json_plan_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_plan(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_plan(tmp_path / "x.json")


# ------------------------------------------------------------------------------------ 3. the timeline


def _resnet50():
    from sim.workloads.zoo import get_model

    return get_model("resnet50")


@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize("algo", ["topk", "gtopk"])
def test_all_compressed_plan_is_the_bucket_policy(algo, blocking):
    from sim.workloads.devices import get_device

    wl, net, P = _resnet50(), get_cluster_preset("gtopk-icdcs", 16), 16
    spec = AlgorithmSpec(algo, k=round(0.001 * wl.d), gpus_per_node=4)
    pol = TimelinePolicy(sparse="bucket", blocking=blocking)
    sizes = tuple(b.numel for b in ddp_buckets(wl, pol))
    plan = HybridPlan(wl.name, wl.d, sizes, (spec.k / wl.d,) * len(sizes))
    kw = dict(network=net, device=get_device("P102-100"), compute=ComputeModel(straggler_prob=0.2, straggler_factor=1.5),
              iterations=3, trace_iterations=(2,))
    a = simulate_timeline(spec, wl, P, policy=pol, **kw)
    b = simulate_timeline(spec, wl, P, policy=plan.policy(pol), **kw)
    for f in ("iter_s", "compute_s", "compress_s", "comm_s", "exposed_comm_s", "overlap_ratio"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.ks == b.ks and a.bytes_per_rank == b.bytes_per_rank and len(set(a.ks)) > 1
    assert a.timelines[0].comm == b.timelines[0].comm and a.timelines[0].compute == b.timelines[0].compute


def test_all_dense_plan_is_dense_ddp():
    wl, net, P = _resnet50(), get_cluster_preset("dgx-h100", 16), 16
    from sim.workloads.devices import get_device

    sizes = tuple(b.numel for b in ddp_buckets(wl))
    plan = HybridPlan(wl.name, wl.d, sizes, (None,) * len(sizes), "hierarchical")
    kw = dict(network=net, device=get_device("H100"), iterations=2)
    a = simulate_timeline(AlgorithmSpec("dense", collective="hierarchical", gpus_per_node=8), wl, P, **kw)
    b = simulate_timeline(AlgorithmSpec("gtopk", k=1000, gpus_per_node=8), wl, P, policy=plan.policy(), **kw)
    for f in ("iter_s", "compute_s", "compress_s", "comm_s", "exposed_comm_s", "overlap_ratio"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.bytes_per_rank == b.bytes_per_rank and b.ks == [None] * len(sizes) and b.compress_s[0] == 0.0


def test_timeline_refuses_a_plan_of_another_model_or_buckets():
    wl = toy()
    plan = HybridPlan("other", wl.d, tuple(b.numel for b in ddp_buckets(wl, POL)), (None,) * 4,
                      bucket_cap_mb=0.001, first_bucket_mb=0.001)
    spec = AlgorithmSpec("topk", k=10)
    with pytest.raises(ConfigError, match="is for model 'other'.*this run's model is 'toy'"):
        simulate_timeline(spec, wl, 4, network=get_preset("1GbE"), policy=plan.policy(POL))
    plan = dataclasses.replace(plan, model="toy")
    with pytest.raises(ConfigError, match="does not fit this run.s DDP buckets: 2 buckets, the plan 4"):
        simulate_timeline(spec, wl, 4, network=get_preset("1GbE"), policy=TimelinePolicy(sparse="hybrid", plan=plan))
    with pytest.raises(ConfigError, match="needs a plan"):
        TimelinePolicy(sparse="hybrid")
    with pytest.raises(ConfigError, match="needs sparse policy 'hybrid'"):
        TimelinePolicy(sparse="bucket", plan=plan)


# ------------------------------------------------------------------------------------ 4. the numerics


def _steps(spec, P, d, T, seed=0):
    """T sgd_steps of spec on P workers with fixed random gradients; the list of per-step outputs."""
    rng = np.random.default_rng(seed)
    grads = rng.standard_normal((T, P, d))
    v = np.zeros(d)
    res = [np.zeros(d) for _ in range(P)]
    states = [{} for _ in range(P)]
    out = []
    for t in range(T):
        progs = [sgd_step(spec, p, P, v, res[p], lambda x, g=grads[t, p]: g, 1, 0.5, t + 1, states[p]) for p in range(P)]
        outs = run_lockstep(progs)
        v, res = outs[0].v, [o.residual for o in outs]
        out.append(outs)
    return out, grads


@pytest.mark.parametrize("algo", ["topk", "gtopk", "randk"])
def test_dense_segments_are_the_allreduce_with_zero_residual(algo):
    P, segs, T = 3, (40, 100, 60), 4
    d = sum(segs)
    spec = AlgorithmSpec(algo, k=5, segments=segs, segment_densities=(0.1, None, 0.05))
    outs, grads = _steps(spec, P, d, T)
    lo, hi = 40, 140
    for t, step in enumerate(outs):
        for o in step:
            assert np.all(o.residual[lo:hi] == 0.0)  # exact error feedback: nothing left behind
        # the dense segment's update is the ring allreduce of 0.5 G_p: the dense algorithm's own result
        dense = [sgd_step(AlgorithmSpec("dense"), p, P, np.zeros(hi - lo), np.zeros(hi - lo),
                          lambda x, g=grads[t, p, lo:hi]: g, 1, 0.5, t + 1) for p in range(P)]
        assert np.array_equal(step[0].update[lo:hi], run_lockstep(dense)[0].update)
        assert step[0].n_selected == 4 + 100 + 3  # k_b = round(0.1 x 40), d_b, round(0.05 x 60)


def test_uniform_segment_densities_are_the_layerwise_run():
    P, segs, T = 4, (50, 150, 100), 3
    d = sum(segs)
    a, _ = _steps(AlgorithmSpec("gtopk", k=15, segments=segs), P, d, T)
    b, _ = _steps(AlgorithmSpec("gtopk", k=15, segments=segs, segment_densities=(15 / d,) * 3), P, d, T)
    for sa, sb in zip(a, b):
        for oa, ob in zip(sa, sb):
            assert np.array_equal(oa.v, ob.v) and np.array_equal(oa.residual, ob.residual)


@pytest.mark.parametrize("kw, match", [
    (dict(name="topk", k=1, segments=(2, 3), segment_densities=(0.5,)), "does not fit 2 segments"),
    (dict(name="topk", k=1, segment_densities=(0.5,)), "does not fit no segments"),
    (dict(name="topk", k=1, segments=(2, 3), segment_densities=(0.5, 1.5)), r"segment_densities\[1\] = 1.5"),
    (dict(name="dgc", k=1, segments=(2, 3), segment_densities=(0.5, None)), "valid topk, gtopk"),
    (dict(name="topk", k=1, dense_collective="ring"), "without segment_densities"),
    (dict(name="topk", k=1, segments=(2, 3), segment_densities=(0.5, None), dense_collective="tree"),
     "dense_collective = 'tree' is unknown"),
])
def test_segment_density_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        AlgorithmSpec(**kw)


# ------------------------------------------------------------------------------------ 5. the command


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "experiments.cli", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=600)


RESNET50 = str(ROOT / "experiments" / "scenarios" / "resnet50-1gbe.toml")


def test_command_writes_a_plan_that_the_timing_run_times_as_planned(tmp_path):
    plan = tmp_path / "plan.json"
    r = _cli("workload", "hybrid-plan", RESNET50, "--set", "workload.sparse_policy='bucket'", "--min-density", "0.01",
             "--out", str(plan))
    assert r.returncode == 0, r.stderr
    assert "gain over the best uniform policy" in r.stdout and f"wrote {plan}" in r.stdout
    p = load_plan(plan)
    made = json.loads(p.made_with)
    assert p.model == "resnet50" and p.nominal_density() >= 0.01 and made["P"] == 16 and made["bound"] == "min_density"
    out = tmp_path / "run"
    r = _cli("run", RESNET50, "--set", "workload.sparse_policy='hybrid'", "--set", f"workload.hybrid_plan='{plan}'",
             "--set", "algorithms=['topk']", "--set", "training.iterations=1", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    import csv

    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert rows[0]["algorithm"] == "topk" and float(rows[0]["iter_time_s"]) == made["iter_s"]


@pytest.mark.parametrize("args, match", [
    (["--min-density", "0.01", "--density-bound", "0.1"], "give one bound"),
    (["--min-density", "0.01", "--densities", "0,0.1"], "density = 0.0 is out of range: valid 0 < density <= 1"),
    (["--min-density", "1.5"], "min_density = 1.5 is out of range"),
    (["--density-bound", "0.0001"], "density_bound = 0.0001: no plan meets it"),
    (["--error-bound", "0.1"], "--error-bound measures the errors on a numerics run of a network"),
    (["--min-density", "0.01", "--algorithm", "dense"], "--algorithm 'dense' is dense"),
    (["--min-density", "0.01", "--measure-iterations", "5"], "--measure-iterations 5: used only with --error-bound"),
])
def test_command_bad_input_is_one_line_exit_2(tmp_path, args, match):
    r = _cli("workload", "hybrid-plan", RESNET50, *args, "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and match in r.stderr, r.stderr
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("key, needle", [
    ("workload.trace_ranks=2", "used only by sparsim run (its trace.json)"),
    ("workload.trace_iterations=[1]", "used only by sparsim run (its trace.json)"),
    ("training.iterations=3", "used only by sparsim run (the run's length)"),
    ("compression.density=0.05", "used only by --error-bound"),
    ("workload.dense_policy='none'", "used only by sparsim run with dense among the algorithms"),
    ("workload.sparse_policy='layer'", "valid here 'bucket'"),
    ("algorithm.gtopk.collective='recursive_doubling'", "the plan reads the options of its own algorithm, topk"),
    ("torch.timeout_s=5", "used only by sparsim run on the torch backend"),
])
def test_command_refuses_a_set_key_the_plan_does_not_read(tmp_path, key, needle):
    """A --set key the plan does not read is one line naming the --set, the key and what would read it (exit 2)."""
    r = _cli("workload", "hybrid-plan", RESNET50, "--set", key, "--min-density", "0.01", "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith(f"error: --set {key}: {key.split('=')[0]} is not read by "
                                                           "the hybrid plan under --min-density") and needle in line
    assert not (tmp_path / "p.json").exists()


def test_unused_plan_keys_follow_the_bound():
    """compression.density, the step size and the data are read by --error-bound's measuring run only; the keys that
    time the plan (the cluster, the bucket caps, the batch) are read under every bound."""
    from experiments.hybrid import unused_plan_key
    from experiments.scenario import load_scenario

    sc = load_scenario(RESNET50)
    for key in ("compression.density", "training.lr", "data.path", "workload.sparse_policy"):
        assert unused_plan_key(key, sc, "min_density") is not None and unused_plan_key(key, sc, "error") is None
    for key in ("cluster.P", "workload.bucket_cap_mb", "training.batch_size", "compute.select_coeff_s",
                "workload.hook_blocks_backward", "compression.value_bytes", "algorithm.topk.collective"):
        for bound in ("density", "min_density", "error"):
            assert unused_plan_key(key, sc, bound) is None, (key, bound)


@pytest.mark.parametrize("sets, needle", [
    (["cluster.P=abc"], "error: --set cluster.P=abc: cluster.P = 'abc' must be an integer"),
    (["algorithms=['dense','dgc']"], "error: --set algorithms=['dense','dgc']: algorithms = ['dense', 'dgc']: no run can "
                                     "train a hybrid plan of dgc"),
])
def test_command_blames_a_bad_set_value_on_the_set(tmp_path, sets, needle):
    r = _cli("workload", "hybrid-plan", RESNET50, *[x for v in sets for x in ("--set", v)], "--min-density", "0.01",
             "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(needle), r.stderr


def test_timing_and_numerics_runs_hold_a_plan_to_one_rule(tmp_path):
    """The timing run (timeline) and a [model] run (numerics) refuse the same plans in the same words, before anything
    runs: a Top-k plan run by gTop-k, DGC with any plan (sim.engine.hybrid.check_plan_algorithm). The optimiser refuses
    to make a plan of DGC, and the timeline API holds its own spec to the plan's algorithm."""
    from experiments.resolve import timeline_policy
    from experiments.scenario import load_scenario
    from sim.workloads.zoo import get_model

    rn = get_model("resnet50")
    sizes = tuple(b.numel for b in ddp_buckets(rn))
    plan = tmp_path / "rn.json"
    save_plan(HybridPlan("resnet50", rn.d, sizes, (0.01,) * len(sizes), algorithm="topk"), plan)
    msgs = {}
    for algos, match in ((["dense", "gtopk"], "is for algorithm 'topk': this run's algorithm is 'gtopk'"),
                         (["dgc"], "algorithm = 'dgc' with a hybrid plan")):
        got = []
        for base in ([], ["model.name='lenet5'", "workload.model=''", "data.dataset='fashion-mnist'"]):
            sc = load_scenario(RESNET50 if not base else None, [*base, "workload.sparse_policy='hybrid'",
                                                                 f"workload.hybrid_plan='{plan}'", f"algorithms={algos!r}"]
                               if base else ["workload.sparse_policy='hybrid'", f"workload.hybrid_plan='{plan}'",
                                             f"algorithms={algos!r}"])
            with pytest.raises(ConfigError, match=match) as err:
                timeline_policy(sc)  # the timing run and the [model] run (build -> _net_segments) both start here
            got.append(str(err.value))
        assert got[0] == got[1]
        msgs[algos[-1]] = got[0]
    r = _cli("run", RESNET50, "--set", "workload.sparse_policy='hybrid'", "--set", f"workload.hybrid_plan='{plan}'",
             "--set", "algorithms=['dense','gtopk']", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stderr.strip() == f"error: {msgs['gtopk']}" and not (tmp_path / "r").exists()
    p = load_plan(plan)
    with pytest.raises(ConfigError, match="is for algorithm 'topk'"):
        from sim.workloads.devices import get_device

        simulate_timeline(AlgorithmSpec("gtopk", k=100), rn, 4, network=get_preset("1GbE"), policy=p.policy(),
                          device=get_device("P102-100"))
    with pytest.raises(ConfigError, match="no run can train a hybrid plan"):
        choose_hybrid(toy(), get_preset("1GbE"), AlgorithmSpec("dgc", k=1), 4, densities=DENS, bound="min_density",
                      value=0.1, policy=POL)


def test_run_summary_prints_the_plans_k(tmp_path):
    """A hybrid run's summary prints the plan's k_b per bucket and the sent density, not the uniform k = density x d."""
    plan = tmp_path / "plan.json"
    r = _cli("workload", "hybrid-plan", RESNET50, "--min-density", "0.01", "--out", str(plan))
    assert r.returncode == 0, r.stderr
    p = load_plan(plan)
    r = _cli("run", RESNET50, "--set", "workload.sparse_policy='hybrid'", "--set", f"workload.hybrid_plan='{plan}'",
             "--set", "algorithms=['topk']", "--set", "training.iterations=1", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    shown = ", ".join("dense" if k is None else f"{k:,}" for k in p.ks())
    assert f"k_b per the hybrid plan for topk (DDP buckets, launch order): {shown}; " in r.stdout
    assert f"density {p.sent_density():.4g}" in r.stdout and "k = 25557 (c = 1000)" not in r.stdout


def test_scenario_file_paths_are_relative_to_the_file(tmp_path):
    """workload.table and workload.hybrid_plan in a scenario file are relative to the file's folder (as data.path);
    given with --set they are relative to the working directory."""
    from experiments.scenario import load_scenario
    from sim.workloads.zoo import get_model

    (tmp_path / "sub").mkdir()
    rn = get_model("resnet50")
    sizes = tuple(b.numel for b in ddp_buckets(rn))
    save_plan(HybridPlan("resnet50", rn.d, sizes, (0.01,) * len(sizes), algorithm="topk"), tmp_path / "sub" / "p.json")
    text = Path(RESNET50).read_text().replace('sparse_policy = "model"', 'sparse_policy = "hybrid"\nhybrid_plan = "p.json"')
    text = text.replace('algorithms = ["dense", "topk", "gtopk"]', 'algorithms = ["dense", "topk"]')
    (tmp_path / "sub" / "s.toml").write_text(text)
    sc = load_scenario(str(tmp_path / "sub" / "s.toml"))
    assert sc.workload.hybrid_plan == str(tmp_path / "sub" / "p.json")
    r = _cli("run", str(tmp_path / "sub" / "s.toml"), "--set", "training.iterations=1", "--out", str(tmp_path / "r"),
             "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (tmp_path / "sub" / "t.toml").write_text('algorithms = ["dense"]\n[workload]\ntable = "layers.csv"\n')
    from experiments.listings import export_layer_table

    export_layer_table(rn, str(tmp_path / "sub" / "layers.csv"))
    sc = load_scenario(str(tmp_path / "sub" / "t.toml"))
    assert sc.workload.table == str(tmp_path / "sub" / "layers.csv")
    assert load_scenario(str(tmp_path / "sub" / "t.toml"), ["workload.table='x.csv'"]).workload.table == "x.csv"


def test_runs_refuse_a_plan_for_another_model_or_buckets(tmp_path):
    wl = toy()
    bad = HybridPlan("vgg16", 1000, (1000,), (0.1,), algorithm="topk")
    save_plan(bad, tmp_path / "vgg.json")
    r = _cli("run", RESNET50, "--set", "workload.sparse_policy='hybrid'", "--set",
             f"workload.hybrid_plan='{tmp_path / 'vgg.json'}'", "--set", "algorithms=['dense','topk']",
             "--out", str(tmp_path / "r1"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "is for model 'vgg16'" in r.stderr and "this run's model is 'resnet50'" in r.stderr
    from sim.workloads.zoo import get_model

    rn = get_model("resnet50")
    sizes = tuple(b.numel for b in ddp_buckets(rn))
    save_plan(HybridPlan("resnet50", rn.d, sizes, (0.01,) * len(sizes), algorithm="topk"), tmp_path / "rn.json")
    r = _cli("run", RESNET50, "--set", "workload.sparse_policy='hybrid'", "--set",
             f"workload.hybrid_plan='{tmp_path / 'rn.json'}'", "--set", "workload.bucket_cap_mb=5",
             "--set", "algorithms=['topk']",
             "--out", str(tmp_path / "r2"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "does not fit this run's DDP buckets" in r.stderr and "valid the bucket caps" in r.stderr
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
    for ov, match in ((["--set", "workload.sparse_policy='hybrid'"], "needs workload.hybrid_plan"),
                      (["--set", "workload.hybrid_plan='x.json'"], "used only with sparse_policy = 'hybrid'")):
        r = _cli("run", RESNET50, *ov, "--out", str(tmp_path / "r3"))
        assert r.returncode == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1
    del wl


# ------------------------------------------------------------------------------------ 4b. the DDP hook (torch)


def _torch():
    """torch, or skip (fail under CI=true: CI installs it)."""
    try:
        import torch
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("torch is not installed: CI installs the torch extra (torch==2.13.0)")
        pytest.skip("torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")
    return torch


def _data():
    if not os.path.isdir(FMNIST):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the Fashion-MNIST files are not in {FMNIST}: .ci/run installs them")
        pytest.skip("dataset-fashion-mnist not installed (CI installs it)")


T, LR, N_TRAIN, N_TEST = 3, 0.1, 512, 64


def _write_idx(path, a):
    with open(path, "wb") as fh:
        fh.write(bytes([0, 0, 8, a.ndim]) + np.asarray(a.shape, dtype=">u4").tobytes() + a.astype(np.uint8).tobytes())


def _scenario(P, data, plan, algorithms):
    from experiments.scenario import load_scenario

    return load_scenario(None, [
        "model.name='lenet5'", "data.dataset='fashion-mnist'", f"data.path='{data}'", "model.gradients='loop'",
        "model.eval_samples=64", "model.test_samples=64", f"cluster.P={P}", f"training.iterations={T}",
        "training.batch_size=4", f"training.lr={LR}", f"training.eval_every={T}", "training.dtype='float64'",
        "compression.density=0.01", "compression.value_bytes=8", f"algorithms={algorithms!r}",
        "workload.bucket_cap_mb=0.05", "workload.sparse_policy='hybrid'", f"workload.hybrid_plan='{plan}'"])


#: DDP cases: (hook algorithm, wire)
HOOK_CASES = [("topk", "allgather"), ("gtopk", "allgather"), ("gtopk", "p2p")]


def hook_rank_job(ctx, P, data, plans):
    """Per rank: a DDP LeNet-5 with the hybrid plan's hook (plans: algorithm -> its plan file), trained T steps on the
    simulator's mini-batches; the flat parameters after each step, the entries sent and the residuals, per case."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from experiments.run import build
    from sim.distributed.ddp_hooks import register_sparse_hook, settle_buckets
    from sim.workloads.nets import build_net
    from sim.workloads.torch_models import flat_params

    torch.set_num_threads(1)
    sc = _scenario(P, data, plans["gtopk"], ["gtopk"])
    built = build(sc)
    X, y = built.objective._X, built.objective._y
    out = {}
    for algo, wire in HOOK_CASES:
        ddp = DDP(build_net("lenet5", seed=sc.seed, dtype="float64"), bucket_cap_mb=0.05)
        batch = lambda t: torch.from_numpy(built.workers.batch_indices(t)[ctx.rank].copy())  # noqa: E731
        settle_buckets(ddp, lambda m: torch.nn.functional.cross_entropy(m(X[batch(1)]), y[batch(1)]))
        state = register_sparse_hook(ddp, algo, plan=plans[algo], lr=LR, wire=wire)
        opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
        traj = []
        for t in range(1, T + 1):
            idx = batch(t)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(X[idx]), y[idx]).backward()
            opt.step()
            traj.append(flat_params(ddp.module))
        out[(algo, wire)] = (traj, state.selected, dict(state.residuals))
    return out


def _write_subset(d):
    from sim.workloads.idx import load_image_dataset

    ds = load_image_dataset("fashion-mnist", FMNIST)
    for split, X, y, n in (("train", ds.X_train, ds.y_train, N_TRAIN), ("t10k", ds.X_test, ds.y_test, N_TEST)):
        _write_idx(d / f"{split}-images-idx3-ubyte", X[:n])
        _write_idx(d / f"{split}-labels-idx1-ubyte", y[:n])


#: The [model] scenario file the command plans from: LeNet-5 on the Fashion-MNIST subset in ./fmnist (relative to the
#: file: data.path), float64, 0.05 MiB buckets (three), gTop-k; 10 GbE at P = 2 or 3.
LENET_TOML = """name = "lenet-hybrid"
algorithms = ["dense", "gtopk"]
[cluster]
P = {P}
network = "10GbE"
[data]
dataset = "fashion-mnist"
path = "fmnist"
[model]
name = "lenet5"
gradients = "loop"
eval_samples = 64
test_samples = 64
[training]
iterations = {T}
batch_size = 4
lr = {LR}
eval_every = {T}
dtype = "float64"
[compression]
value_bytes = 8
[workload]
bucket_cap_mb = 0.05
sparse_policy = "bucket"
"""


@pytest.fixture(scope="module")
def lenet_plan(tmp_path_factory):
    """A Fashion-MNIST subset and two plans for LeNet-5's three DDP buckets (0.05 MiB caps, float64): for Top-k a
    hand-made one -- bucket 0 (the last layers) at 0.1, bucket 1 at 0.01, bucket 2 (the first layers) dense -- and for
    gTop-k the one ``sparsim workload hybrid-plan`` chooses from a scenario file (overall density >= 0.3, candidates
    0.01 and 0.1: at least one bucket must go dense or to 0.1). Returns (data folder, {algorithm: plan file})."""
    _torch()
    _data()
    from sim.engine.timeline import ddp_buckets as buckets_of
    from sim.workloads.nets import build_net, net_workload

    d = tmp_path_factory.mktemp("lenet")
    (d / "fmnist").mkdir()
    _write_subset(d / "fmnist")
    wl = net_workload(build_net("lenet5"), (1, 28, 28), "lenet5")
    sizes = tuple(b.numel for b in buckets_of(wl, TimelinePolicy(bucket_cap_mb=0.05), 8))
    assert len(sizes) == 3
    plans = {"topk": str(d / "plan-topk.json"), "gtopk": str(d / "plan-gtopk.json")}
    save_plan(HybridPlan("lenet5", wl.d, sizes, (0.1, 0.01, None), element_bytes=8, bucket_cap_mb=0.05,
                         algorithm="topk"), plans["topk"])
    (d / "lenet.toml").write_text(LENET_TOML.format(P=2, T=T, LR=LR))
    r = _cli("workload", "hybrid-plan", str(d / "lenet.toml"), "--densities", "0.01,0.1", "--min-density", "0.3",
             "--out", plans["gtopk"], cwd=tmp_path_factory.mktemp("elsewhere"))
    assert r.returncode == 0, r.stderr
    return str(d / "fmnist"), plans


@pytest.fixture(scope="module", params=[2, 3], ids=["P2", "P3"])
def hook_runs(request, lenet_plan):
    torch = _torch()
    from experiments.run import build
    from sim.distributed.backend import launch_local
    from sim.engine.runner import run_algorithm

    P = request.param
    data, plans = lenet_plan
    got = launch_local(P, hook_rank_job, (P, data, plans), timeout_s=120.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sims = {}
        for algo in ("topk", "gtopk"):
            built = build(_scenario(P, data, plans[algo], [algo]))
            spec = built.specs[0]
            traj, res, sel = [], [], []
            run_algorithm(spec, built.workers, T=T, lr=built.lr, x0=built.x0, network=built.network,
                          compute=built.compute, eval_every=T, clock=built.clock,
                          on_step=lambda t, outs, traj=traj, res=res, sel=sel: (
                              traj.append(outs[0].v.copy()), res.append([o.residual.copy() for o in outs]),
                              sel.append([o.n_selected for o in outs])))
            sims[algo] = (spec, traj, res, sel, built)
    finally:
        torch.set_num_threads(threads)
    return P, got, sims, built


def test_hook_with_the_plan_equals_the_simulator(hook_runs):
    """Every rank's parameters after every step equal the simulator's bit for bit at P = 2 (the dense bucket's
    allreduce adds two terms, in either order the same bits). At P = 3 gloo's ring adds the dense bucket's three terms
    in another order than the simulator's ring: the first step's compressed coordinates are still equal bit for bit,
    and every step agrees to rounding (||v_DDP - v_sim|| <= 1e-12 ||v_sim - x0||, as tests/test_net_torch.py)."""
    P, got, sims, built = hook_runs
    spec = sims["topk"][0]
    assert spec.label == "topk[hybrid]" and spec.segment_densities == (None, 0.01, 0.1)  # flat order
    for algo, wire in HOOK_CASES:
        spec, ref, _, _, b = sims[algo]
        comp = np.concatenate([np.full(n, r is not None) for n, r in zip(spec.segments, spec.segment_densities)])
        for r in range(P):
            traj = got[r][(algo, wire)][0]
            assert len(traj) == T
            for t in range(T):
                what = f"{algo} {wire} P={P} rank {r} iteration {t + 1}"
                a, c = traj[t], ref[t]
                if P == 2:
                    assert np.array_equal(a, c), what
                    continue
                if t == 0:  # the compressed buckets' coordinates
                    assert np.array_equal(a[comp], c[comp]), what
                rel = float(np.linalg.norm(a - c) / np.linalg.norm(c - b.x0))
                assert rel <= 1e-12, (what, rel)


def test_one_plan_file_one_choice_of_k_everywhere(hook_runs, lenet_plan):
    """#22's "Done when": the plan file ``sparsim workload hybrid-plan`` wrote is trained and timed with the same per-bucket
    k_b by (a) the simulator's timeline, (b) the numerics of a [model] run and (c) the DDP hook -- k_b = min(d_b, max(1,
    round(rho_b d_b))) for a compressed bucket, every entry for a dense one -- and the hook trains it as the simulator
    does (test_hook_with_the_plan_equals_the_simulator)."""
    P, got, sims, _ = hook_runs
    _, plans = lenet_plan
    for algo in ("topk", "gtopk"):
        plan = load_plan(plans[algo])
        assert plan.algorithm == algo
        spec, _, _, sel, built = sims[algo]
        # (a) the timeline: per bucket (launch order) the plan's k_b, None for a dense bucket
        res = built.clock(spec, 1)
        assert res.ks == list(plan.ks())
        # (b) the numerics: the same k_b per segment (flat order is launch order reversed here), and every step
        # sends their sum (a dense segment all of its entries)
        order = sorted(range(3), key=lambda i: -i)  # launch order: bucket 0 holds the last layers
        assert spec.segments == tuple(plan.bucket_sizes[i] for i in order)
        assert spec.segment_ks(built.d) == tuple(plan.bucket_sizes[i] if plan.ks()[i] is None else plan.ks()[i]
                                                 for i in order)
        sent = sum(n if k is None else k for n, k in zip(plan.bucket_sizes, plan.ks()))
        assert sent == round(plan.sent_density() * plan.d)
        assert all(s == [sent] * P for s in sel)
        # (c) the DDP hook: every rank sent the same entries per step
        for r in range(P):
            for a, wire in HOOK_CASES:
                if a == algo:
                    assert got[r][(a, wire)][1] == T * sent, (algo, wire, r)
    made = json.loads(load_plan(plans["gtopk"]).made_with)
    assert made["bound"] == "min_density" and load_plan(plans["gtopk"]).nominal_density() >= 0.3


def test_hook_keeps_no_residual_for_dense_buckets(hook_runs):
    P, got, sims, built = hook_runs
    from sim.workloads.nets import build_net

    names = [n for n, _ in build_net("lenet5").named_parameters()]
    spec, _, res, _, _ = sims["topk"]
    dense_n = spec.segments[0]  # the hand-made Top-k plan: the first layers' segment is dense
    assert spec.segment_densities[0] is None
    for r in range(P):
        residuals = got[r][("topk", "allgather")][2]
        flat = np.concatenate([residuals[n].numpy() for n in names if n in residuals])
        assert flat.shape[0] == built.d - dense_n  # only the compressed buckets' parameters have residuals
        assert np.all(res[-1][r][:dense_n] == 0.0)
        if P == 2:
            assert np.array_equal(flat, res[-1][r][dense_n:])


def test_hook_refuses_a_plan_for_another_model(lenet_plan, tmp_path):
    _torch()
    from sim.distributed.ddp_hooks import SparseState
    from sim.workloads.nets import build_net

    _, plans = lenet_plan
    plan = plans["topk"]
    state = SparseState(None, "topk", plan=plan)
    assert state.scope == "bucket"
    with pytest.raises(ConfigError, match=r"is for model 'lenet5' of d = .*this model has"):
        state.bind(build_net("mlp-256"))
    with pytest.raises(ConfigError, match="scope = 'parameter' with a hybrid plan"):
        SparseState(None, "topk", scope="parameter", plan=plan)
    with pytest.raises(ConfigError, match="k with a hybrid plan"):
        SparseState(None, "topk", k=3, plan=plan)
    with pytest.raises(ConfigError, match="density = 2.0 is out of range"):
        SparseState(None, "gtopk", plan=_write(tmp_path, bucket1_density=2.0))


def test_hook_holds_the_plan_to_its_algorithm_as_the_simulator_does(lenet_plan):
    """The DDP hook refuses what the simulator refuses, in the same words (sim.engine.hybrid.check_plan_algorithm):
    a plan made for Top-k run by gTop-k, and DGC (a local momentum) with any plan."""
    _torch()
    from sim.distributed.ddp_hooks import SparseState

    plan = load_plan(lenet_plan[1]["topk"])
    for algo, wire, match in (("gtopk", None, "is for algorithm 'topk': this run's algorithm is 'gtopk'"),
                              ("dgc", "p2p", "algorithm = 'dgc' with a hybrid plan")):
        with pytest.raises(ConfigError, match=match) as hook:
            SparseState(None, algo, plan=plan, wire=wire)
        with pytest.raises(ConfigError) as sim:
            check_plan_algorithm(plan, algo)
        assert str(hook.value) == str(sim.value)

"""``sparsim plan`` (experiments/plan.py): the ranked table equals the timeline (and a ``sparsim run`` of the same
scenario) exactly, its split sums to the iteration, the break-even ratio is t_dense / t, the why column names the
largest term, evidence gives exact iterations and predicted times to a target, and bad input is one line, exit 2."""
from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from experiments import plan as pl
from experiments.cli import main
from sim.algorithms import REGISTRY, AlgorithmSpec
from sim.engine.timeline import IterationTimeline, TimelinePolicy, simulate_timeline
from sim.machine.network import get_preset
from sim.workloads.devices import get_device
from sim.workloads.zoo import get_model

MODEL = "resnet20-cifar"
SMALL = dict(model=MODEL, network="10GbE", P="4", densities="0.01", algorithms="dense,topk,gtopk",
             policies="model,layer")


@pytest.fixture(scope="module")
def small():
    """A small plan: ResNet-20 on 10 GbE, P = 4, dense / Top-k / gTop-k at density 0.01, model and layer policies."""
    inp = pl.resolve_plan(**SMALL)
    return inp, pl.rank_rows(pl.simulate_plan(inp))


def _row(rows, algorithm, collective, policy):
    return next(r for r in rows if (r["algorithm"], r["collective"], r["policy"]) == (algorithm, collective, policy))


def test_rows_equal_the_timeline_exactly(small):
    inp, rows = small
    wl, dev = get_model(MODEL), get_device("P102-100")
    net = get_preset("10GbE")
    d, k = wl.d, round(0.01 * wl.d)
    assert {(r["algorithm"], r["collective"], r["policy"]) for r in rows} == {
        ("dense", "ring", "ddp"), ("dense", "recursive_doubling", "ddp"), ("topk", "allgather", "model"),
        ("topk", "allgather", "layer"), ("gtopk", "tree", "model"), ("gtopk", "tree", "layer"),
        ("gtopk", "recursive_doubling", "model"), ("gtopk", "recursive_doubling", "layer")}
    for r in rows:
        spec = AlgorithmSpec(r["algorithm"], k=k if REGISTRY[r["algorithm"]].sparse else None, collective=r["collective"])
        pol = TimelinePolicy() if r["density"] is None else TimelinePolicy(sparse=r["policy"])
        res = simulate_timeline(spec, wl, 4, network=net, policy=pol, device=dev, batch_size=16, compute=inp.compute,
                                engine="auto")
        assert (r["iter_s"], r["compute_s"], r["select_s"], r["comm_s"]) == (
            res.iter_s[0], res.compute_s[0], res.compress_s[0], res.comm_s[0]), r["config"]
        assert r["k"] == (k if r["density"] is not None else None)
        assert r["bytes_per_rank"] == res.bytes_per_rank and r["communication_ops"] == len(res.buckets)


def test_rows_equal_a_sparsim_run_of_the_same_scenario(small, tmp_path):
    """The plan's time per iteration is what ``sparsim run`` writes for the same [workload] scenario (same compute
    model, device, specs): gTop-k per layer and dense on DDP buckets."""
    _inp, rows = small
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", "--set", f'workload.model="{MODEL}"',
                                  "--set", "cluster.network='10GbE'", "--set", "cluster.P=4",
                                  "--set", "training.iterations=1", "--set", "compression.density=0.01",
                                  "--set", "workload.sparse_policy='layer'", "--algorithms", "dense,gtopk"])
    assert r.exit_code == 0, r.output
    got = {x["algorithm"]: float(x["iter_time_s"]) for x in csv.DictReader(open(out / "metrics.csv"))}
    assert got == {"dense": _row(rows, "dense", "ring", "ddp")["iter_s"],
                   "gtopk": _row(rows, "gtopk", "tree", "layer")["iter_s"]}


def test_split_sums_to_the_iteration(small):
    _inp, rows = small
    for r in rows:
        assert r["compute_s"] + r["exposed_select_s"] + r["exposed_comm_s"] == pytest.approx(r["iter_s"], rel=1e-14)
        assert r["exposed_select_s"] >= 0 and r["exposed_comm_s"] >= -1e-15
        if r["density"] is None:
            assert r["exposed_select_s"] == 0.0 and r["select_s"] == 0.0
        if r["policy"] == "model":  # selection after backward: none of it hidden, no collective overlapped either
            assert r["exposed_select_s"] == pytest.approx(r["select_s"], rel=1e-12)
            assert r["iter_s"] == pytest.approx(r["compute_s"] + r["select_s"] + r["comm_s"], rel=1e-12)
        if r["policy"] == "layer":  # per-layer selections overlap backward: less of it is exposed
            assert r["exposed_select_s"] < r["select_s"]


def test_break_even_is_dense_time_over_scheme_time(small):
    _inp, rows = small
    # the baseline: dense DDP with the fastest of its collectives (ring or recursive doubling on a flat network)
    dense = min((r for r in rows if r["algorithm"] == "dense"), key=lambda r: r["iter_s"])
    assert {r["collective"] for r in rows if r["algorithm"] == "dense"} == {"ring", "recursive_doubling"}
    assert dense["break_even_iteration_ratio"] == 1.0 and dense["speedup_over_dense"] == 1.0
    for r in rows:
        assert r["dense_iter_s"] == dense["iter_s"] and r["dense_baseline"] == dense["collective"]
        assert r["break_even_iteration_ratio"] == r["speedup_over_dense"] == dense["iter_s"] / r["iter_s"]
    assert pl.break_even(3.0, 1.5) == 2.0 and pl.break_even(1.0, 4.0) == 0.25 and pl.break_even(1.0, 0.0) == math.inf
    # N_s iterations of the scheme finish before N_d of dense iff N_s / N_d < the ratio
    t_d, t_s = 0.12, 0.05
    ratio = pl.break_even(t_d, t_s)
    assert 2.3 * t_s < 1 * t_d and 2.5 * t_s > 1 * t_d and 2.3 < ratio < 2.5


def test_ranked_by_iteration_time(small):
    _inp, rows = small
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert [r["iter_s"] for r in rows] == sorted(r["iter_s"] for r in rows)


def test_why_names_the_largest_term(small):
    assert pl.why(0.85, 0.05, 0.10) == "compute-bound (85%)"
    assert pl.why(0.20, 0.62, 0.18) == "selection 62%"
    assert pl.why(0.10, 0.10, 0.80) == "exposed comm 80%"
    assert pl.why(0.5, 0.5, 0.0) == "compute-bound (50%)"  # ties go to compute
    _inp, rows = small
    names = {"compute": "compute-bound", "selection": "selection", "exposed comm": "exposed comm"}
    for r in rows:
        parts = {"compute": r["compute_s"], "selection": r["exposed_select_s"], "exposed comm": r["exposed_comm_s"]}
        top = max(parts, key=parts.get)
        assert r["why"].startswith(names[top]), (r["why"], parts)
        assert f"{parts[top] / r['iter_s']:.0%}" in r["why"]


def test_exposed_selection_is_selection_outside_compute():
    tl = IterationTimeline(1, 3.1, 0.0)
    tl.compute.append([("forward a", 0.0, 1.0, {}), ("backward a", 1.0, 2.0, {}), ("update", 3.0, 3.1, {})])
    tl.comm.append([("select bucket 0", 1.5, 2.5, {}), ("gtopk bucket 0", 2.5, 2.6, {}),
                    ("select bucket 1", 2.6, 2.8, {}), ("select bucket 2", 2.9, 3.05, {})])
    assert pl.exposed_selection_s(tl) == pytest.approx(0.5 + 0.2 + 0.1, rel=1e-12)


def test_pareto_front():
    pts = [(0.001, 5.0), (0.01, 3.0), (0.1, 4.0), (0.1, 6.0), (0.01, 7.0)]
    assert pl.pareto_front(pts) == [1, 2]  # (0.01, 3) and (0.1, 4): each beats the others on density or time
    assert pl.pareto_front([(0.1, 1.0), (0.01, 2.0)]) == [0]


def test_run_writes_table_csv_and_figure(tmp_path):
    inp = pl.resolve_plan(**{**SMALL, "P": "4,8", "policies": "model"})
    path, rows, lines = pl.run_plan(inp, tmp_path / "plan", top=3)
    for f in ("plan.csv", "plan.md", "pareto.png", "pareto.pdf", "summary.json"):
        assert (path / f).is_file() and (path / f).stat().st_size > 0, f
    with open(path / "plan.csv") as fh:
        got = list(csv.DictReader(fh))
    assert tuple(got[0]) == pl.COLUMNS and len(got) == len(rows) == 2 * len(inp.configs)
    assert [float(g["iter_s"]) for g in got] == [r["iter_s"] for r in rows]
    assert sum(ln.startswith("P = ") for ln in lines) == 2
    s = json.loads((path / "summary.json").read_text())
    assert s["P"] == [4, 8] and s["compute_costs"] == inp.costs
    assert set(s["dense_iter_s"]) == {"4", "8"}


# ------------------------------------------------------------------ evidence

ITERS = (0, 10, 20, 30, 40)
#: (algorithm, density, seed) -> test accuracy at ITERS: Top-k reaches 0.8 at 20 and 30, dense at 10 and 20,
#: gTop-k with one seed of two (at 40)
CURVES = {("topk", 0.01, 0): (0.1, 0.5, 0.81, 0.85, 0.86), ("topk", 0.01, 1): (0.1, 0.4, 0.7, 0.8, 0.84),
          ("dense", None, 0): (0.1, 0.8, 0.85, 0.86, 0.87), ("dense", None, 1): (0.1, 0.6, 0.82, 0.86, 0.87),
          ("gtopk", 0.01, 0): (0.1, 0.3, 0.5, 0.7, 0.8), ("gtopk", 0.01, 1): (0.1, 0.3, 0.5, 0.6, 0.7)}


def _run_dir(path, algorithm, density, seed, *, model=MODEL, P=4, batch=16, dataset=None, collective=None):
    """A sparsim run directory as a [model] / workload run writes it: summary.json (scenario, resolved d, the
    algorithms' specs) and metrics.csv (one algorithm, test_accuracy at the evaluated iterations, empty between)."""
    d = get_model(MODEL).d
    algo = REGISTRY[algorithm]
    k = round(density * d) if density is not None else None
    spec = AlgorithmSpec(algorithm, k=k, collective=collective)
    import dataclasses

    scen = {"seed": seed, "algorithms": [algorithm], "cluster": {"P": P, "network": "10GbE"},
            "training": {"batch_size": batch}, "compression": {"density": density or 0.01},
            "workload": {"model": model, "sparse_policy": "model", "dense_policy": "ddp"}}
    if dataset is not None:
        scen["model"], scen["data"] = {"name": model}, {"dataset": dataset}
        scen["workload"].pop("model")
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"scenario": scen, "resolved": {"d": d},
                                                   "algorithms": [dataclasses.asdict(spec)]}))
    with open(path / "metrics.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["algorithm", "iteration", "sim_time_s", "test_accuracy"])
        for it in range(0, 41):
            acc = CURVES[algorithm, density, seed][ITERS.index(it)] if it in ITERS else ""
            w.writerow([spec.label, it, 0.0, acc])


@pytest.fixture
def evidence_dir(tmp_path):
    root = tmp_path / "ev"
    for (alg, dens, seed) in CURVES:
        _run_dir(root / "runs" / f"{alg}_{dens}_s{seed}", alg, dens, seed)
    return root


def test_evidence_parsing_and_prediction_are_exact(evidence_dir):
    ev = pl.load_evidence(evidence_dir)
    assert len(ev.runs) == 6 and ev.Ps == {4} and ev.batch_sizes == {16} and ev.densities == {0.01}
    topk0 = next(r for r in ev.runs if r.algorithm == "topk" and r.seed == 0)
    assert topk0.iterations == ITERS and topk0.values == CURVES["topk", 0.01, 0]
    assert pl.iterations_to_target(topk0.iterations, topk0.values, 0.8) == 20
    assert pl.iterations_to_target(topk0.iterations, topk0.values, 0.9) is None
    assert pl.iterations_to_target((0, 5), (2.0, 0.5), 1.0, lower_is_better=True) == 5
    inp = pl.resolve_plan(model=MODEL, network="10GbE", algorithms="dense,topk,gtopk:tree,randk", policies="model,layer",
                          evidence=ev)
    assert inp.Ps == (4,) and inp.densities == (0.01,) and inp.sc.training.batch_size == 16
    rows = pl.rank_rows(pl.predict(pl.simulate_plan(inp), ev, 0.8, inp.workload.d))
    t = _row(rows, "topk", "allgather", "model")
    assert (t["evidence"], t["seeds"], t["n_reached"]) == ("reached", 2, 2)
    assert (t["tta_iterations_mean"], t["tta_iterations_min"], t["tta_iterations_max"]) == (25.0, 20.0, 30.0)
    assert t["tta_iterations_std"] == float(np.std([20, 30], ddof=1))
    assert t["tta_s_mean"] == float(np.mean([20 * t["iter_s"], 30 * t["iter_s"]]))
    assert t["tta_s_std"] == float(np.std([20 * t["iter_s"], 30 * t["iter_s"]], ddof=1))
    for coll in ("ring", "recursive_doubling"):  # dense sums exactly: its evidence holds for either collective
        dn = _row(rows, "dense", coll, "ddp")
        assert dn["evidence"] == "reached" and dn["tta_iterations_mean"] == 15.0
        assert dn["tta_s_mean"] == float(np.mean([10 * dn["iter_s"], 20 * dn["iter_s"]]))
    g = _row(rows, "gtopk", "tree", "model")
    assert (g["evidence"], g["n_reached"], g["seeds"], g["tta_iterations_min"]) == ("not reached", 1, 2, 40.0)
    assert math.isnan(g["tta_s_mean"])
    assert _row(rows, "topk", "allgather", "layer")["evidence"] == "none"  # per-layer selection: other numerics
    assert _row(rows, "randk", "allgather", "model")["evidence"] == "none"
    # order: every seed reached (by predicted time), then no evidence (by time per iteration), then not reached
    groups = [r["evidence"] for r in rows]
    assert groups == sorted(groups, key=["reached", "none", "not reached"].index)
    reached = [r["tta_s_mean"] for r in rows if r["evidence"] == "reached"]
    assert reached == sorted(reached)
    none = [r["iter_s"] for r in rows if r["evidence"] == "none"]
    assert none == sorted(none)


def test_csv_evidence_gives_the_same_prediction(evidence_dir, tmp_path):
    p = tmp_path / "ev.csv"
    with open(p, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["algorithm", "density", "seed", "iteration", "test_accuracy", "P", "batch_size"])
        for (alg, dens, seed), vals in CURVES.items():
            for it, v in zip(ITERS, vals):
                w.writerow([alg, "" if dens is None else dens, seed, it, v, 4, 16])
    kw = dict(model=MODEL, network="10GbE", algorithms="dense:ring,topk,gtopk:tree", policies="model")
    a, b = pl.load_evidence(evidence_dir), pl.load_evidence(p)
    ra = pl.predict(pl.simulate_plan(pl.resolve_plan(**kw, evidence=a)), a, 0.8, get_model(MODEL).d)
    rb = pl.predict(pl.simulate_plan(pl.resolve_plan(**kw, evidence=b)), b, 0.8, get_model(MODEL).d)
    keys = ("evidence", "n_reached", "tta_iterations_mean", "tta_iterations_min", "tta_s_min", "iter_s")
    assert [[r.get(k) for k in keys] for r in ra] == [[r.get(k) for k in keys] for r in rb]


def test_cli_ranks_by_evidence(evidence_dir, tmp_path):
    r = CliRunner().invoke(main, ["plan", "--model", MODEL, "--network", "10GbE", "--algorithms", "dense:ring,topk",
                                  "--policies", "model", "--evidence", str(evidence_dir), "--target", "0.8",
                                  "--out", str(tmp_path / "p"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "ranked by predicted time to test_accuracy 0.8" in r.output
    with open(tmp_path / "p" / "plan.csv") as fh:
        got = list(csv.DictReader(fh))
    assert tuple(got[0]) == pl.COLUMNS + pl.EVIDENCE_COLUMNS
    assert {g["algorithm"]: g["tta_iterations_mean"] for g in got} == {"dense": "15.0", "topk": "25.0"}


# ------------------------------------------------------------------ bad input: one line, exit 2

def _cli(args, tmp_path):
    r = CliRunner().invoke(main, ["plan", *args, "--out", str(tmp_path / "p"), "--quiet"])
    return r


@pytest.mark.parametrize("args, needle", [
    (["--model", "resnet5000", "--network", "10GbE"], "--model 'resnet5000' is unknown: valid a zoo model (resnet20-cifar"),
    (["--network", "10GbE"], "no model to plan for: valid --model NAME"),
    (["--model", MODEL, "--network", "5GbE"], "--network '5GbE' is unknown: valid 1GbE, 10GbE, IB100"),
    (["--model", MODEL, "--network", "10GbE", "--algorithms", "topq"], "--algorithms: 'topq' is unknown: valid dense, topk"),
    (["--model", MODEL, "--network", "10GbE", "--algorithms", "topk:tree"],
     "collective 'tree' is not one the simulator times for topk here: valid allgather"),
    (["--model", MODEL, "--network", "10GbE", "--algorithms", "topk:hierarchical"], "hierarchical needs a cluster preset"),
    (["--model", MODEL, "--network", "10GbE", "--densities", "0"], "--densities: '0' is out of range: valid 0 < density <= 1"),
    (["--model", MODEL, "--network", "10GbE", "--densities", "1.5"], "'1.5' is out of range: valid 0 < density <= 1"),
    (["--model", MODEL, "--network", "10GbE", "--densities", "x"], "--densities: 'x' is not a number"),
    (["--model", MODEL, "--network", "10GbE", "--policies", "tensor"], "--policies: 'tensor' is unknown: valid model, bucket, layer"),
    (["--model", MODEL, "--network", "10GbE", "--P", "0"], "--P 0 is out of range: valid 1 <= P <= 65536"),
    (["--model", MODEL, "--network", "dgx-h100", "--P", "12"], "cluster.P = 12 is not a multiple of gpus_per_node = 8"),
    (["--model", MODEL, "--device", "TPU"], "--device: device = 'TPU' is unknown: valid devices are P102-100"),
    (["--model", MODEL, "--network", "10GbE", "--target", "0.8"], "--target 0.8 needs --evidence"),
    (["--model", MODEL, "--network", "10GbE", "--evidence", "/nonexistent/ev", "--target", "0.8"],
     "--evidence '/nonexistent/ev' does not exist"),
    (["--anchors", "--model", MODEL], "--model: --anchors runs the papers' settings"),
    (["--anchors", "--top", "3"], "--top: --anchors runs the papers' settings"),
    (["--model", MODEL, "--network", "10GbE", "--metric", "test_loss"], "--metric test_loss is the evidence's metric: "
                                                                         "valid with --evidence"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    r = _cli(args, tmp_path)
    assert r.exit_code == 2 and needle in r.output, r.output
    assert r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_evidence_mismatch_and_unreached_target_are_one_line_exit_2(evidence_dir, tmp_path):
    base = ["--model", MODEL, "--network", "10GbE", "--algorithms", "dense:ring,topk,gtopk:tree", "--policies", "model",
            "--evidence", str(evidence_dir)]
    cases = [
        (["--target", "0.9"], "--target 0.9 is never reached in the evidence (6 runs of the plan's configurations, best "
                              "test_accuracy 0.87): "
                              "valid a target <= 0.87"),
        (["--target", "0.8", "--model", "vgg16-cifar"], "the evidence is for model 'resnet20-cifar', the plan for "
                                                        "'vgg16-cifar'"),
        (["--target", "0.8", "--P", "8"], "recorded at P = 4, the plan's P are 8: valid --P including 4"),
        (["--target", "0.8", "--batch-size", "32"], "trained at 16 samples per worker, the plan times 32: valid "
                                                    "--batch-size 16"),
        (["--target", "0.8", "--densities", "0.001"], "density 0.01 policy model (from"),
        (["--target", "0.8", "--metric", "test_loss"], "metrics.csv has no column 'test_loss': valid --metric one of"),
    ]
    for extra, needle in cases:
        r = _cli(base + extra, tmp_path)  # an option given twice: the last counts
        assert r.exit_code == 2 and needle in r.output, (extra, r.output)
        assert r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1
        assert not (tmp_path / "p").exists()


def test_evidence_of_another_data_set_is_refused(tmp_path):
    pytest.importorskip("torch")
    root = tmp_path / "ev"
    _run_dir(root / "a", "dense", None, 0, model="mlp-256", dataset="mnist")
    ev = pl.load_evidence(root)
    with pytest.raises(pl.ConfigError, match="trained on 'mnist', the plan's model on 'fashion-mnist'"):
        pl.resolve_plan(model="mlp-256", network="10GbE", algorithms="dense:ring", evidence=ev)
    inp = pl.resolve_plan(model="mlp-256", network="10GbE", algorithms="dense:ring", evidence=ev,
                          overrides=["data.dataset='mnist'"])
    assert inp.model == "mlp-256" and inp.dataset == "mnist" and inp.Ps == (4,)


def test_a_scenario_file_gives_the_model_cluster_and_axes(tmp_path):
    from experiments.resolve import compute_costs
    from experiments.scenario import load_scenario

    p = tmp_path / "s.toml"
    p.write_text('algorithms = ["gtopk"]\n[cluster]\nP = 8\nnetwork = "10GbE"\n[compression]\ndensity = 0.005\n'
                 '[workload]\nmodel = "resnet20-cifar"\nsparse_policy = "layer"\ndevice = "V100"\n')
    inp = pl.resolve_plan(str(p))
    assert (inp.Ps, inp.densities, inp.policies, inp.device.name) == ((8,), (0.005,), ("layer",), "V100")
    assert [(c.algorithm, c.collective) for c in inp.configs] == [("gtopk", "tree"), ("gtopk", "recursive_doubling")]
    sc = load_scenario(str(p))
    assert inp.costs == compute_costs(sc, get_device("V100"))
    inp2 = pl.resolve_plan(str(p), ["cluster.network='1GbE'"], P="4,16", densities="0.01,0.1", policies="model,bucket")
    assert (inp2.Ps, inp2.densities, inp2.policies, inp2.network) == ((4, 16), (0.01, 0.1), ("model", "bucket"), "1GbE")
    p.write_text(p.read_text().replace('sparse_policy = "layer"', 'sparse_policy = "hybrid"\nhybrid_plan = "x.json"'))
    with pytest.raises(pl.ConfigError):
        pl.resolve_plan(str(p))


def test_anchor_verdicts_follow_the_rules():
    rows = pl.agarwal_rows(models=(MODEL,), bandwidths=(1, 9, 100), variants=(("device costs", ()),))
    assert [r["paper"] for r in rows] == ["helps", "borderline", "rarely helps"]
    for r in rows:
        assert r["speedup"] == r["dense_s"] / r["best_s"]
        assert r["advisor"] == ("helps" if r["best_s"] < r["dense_s"] else "does not help")
        assert r["agree"] == ("-" if r["paper"] == "borderline" else
                              "yes" if (r["advisor"] == "helps") == (r["paper"] == "helps") else "no")
    es = pl.espresso_rows(sizes=(2 ** 10, 2 ** 19, 2 ** 20), variants=(("device costs", ()),))
    assert [r["paper"] for r in es] == ["compress above 2^19", "compress above 2^20"]
    lines = pl.anchor_lines(rows + es)
    assert lines[0].startswith("## Agarwal") and any(ln.startswith("## Espresso") for ln in lines)


def test_hybrid_rows_are_the_optimiser_and_beat_the_uniform_bucket_policy():
    """policy hybrid: the plan choose_hybrid finds under 'overall density >= the row's density', timed by the
    timeline exactly; an all-compressed plan at that density is the bucket policy and an all-dense one dense DDP on
    the ring, both feasible, so the hybrid row is no slower than either."""
    from sim.engine.hybrid import choose_hybrid

    inp = pl.resolve_plan(model=MODEL, network="1GbE", P="8", densities="0.001,0.01", algorithms="dense:ring,gtopk:tree",
                          policies="bucket,hybrid")
    rows = pl.simulate_plan(inp)
    dense = _row(rows, "dense", "ring", "ddp")
    for dens in (0.001, 0.01):
        h = next(r for r in rows if r["policy"] == "hybrid" and r["density"] == dens)
        b = next(r for r in rows if r["policy"] == "bucket" and r["density"] == dens)
        spec = AlgorithmSpec("gtopk", k=round(dens * inp.workload.d), collective="tree")
        ch = choose_hybrid(inp.workload, get_preset("1GbE"), spec, 8, densities=(0.001, 0.01), bound="min_density",
                           value=dens, policy=inp.base_policy, device=inp.device, batch_size=16,
                           compute=inp.compute)
        assert h["iter_s"] == ch.iter_s
        assert h["iter_s"] <= b["iter_s"] and h["iter_s"] <= dense["iter_s"]
    ev = pl.Evidence([pl.EvidenceRun("gtopk", "tree", None, 0.01, "hybrid", 0, 8, 16, MODEL, None, (0, 10), (0.1, 0.9),
                                     "x.csv")], "test_accuracy", False, "x.csv")
    with pytest.raises(pl.ConfigError, match="ran a hybrid plan: valid evidence of the uniform policies"):
        ev.check_against(inp)


# ------------------------------------------------------------------ a fresh-clone review (#22): one rule per setting,
# evidence without P, the target's range, unused options, progress, the preset's device, wording

@pytest.mark.parametrize("args, needle", [
    (["--device", "H100", "--set", "workload.device='V100'"],
     "--device H100 and --set workload.device='V100' both set workload.device: valid one of the two"),
    (["--batch-size", "32", "--set", "training.batch_size=64"],
     "--batch-size 32 and --set training.batch_size=64 both set training.batch_size: valid one of the two"),
    (["--set", "cluster.network='1GbE'"],  # --network 10GbE is in every case's arguments
     "--network 10GbE and --set cluster.network='1GbE' both set cluster.network: valid one of the two"),
    (["--P", "4", "--set", "cluster.P=8"], "--P 4 and --set cluster.P=8 both set cluster.P: valid one of the two"),
    (["--densities", "0.01", "--set", "compression.k=5"],
     "--densities 0.01 and --set compression.k=5 both set compression.k"),
    (["--set", "workload.model='vgg16-cifar'"], "--model resnet20-cifar and --set workload.model='vgg16-cifar' both set"),
    (["--policies", "model", "--set", "workload.sparse_policy='layer'"], "--policies model and --set "
                                                                           "workload.sparse_policy='layer' both set"),
])
def test_an_option_and_a_set_of_the_same_key_is_an_error(tmp_path, args, needle):
    """Before: --set silently won over --device, --batch-size, --network (and --P over --set cluster.P)."""
    r = _cli(["--model", MODEL, "--network", "10GbE", "--algorithms", "dense:ring,gtopk:tree", *args], tmp_path)
    assert r.exit_code == 2 and needle in r.output, r.output
    assert r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_a_set_of_a_key_no_option_gives_still_works():
    inp = pl.resolve_plan(model=MODEL, network="10GbE", P="4", densities="0.01", algorithms="gtopk:tree",
                          policies="model", overrides=["workload.device='V100'", "training.batch_size=8"])
    assert (inp.device.name, inp.sc.training.batch_size) == ("V100", 8)
    assert inp.device_from == "--set workload.device"


def _csv_evidence(path, *, P=True, batch=True):
    """CURVES as a CSV, with or without the P and batch_size columns."""
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["algorithm", "density", "seed", "iteration", "test_accuracy"] + ["P"] * P + ["batch_size"] * batch)
        for (alg, dens, seed), vals in CURVES.items():
            for it, v in zip(ITERS, vals):
                w.writerow([alg, "" if dens is None else dens, seed, it, v] + [4] * P + [16] * batch)
    return path


@pytest.mark.parametrize("P, batch, missing", [(False, True, "P"), (True, False, "batch_size"),
                                               (False, False, "P or batch_size")])
def test_csv_evidence_without_P_or_batch_is_refused_for_several_P(tmp_path, P, batch, missing):
    """Before: iterations to the target measured at one P were reused at every P of the plan."""
    ev = _csv_evidence(tmp_path / "ev.csv", P=P, batch=batch)
    r = _cli(["--model", MODEL, "--network", "10GbE", "--algorithms", "dense:ring,topk", "--policies", "model",
              "--P", "4,8", "--evidence", str(ev), "--target", "0.8"], tmp_path)
    assert r.exit_code == 2 and r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1, r.output
    assert f"has no {missing} (column" in r.output and "the plan has P = 4, 8" in r.output, r.output
    assert "valid a CSV with columns P and batch_size, or one --P" in r.output
    assert not (tmp_path / "p").exists()
    # one P: the evidence is read at it (the same numbers as with the columns)
    e = pl.load_evidence(ev)
    inp = pl.resolve_plan(model=MODEL, network="10GbE", algorithms="dense:ring,topk", policies="model", P="4",
                          evidence=e)
    rows = pl.predict(pl.simulate_plan(inp), e, 0.8, inp.workload.d)
    assert {r["algorithm"]: r["tta_iterations_mean"] for r in rows} == {"dense": 15.0, "topk": 25.0}


def test_run_directories_carry_P_and_batch_for_several_P(evidence_dir):
    ev = pl.load_evidence(evidence_dir)
    inp = pl.resolve_plan(model=MODEL, network="10GbE", algorithms="dense:ring,topk", policies="model", P="4,8",
                          evidence=ev)
    rows = pl.predict(pl.simulate_plan(inp), ev, 0.8, inp.workload.d)
    assert {(r["P"], r["algorithm"]): r["evidence"] for r in rows} == {
        (4, "dense"): "reached", (4, "topk"): "reached", (8, "dense"): "none", (8, "topk"): "none"}


@pytest.mark.parametrize("target, metric, needle", [
    ("0", "test_accuracy", "--target 0 is out of range for test_accuracy (higher is better, an accuracy): valid "
                           "0 < target <= 1"),
    ("-1", "test_accuracy", "--target -1 is out of range for test_accuracy"),
    ("1.5", "test_accuracy", "--target 1.5 is out of range for test_accuracy"),
    ("nan", "test_accuracy", "--target nan is out of range"),
    ("0", "test_loss", "--target 0 is out of range for test_loss (lower is better, a loss): valid a finite target > 0"),
    ("-1", "test_loss", "--target -1 is out of range for test_loss"),
    ("inf", "test_loss", "--target inf is out of range for test_loss"),
])
def test_a_target_out_of_its_metrics_range_is_an_error(evidence_dir, tmp_path, target, metric, needle):
    """Before: --target 0 and -1 were accepted (every run 'reached' them at iteration 0)."""
    r = _cli(["--model", MODEL, "--network", "10GbE", "--algorithms", "dense:ring,topk", "--policies", "model",
              "--evidence", str(evidence_dir), "--target", target, "--metric", metric], tmp_path)
    assert r.exit_code == 2 and needle in r.output, r.output
    assert r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1
    assert pl.check_target(0.5, "test_accuracy") == 0.5 and pl.check_target(2.3, "test_loss") == 2.3


def test_a_target_reached_only_by_configurations_outside_the_plan_is_never_reached(evidence_dir, tmp_path):
    """0.85 is reached by dense and Top-k only; a plan of gTop-k alone has no run that reaches it: exit 2 (before:
    a table of 'not reached' rows, exit 0). 0.75 is reached by one gTop-k seed of two: a row 'not reached (1/2)'."""
    base = ["--model", MODEL, "--network", "10GbE", "--policies", "model", "--evidence", str(evidence_dir)]
    r = _cli(base + ["--algorithms", "gtopk:tree", "--target", "0.85"], tmp_path)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert ("--target 0.85 is never reached in the evidence (2 runs of the plan's configurations, best test_accuracy "
            "0.8): valid a target <= 0.8") in r.output
    r = _cli(base + ["--algorithms", "gtopk:tree", "--target", "0.75"], tmp_path)
    assert r.exit_code == 0, r.output
    assert "not reached (1/2)" in r.output


@pytest.mark.parametrize("args, needle", [
    (["--algorithms", "dense,powersgd", "--densities", "0.01"],
     "--densities 0.01: none of the plan's algorithms (dense, powersgd) selects k entries, so no configuration uses it"),
    (["--algorithms", "dense", "--policies", "layer"],
     "--policies layer: none of the plan's algorithms (dense) selects k entries"),
    (["--algorithms", "dgc", "--policies", "model,hybrid"],
     "--policies hybrid: none of the plan's algorithms with k (dgc) runs policy hybrid: valid hybrid with one of topk"),
    (["--P", "4,,8"], "--P '4,,8' has an empty item: valid comma-separated integers 1 <= P <= 65536"),
    (["--P", "4,"], "--P '4,' has an empty item"),
    (["--densities", "0.01,,0.1"], "--densities '0.01,,0.1' has an empty item"),
    (["--policies", "model,"], "--policies 'model,' has an empty item"),
    (["--algorithms", "dense,,gtopk"], "--algorithms 'dense,,gtopk' has an empty item"),
])
def test_options_the_run_does_not_use_are_errors(tmp_path, args, needle):
    r = _cli(["--model", MODEL, "--network", "10GbE", *args], tmp_path)
    assert r.exit_code == 2 and needle in r.output, r.output
    assert r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("extra", [[], ["--anchors"]])
def test_an_empty_out_is_an_error(tmp_path, extra):
    """Before: --out '' fell back to runs/plan."""
    args = extra or ["--model", MODEL, "--network", "10GbE", "--P", "4"]
    r = CliRunner().invoke(main, ["plan", *args, "--out", "", "--quiet"])
    assert r.exit_code == 2 and "--out '' is empty: valid a directory path" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_default_policies_leave_hybrid_out_for_dgc():
    inp = pl.resolve_plan(model=MODEL, network="10GbE", P="4", densities="0.01", algorithms="dgc,gtopk:tree")
    assert [c.policy for c in inp.configs if c.algorithm == "dgc"] == ["model", "bucket", "layer"]
    assert [c.policy for c in inp.configs if c.algorithm == "gtopk"] == list(pl.PLAN_POLICIES)


def test_quiet_still_prints_the_size_of_the_plan_on_stderr(tmp_path):
    """Before: nothing before the tables under --quiet (ResNet-50 at four P runs for minutes)."""
    r = CliRunner().invoke(main, ["plan", "--model", MODEL, "--network", "10GbE", "--P", "4,8", "--densities", "0.01",
                                  "--algorithms", "dense:ring,gtopk:tree", "--policies", "model,layer",
                                  "--out", str(tmp_path / "p"), "--quiet"])
    assert r.exit_code == 0, r.output
    line = "plan: simulating 3 configurations x 2 P (4, 8) = 6 timelines, plus the dense baseline per P"
    assert r.stderr.strip() == line
    assert r.stdout.index("plan: resnet20-cifar") == 0  # the tables follow on stdout


@pytest.mark.parametrize("network, device, why", [
    ("dgx-h100", "H100", "the dgx-h100 preset's device; --device to change"),
    ("gtopk-icdcs", "P102-100", "the gtopk-icdcs preset's device; --device to change"),
    ("v100-25GbE", "V100", "the v100-25GbE preset's device; --device to change"),
    ("10GbE", "P102-100", "the default workload.device: 10GbE names no device; --device to change"),
])
def test_a_cluster_preset_prices_compute_on_its_own_device(network, device, why):
    """Before: --network dgx-h100 without --device priced compute on the P102-100, silently."""
    inp = pl.resolve_plan(model=MODEL, network=network, P="8", densities="0.01", algorithms="gtopk", policies="model")
    assert inp.device == get_device(device) and inp.device_from == why
    assert inp.costs == pl.resolve_plan(model=MODEL, network=network, P="8", densities="0.01", algorithms="gtopk",
                                        policies="model", device=device).costs
    assert f"device {device} ({why}; efficiency" in pl.header_lines(inp)[0]
    # an explicit device wins, from --device, --set or the scenario
    assert pl.resolve_plan(model=MODEL, network=network, P="8", algorithms="dense", device="A100").device.name == "A100"
    assert pl.resolve_plan(model=MODEL, network=network, P="8", algorithms="dense",
                           overrides=["workload.device='A100'"]).device.name == "A100"


def test_a_scenario_device_wins_over_the_preset(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('[cluster]\nnetwork = "dgx-h100"\nP = 8\n[workload]\nmodel = "resnet20-cifar"\ndevice = "V100"\n')
    inp = pl.resolve_plan(str(p), algorithms="dense")
    assert inp.device.name == "V100" and inp.device_from == f"{p}'s workload.device"


def test_one_seed_is_singular(tmp_path):
    """Before: '(1 seeds)'."""
    root = tmp_path / "ev"
    for (alg, dens, seed) in CURVES:
        if seed == 0:
            _run_dir(root / f"{alg}_{dens}", alg, dens, seed)
    ev = pl.load_evidence(root)
    inp = pl.resolve_plan(model=MODEL, network="10GbE", algorithms="dense:ring", evidence=ev)
    rows = pl.rank_rows(pl.predict(pl.simulate_plan(inp), ev, 0.8, inp.workload.d))
    text = "\n".join(pl.table_lines(rows, inp))
    assert "10 (1 seed)" in text and "seeds)" not in text


@pytest.mark.parametrize("content, needle", [
    ("", "is empty (no header, no rows): valid a CSV with a header (algorithm, seed, iteration, test_accuracy"),
    ("algorithm,seed,iteration,test_accuracy\n", "has a header but no rows: valid one row per configuration"),
    ("algorithm,seed,iteration,test_accuracy\ndense,0,0,\ndense,0,10,\n",
     "no row has a value of 'test_accuracy' (the column is empty in every row)"),
])
def test_an_empty_evidence_csv_is_one_line_naming_the_file(tmp_path, content, needle):
    """Before: a header-only CSV was 'no column algorithm, seed, iteration, test_accuracy' (it has them)."""
    p = tmp_path / "ev.csv"
    p.write_text(content)
    r = _cli(["--model", MODEL, "--network", "10GbE", "--evidence", str(p), "--target", "0.8"], tmp_path)
    assert r.exit_code == 2 and needle in r.output and str(p) in r.output, r.output
    assert r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1


def test_anchors_under_quiet_say_what_they_run_on_stderr(tmp_path, monkeypatch):
    """Before: --anchors --quiet printed nothing for its two minutes. The line counts the papers' sweeps from the
    module's constants (run_anchors itself replaced: the sweep is tested elsewhere)."""
    monkeypatch.setattr(pl, "run_anchors", lambda out, force=False, progress=False: (tmp_path / "a", ["table"]))
    r = CliRunner().invoke(main, ["plan", "--anchors", "--out", str(tmp_path / "a"), "--quiet"])
    assert r.exit_code == 0, r.output
    n = len(pl.AGARWAL_MODELS), len(pl.ANCHOR_VARIANTS), len(pl.AGARWAL_BANDWIDTHS_GBPS)
    assert r.stderr.startswith(f"plan --anchors: Agarwal et al.'s sweep ({n[0]} models x {n[1]} variants x {n[2]} "
                               "bandwidths, each a plan at P = 64)")
    assert (f"Espresso's {len(pl.ESPRESSO_SIZES)} tensor sizes x {len(pl.ESPRESSO_THRESHOLDS)} fabrics x "
            f"{len(pl.ESPRESSO_VARIANTS)}") in r.stderr
    assert r.stdout.splitlines()[0] == "table"


@pytest.mark.parametrize("opt, value, valid", [
    ("--jobs", "abc", f"valid 1 <= jobs <= {pl.MAX_JOBS}"),
    ("--batch-size", "1e3", "valid 1 <= --batch-size <= 10000000"),
    ("--iterations", "x", "valid 1 <= --iterations <= 1000"),
    ("--top", "", "valid 0 <= --top <= 1000000"),
])
def test_a_non_integer_option_names_the_value_and_the_range(tmp_path, opt, value, valid):
    """--jobs abc (and the other integer options of plan) got click's own 'is not a valid integer', without the
    range: now one line with the value and the range that the out-of-range check states, exit 2."""
    r = _cli(["--model", MODEL, "--network", "10GbE", opt, value], tmp_path)
    assert r.exit_code == 2 and f"{value!r} is not an integer: {valid}" in r.output, r.output
    assert r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_a_target_met_before_training_is_refused(evidence_dir, tmp_path):
    """Every evidence run starts at test accuracy 0.1 (iteration 0): a target of 0.05 is met by the untrained
    model, 0 iterations to target for every configuration, which ranks nothing. One line, exit 2, naming the
    untrained value as the bound."""
    base = ["--model", MODEL, "--network", "10GbE", "--algorithms", "dense:ring,topk,gtopk:tree", "--policies", "model",
            "--evidence", str(evidence_dir)]
    r = _cli(base + ["--target", "0.05"], tmp_path)
    assert r.exit_code == 2 and "--target 0.05 is met before training (test_accuracy 0.1 at iteration 0" in r.output
    assert "valid a target > 0.1, the untrained model's value" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "p").exists()
    assert _cli(base + ["--target", "0.8"], tmp_path).exit_code == 0  # above the start: ranked


def test_the_spread_of_equal_values_is_zero():
    """Three seeds with the same time to target: std 0 exactly (numpy's ddof=1 std of [x, x, x] is 1.7e-17 for
    x = 0.0905, printed as '± 1.7e-17'); otherwise the sample standard deviation."""
    s = pl._spread([0.0905, 0.0905, 0.0905])
    assert s["std"] == 0.0 and s["min"] == s["max"] == 0.0905
    assert pl._spread([1.0, 2.0, 3.0])["std"] == 1.0
    assert np.isnan(pl._spread([1.0])["std"])


def test_pareto_colours_follow_the_registry_not_the_ranking(tmp_path, monkeypatch):
    """An algorithm keeps its colour across plans: the figure's series are in the registry's order whatever the
    rows' order (before: first-ranked first, so gTop-k changed colour between plans)."""
    seen = []
    import matplotlib.axes

    orig = matplotlib.axes.Axes.scatter

    def spy(self, x, y, *a, **kw):
        seen.append((float(y), kw.get("color")))  # y: 1e3 x the row's iter_s, which names its algorithm here
        return orig(self, x, y, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", spy)
    rows = [{"P": 4, "algorithm": a, "density": 0.01, "policy": "model", "iter_s": t, "label": a, "dense_iter_s": 3.0}
            for a, t in (("gtopk", 1.0), ("topk", 2.0))]
    pl.pareto_figure(rows, tmp_path, "t")
    first = dict(seen)
    seen.clear()
    pl.pareto_figure(rows[::-1], tmp_path, "t")
    assert list(REGISTRY).index("topk") < list(REGISTRY).index("gtopk")
    assert first == dict(seen) == {2e3: "C0", 1e3: "C1"}  # topk (2 s) C0, gtopk (1 s) C1, whatever the ranking

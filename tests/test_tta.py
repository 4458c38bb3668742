"""sparsim experiment tta: time to accuracy per algorithm, density, seed and cluster, recomputed here from the run
folders; bad options; resume; the time budget; one cluster's clock against a run made on that cluster."""
from __future__ import annotations

import csv
import math
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.tta import Case, plan, spread, summarise, time_to_target

FMNIST = "/usr/share/datasets/fashion-mnist"
HAVE_DATA = os.path.isdir(FMNIST)
needs_data = pytest.mark.skipif(not HAVE_DATA and os.environ.get("CI") != "true",
                                reason="dataset-fashion-mnist not installed (CI installs it)")
TIME_COLUMNS = {"sim_time_s", "iter_time_s", "compute_s", "compress_s", "comm_s", "bytes_sent", "exposed_comm_s",
                "overlap_ratio", "run_id"}


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _invoke(*args):
    return CliRunner().invoke(main, ["experiment", "tta", "--quiet", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick sweep (dense and gtopk at 0.001, 3 seeds, two clusters) in two spawned processes."""
    out = tmp_path_factory.mktemp("tta") / "q"
    r = _invoke("--quick", "--jobs", "2", "--out", str(out))
    assert r.exit_code == 0, r.output
    return out, r.output


def _metrics(out, run_dir):
    return _csv(out / run_dir / "metrics.csv")


@needs_data
def test_quick_files_and_time_to_target_recomputed_from_the_runs(quick):
    out, output = quick
    pl = plan(True)
    assert not out.with_name(out.name + ".partial").exists()
    for f in ("tta.csv", "summary.csv", "curves.csv", "clocks.csv", "results.md", "tta.png", "tta.pdf"):
        assert (out / f).stat().st_size > 0
    tta, clocks = _csv(out / "tta.csv"), _csv(out / "clocks.csv")
    assert len(tta) == len(pl.cases()) * len(pl.clusters) == 12
    assert {r["cluster"] for r in tta} == set(pl.clusters) == {"gtopk-icdcs", "dgx-h100"}
    first = pl.clusters[0]
    for r in tta:
        rows = _metrics(out, r["run_dir"])
        assert len(rows) == pl.iterations + 1
        evald = [m for m in rows if m["test_accuracy"] != ""]
        assert [int(m["iteration"]) for m in evald] == [0, 10, 20, 30]
        hit = next((m for m in evald if float(m["test_accuracy"]) >= pl.target), None)
        # this cluster's clock, written per iteration; its sum up to an iteration is the simulated time there
        it_s = [float(c["iter_time_s"]) for c in clocks if (c["algorithm"], c["density"], c["seed"], c["cluster"])
                == (r["algorithm"], r["density"], r["seed"], r["cluster"])]
        assert len(it_s) == pl.iterations == int(r["iterations_run"])
        cum = np.cumsum(it_s)
        assert float(r["sim_time_end_s"]) == cum[-1] == sum(it_s)
        if r["cluster"] == first:  # the training run's own clock is this cluster's, bit for bit
            assert [float(m["sim_time_s"]) for m in rows[1:]] == list(cum)
        if hit is None:
            assert r["reached"] == "False" and r["tta_iteration"] == "" and r["tta_sim_time_s"] == ""
        else:
            t = int(hit["iteration"])
            assert r["reached"] == "True" and int(r["tta_iteration"]) == t
            assert float(r["tta_sim_time_s"]) == (0.0 if t == 0 else cum[t - 1])
            if r["cluster"] == first:
                assert float(r["tta_sim_time_s"]) == float(hit["sim_time_s"])
        assert float(r["final_test_accuracy"]) == float(evald[-1]["test_accuracy"])
        assert float(r["best_test_accuracy"]) == max(float(m["test_accuracy"]) for m in evald)
    # dense reaches 0.65 in 30 iterations, gTop-k at density 0.001 does not: both kinds are in the report
    by = {(r["algorithm"], r["cluster"]): r for r in _csv(out / "summary.csv")}
    assert by[("dense", first)]["n_reached"] == "3" and by[("gtopk", first)]["n_reached"] == "0"
    assert by[("gtopk", first)]["tta_iteration_mean"] == "" and by[("gtopk", first)]["tta_sim_time_s_min"] == ""
    assert "not reached (0/3)" in (out / "results.md").read_text() and "not reached (0/3)" in output
    # per iteration a sparse step is cheaper than dense on the 1 GbE cluster and dearer on the DGX H100 nodes
    assert float(by[("gtopk", "gtopk-icdcs")]["iter_time_s"]) < float(by[("dense", "gtopk-icdcs")]["iter_time_s"])
    assert float(by[("gtopk", "dgx-h100")]["iter_time_s"]) > float(by[("dense", "dgx-h100")]["iter_time_s"])


@needs_data
def test_quick_seeds_differ_and_summary_is_over_the_seeds(quick):
    out, _ = quick
    tta = _csv(out / "tta.csv")
    for alg in ("dense", "gtopk"):
        finals = [float(r["final_test_accuracy"]) for r in tta if r["algorithm"] == alg and r["cluster"] == "dgx-h100"]
        assert len(finals) == 3
        losses = {_metrics(out, f"runs/{Case(alg, None if alg == 'dense' else 0.001, s).name}")[-1]["loss"]
                  for s in range(3)}
        assert len(losses) == 3  # three seeds, three trainings
        s = next(x for x in _csv(out / "summary.csv") if x["algorithm"] == alg and x["cluster"] == "dgx-h100")
        assert float(s["final_test_accuracy_mean"]) == pytest.approx(np.mean(finals), rel=1e-12)
        assert float(s["final_test_accuracy_std"]) == pytest.approx(np.std(finals, ddof=1), rel=1e-12)
        assert float(s["final_test_accuracy_min"]) == min(finals) and float(s["final_test_accuracy_max"]) == max(finals)
    # the numbers do not depend on the cluster: the same accuracies on both
    acc = {(r["algorithm"], r["seed"], r["cluster"]): r["final_test_accuracy"] for r in tta}
    assert all(acc[a, s, "gtopk-icdcs"] == acc[a, s, "dgx-h100"] for a, s, _ in acc)


@needs_data
def test_a_run_made_on_the_second_cluster_has_the_same_numbers_and_its_clock(quick, tmp_path):
    """Train once, time on every cluster: a run of one case made on dgx-h100 itself has the numbers of the case's
    run (made on gtopk-icdcs) and the clock the sweep computed for dgx-h100."""
    from experiments.run import run_scenario

    out, _ = quick
    pl = plan(True)
    case = Case("gtopk", 0.001, 1)
    direct = run_scenario(pl.scenario(case, "dgx-h100", pl.iterations), tmp_path / "direct", progress=False,
                          figure=False)
    there, ours = _csv(direct / "metrics.csv"), _metrics(out, f"runs/{case.name}")
    assert len(there) == len(ours)
    for a, b in zip(there, ours):
        assert {c: a[c] for c in a if c not in TIME_COLUMNS} == {c: b[c] for c in b if c not in TIME_COLUMNS}
    clock = [c["sim_time_s"] for c in _csv(out / "clocks.csv")
             if (c["algorithm"], c["density"], c["seed"], c["cluster"]) == ("gtopk", "0.001", "1", "dgx-h100")]
    assert clock == [a["sim_time_s"] for a in there[1:]]


@needs_data
def test_resume_reuses_finished_cases_and_a_new_target_reports_not_reached(quick, tmp_path):
    """An interrupted sweep (its DIR.partial with one case folder missing) resumes: the finished cases are reused,
    the missing one is trained again (in one process this time: the same bytes as in the spawned one)."""
    out, _ = quick
    res = tmp_path / "r"
    partial = tmp_path / "r.partial"
    shutil.copytree(out, partial)
    for f in ("tta.csv", "summary.csv", "results.md", "tta.png"):
        (partial / f).unlink()
    shutil.rmtree(partial / "runs" / "gtopk_d0.001_s1")
    (partial / "runs" / "dense_s2" / "kept.txt").write_text("reused")
    r = _invoke("--quick", "--jobs", "1", "--target", "0.99", "--out", str(res))
    assert r.exit_code == 0, r.output
    assert (res / "runs" / "dense_s2" / "kept.txt").read_text() == "reused"
    assert (res / "runs" / "gtopk_d0.001_s1" / "metrics.csv").read_bytes() == \
        (out / "runs" / "gtopk_d0.001_s1" / "metrics.csv").read_bytes()
    tta = _csv(res / "tta.csv")
    assert {r["reached"] for r in tta} == {"False"} and {r["tta_sim_time_s"] for r in tta} == {""}
    assert (res / "results.md").read_text().count("not reached (0/3)") == 2 * 4  # 2 columns x 4 rows
    assert "no algorithm reached 0.99" in r.output
    # other settings (here another P) do not resume from a partial directory of these
    shutil.copytree(out, tmp_path / "p.partial")
    r = _invoke("--quick", "--jobs", "1", "--algorithms", "dense", "--seeds", "1", "--P", "4", "--clusters", "1GbE",
                "--out", str(tmp_path / "p"))
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "p" / "runs").iterdir()) == ["dense_s0"]
    assert "P = 4" in (tmp_path / "p" / "results.md").read_text()


@needs_data
def test_time_budget_stops_each_cluster_at_the_same_simulated_time(tmp_path):
    budget = 0.25  # dense at P = 8 on gtopk-icdcs: about 13 iterations of 0.019 s; on dgx-h100 all 30 fit
    r = _invoke("--quick", "--jobs", "1", "--algorithms", "dense", "--seeds", "1", "--time-budget-s", str(budget),
                "--out", str(tmp_path / "b"))
    assert r.exit_code == 0, r.output
    tta = {x["cluster"]: x for x in _csv(tmp_path / "b" / "tta.csv")}
    clocks = _csv(tmp_path / "b" / "clocks.csv")
    for cl, x in tta.items():
        it_s = [float(c["iter_time_s"]) for c in clocks if c["cluster"] == cl]
        n = int(x["iterations_run"])
        assert len(it_s) == n and float(x["sim_time_end_s"]) == np.cumsum(it_s)[-1] <= budget
        assert int(x["final_iteration"]) <= n < int(x["final_iteration"]) + 10
    assert int(tta["gtopk-icdcs"]["iterations_run"]) < 30 == int(tta["dgx-h100"]["iterations_run"])
    # the budget's rule: one more iteration would end after it
    it_s = [float(c["iter_time_s"]) for c in clocks if c["cluster"] == "gtopk-icdcs"]
    assert float(tta["gtopk-icdcs"]["sim_time_end_s"]) + it_s[0] > budget
    metrics = _csv(tmp_path / "b" / "runs" / "dense_s0" / "metrics.csv")
    assert int(metrics[-1]["iteration"]) == 30  # trained for the most any cluster keeps


@needs_data
def test_no_verdict_against_an_untrained_dense(tmp_path):
    """A fresh user's --time-budget-s 0.05: on gtopk-icdcs dense kept 2 iterations, its last evaluation within the
    budget was iteration 0 (the initial network), and results.md called the IJCAI claim 'reproduced' (51 points
    above dense)."""
    r = _invoke("--quick", "--jobs", "1", "--seeds", "1", "--time-budget-s", "0.05", "--out", str(tmp_path / "b"))
    assert r.exit_code == 0, r.output
    tta = {(x["algorithm"], x["cluster"]): x for x in _csv(tmp_path / "b" / "tta.csv")}
    assert int(tta[("dense", "gtopk-icdcs")]["final_iteration"]) == 0
    text = (tmp_path / "b" / "results.md").read_text()
    line = next(ln for ln in text.splitlines() if "IJCAI" in ln and "gtopk-icdcs" in ln)
    assert "no verdict" in line and "reproduced" not in line


@pytest.mark.parametrize("target", ["0", "1.5", "-0.2", "nan"])
def test_bad_target_is_one_line_exit_2(tmp_path, target):
    r = _invoke("--quick", "--target", target, "--out", str(tmp_path / "t"))
    assert r.exit_code == 2 and r.output.startswith("error: --target") and "0 < target <= 1" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()


@pytest.mark.parametrize("args, needle", [
    (["--densities", "0"], "--densities: '0' is out of range"),
    (["--densities", "0.001,0.001"], "names 0.001 twice"),
    (["--algorithms", "nope"], "--algorithms: 'nope' is unknown"),
    (["--clusters", "gtopk-icdcs,nope"], "--clusters: 'nope' is unknown"),
    (["--P", "6"], "not a multiple of gpus_per_node = 4"),
    (["--seeds", "0"], "--seeds 0 is out of range"),
    (["--eval-every", "0"], "--eval-every 0 is out of range"),
    (["--time-budget-s", "0"], "--time-budget-s 0.0 is out of range"),
    (["--model", "resnet50"], "--model 'resnet50' is unknown"),
    (["--lr", "0"], "training.lr = 0.0 is out of range"),
    (["--P", "4000"], "images per step is out of range"),
])
def test_bad_options_are_one_line_exit_2(tmp_path, args, needle):
    r = _invoke("--quick", *args, "--out", str(tmp_path / "t"))
    assert r.exit_code == 2 and r.output.startswith("error:") and needle in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()


@needs_data
def test_a_diverging_case_is_one_line_naming_it(tmp_path):
    r = _invoke("--quick", "--jobs", "1", "--algorithms", "dense", "--seeds", "1", "--lr", "1000", "--out",
                str(tmp_path / "t"))
    assert r.exit_code == 2 and r.output.startswith("error: case dense_s0 (") and "not finite" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "t").exists()


def test_a_budget_below_one_iteration_is_one_line_exit_2(tmp_path):
    pytest.importorskip("torch")
    r = _invoke("--quick", "--time-budget-s", "1e-7", "--out", str(tmp_path / "t"))
    assert r.exit_code == 2 and "first iteration alone takes" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()


def test_time_to_target_rules():
    rows = [{"iteration": t, "test_accuracy": a} for t, a in ((0, 0.1), (10, 0.7), (20, 0.82), (30, 0.81), (40, 0.9))]
    cum = np.cumsum(np.full(40, 0.5))
    r = time_to_target(rows, cum, 40, 0.8)
    assert (r["reached"], r["tta_iteration"], r["tta_sim_time_s"]) == (True, 20, 10.0)
    assert (r["final_iteration"], r["final_test_accuracy"], r["best_iteration"]) == (40, 0.9, 40)
    r = time_to_target(rows, cum, 35, 0.85)  # a budget of 35 iterations: the row at 40 is past it
    assert not r["reached"] and r["tta_iteration"] is None and r["tta_sim_time_s"] is None
    assert (r["final_iteration"], r["final_sim_time_s"]) == (30, 15.0)
    assert (r["iterations_run"], r["sim_time_end_s"]) == (35, 17.5)
    assert (r["best_test_accuracy"], r["best_iteration"]) == (0.82, 20)
    assert time_to_target(rows, cum, 40, 0.1)["tta_iteration"] == 0  # reached at the start: 0 s


def test_summary_gives_a_mean_only_when_every_seed_reached():
    def row(reached, it, t, acc):
        return {"reached": reached, "tta_iteration": it, "tta_sim_time_s": t, "final_test_accuracy": acc,
                "best_test_accuracy": acc, "iterations_run": 40, "final_iteration": 40, "iter_time_s": 0.5}

    s = summarise([row(True, 20, 10.0, 0.8), row(True, 30, 15.0, 0.82), row(True, 40, 20.0, 0.84)])
    assert (s["n_reached"], s["tta_iteration_mean"], s["tta_sim_time_s_std"]) == (3, 30.0, 5.0)
    s = summarise([row(True, 20, 10.0, 0.8), row(False, None, None, 0.7), row(True, 40, 20.0, 0.84)])
    assert s["n_reached"] == 2 and math.isnan(s["tta_iteration_mean"]) and math.isnan(s["tta_sim_time_s_std"])
    assert (s["tta_iteration_min"], s["tta_iteration_max"]) == (20.0, 40.0)
    assert s["final_test_accuracy_mean"] == pytest.approx(0.78)
    assert math.isnan(spread([0.5])["std"]) and math.isnan(spread([])["mean"])


def test_plan_cases_run_dense_once_per_seed():
    pl = plan(False, algorithms="dense,topk", densities="0.001,0.01", seeds=3)
    names = [c.name for c in pl.cases()]
    assert names[:3] == ["dense_s0", "dense_s1", "dense_s2"] and len(names) == 3 + 2 * 3
    assert "topk_d0.01_s2" in names and pl.k(0.001) == 204

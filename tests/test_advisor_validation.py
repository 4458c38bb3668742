"""sparsim experiment validate-advisor: the short-run predictor recovers its own model, the measured time to accuracy
is the tta rule, Kendall's tau has its closed form, the validation on hand-made curves gives the exact times and
ranks, a --quick run writes its files (and --runs on its sweep gives the same bytes), bad input is one line."""
from __future__ import annotations

import csv
import math
import os

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from experiments.advisor_validation import (CASE_COLUMNS, FIT_COLUMNS, RANKING_COLUMNS, compare, fit_learning_curve,
                                            learning_curve, measured_tta, predict_iterations, rank, validate)
from experiments.cli import main
from sim.base.errors import ConfigError

FMNIST = "/usr/share/datasets/fashion-mnist"
needs_data = pytest.mark.skipif(not os.path.isdir(FMNIST) and os.environ.get("CI") != "true",
                                reason="dataset-fashion-mnist not installed (CI installs it)")

GRID = np.arange(0, 1001, 10)  # evaluation points of a 1000-iteration run, every 10
W = 200  # its first 20 %


def _invoke(*args):
    return CliRunner().invoke(main, ["experiment", "validate-advisor", "--quiet", *args], catch_exceptions=False)


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _curve(a, b, c, its=GRID, first=0.1):
    """Accuracy of the model at every evaluation point (iteration 0: ``first``, where the model is undefined)."""
    t = np.asarray(its, dtype=np.float64)
    return np.where(t > 0, learning_curve(np.maximum(t, 1.0), a, b, c), first)


# ------------------------------------------------------------------ the predictor

@pytest.mark.parametrize("a, b, c, target", [
    (0.90, 1.2, 0.6, 0.87),    # t* = 40^(1/0.6) = 466.1
    (0.88, 0.5, 0.35, 0.86),   # t* = 25^(1/0.35) = 9877
    (0.95, 3.0, 1.1, 0.94),    # t* = 300^(1/1.1) = 178.6: inside the window, so the data shows it (observed)
])
def test_the_fit_recovers_its_own_model_and_the_crossing(a, b, c, target):
    acc = _curve(a, b, c)
    use = (GRID > 0) & (GRID <= W)
    fit = fit_learning_curve(GRID[use], acc[use])
    assert fit.ok
    np.testing.assert_allclose([fit.a, fit.b, fit.c], [a, b, c], rtol=1e-7)
    t_star = (b / (a - target)) ** (1 / c)
    assert fit.crossing(target) == pytest.approx(t_star, rel=1e-6)
    assert min(abs(t_star - 10 * round(t_star / 10)), 10) > 0.3  # t* is not at a grid point: the rounding is sure
    p = predict_iterations(GRID, acc, target, W, 10)
    assert p.points == 20 and p.iteration == 10 * math.ceil(t_star / 10)  # the first evaluation point at or after t*
    if t_star <= W:
        assert (p.how, p.fit) == ("observed", None)
    else:
        assert p.how == "extrapolated" and p.t_star == pytest.approx(t_star, rel=1e-6)


@given(a=st.floats(0.80, 0.99), b=st.floats(0.3, 3.0), c=st.floats(0.2, 1.5), gap=st.floats(0.005, 0.05))
def test_the_fit_recovers_any_noiseless_curve_to_1e_5(a, b, c, gap):
    """Property: on 20 noiseless points of the model (iterations 10..200) the fitted crossing is t* to rtol 1e-5."""
    acc = _curve(a, b, c)
    use = (GRID > 0) & (GRID <= W)
    fit = fit_learning_curve(GRID[use], acc[use])
    target = a - gap
    t_star = (b / gap) ** (1 / c)
    assert fit.crossing(target) == pytest.approx(t_star, rel=1e-5)


def test_an_asymptote_below_the_target_is_never_and_ranks_last():
    acc = _curve(0.80, 1.0, 0.7)
    p = predict_iterations(GRID, acc, 0.85, W, 10)
    assert p.how == "asymptote below target" and p.iteration == math.inf and not p.reached
    assert p.fit.a == pytest.approx(0.80, rel=1e-7)
    assert list(rank([2.0, math.inf, 1.0, math.inf])) == [2, 3, 1, 3]


def test_a_target_seen_in_the_window_is_that_point():
    acc = _curve(0.95, 1.0, 0.7)  # 0.95 - 1/t^0.7 >= 0.85 from t = 26.8: the point 30
    p = predict_iterations(GRID, acc, 0.85, W, 10)
    assert (p.how, p.iteration, p.fit) == ("observed", 30.0, None)


def test_too_few_points_in_the_window_is_a_config_error():
    its = np.arange(0, 301, 25)  # tta's default grid: 25 and 50 in the first 60 iterations
    with pytest.raises(ConfigError, match=r"hold 2 evaluation points .* valid >= 4"):
        predict_iterations(its, _curve(0.9, 1.0, 0.5, its), 0.89, 50, 25)


def test_measured_time_to_accuracy_is_the_first_evaluation_point_at_the_target():
    its, clock, acc = [0, 10, 20, 30, 40], [0.0, 0.1, 0.25, 0.4, 0.5], [0.1, 0.5, 0.8, 0.79, 0.9]
    assert measured_tta(its, clock, acc, 0.8) == (20, 0.25)
    assert measured_tta(its, clock, acc, 0.5) == (10, 0.1)  # equal to the target counts
    assert measured_tta(its, clock, acc, 0.85) == (40, 0.5)  # not the dip at 30
    assert measured_tta(its, clock, acc, 0.95) is None


# ------------------------------------------------------------------ the comparison

@pytest.mark.parametrize("n", [3, 7, 12])
def test_one_swap_gives_the_closed_form_kendall_tau(n):
    names = [f"c{i}" for i in range(n)]
    measured = np.arange(1.0, n + 1)
    swapped = measured.copy()
    swapped[[n // 2, n // 2 + 1]] = swapped[[n // 2 + 1, n // 2]]  # one adjacent swap: one discordant pair
    r = compare(swapped, measured, names)
    assert r["kendall_tau"] == pytest.approx(1 - 4 / (n * (n - 1)), abs=1e-12)
    assert r["top1"] == r["top1_measured"] == "c0" and r["top1_agree"] is True
    first = measured.copy()
    first[[0, 1]] = first[[1, 0]]
    r = compare(first, measured, names)
    assert r["kendall_tau"] == pytest.approx(1 - 4 / (n * (n - 1)), abs=1e-12)
    assert (r["top1"], r["top1_measured"], r["top1_agree"]) == ("c1", "c0", False)
    assert compare(measured[::-1], measured, names)["kendall_tau"] == pytest.approx(-1.0, abs=1e-12)


def test_nevers_are_ties_and_no_reached_configuration_has_no_top1():
    names = ["a", "b", "c", "d"]
    r = compare([1.0, 2.0, math.inf, math.inf], [1.0, 2.0, 3.0, math.inf], names)
    # tau-b: 6 pairs, 5 concordant, 0 discordant, one tie in x only: 5 / sqrt(5 * 6)
    assert r["kendall_tau"] == pytest.approx(5 / math.sqrt(30), abs=1e-12) and r["top1_agree"] is True
    r = compare([1.0, 2.0, 3.0, 4.0], [math.inf] * 4, names)
    assert math.isnan(r["kendall_tau"]) and r["top1_measured"] is None and r["top1_agree"] is None
    r = compare([math.inf] * 4, [1.0, 2.0, 3.0, 4.0], names)
    assert r["top1"] is None and r["top1_agree"] is False


def _hand_made_curves():
    """Three configurations x 2 seeds (the asymptote a raised by 0.001 for seed 1) x 2 clusters on the
    1000-iteration grid, noiseless: 'fast' (0.90 - 1.2 t^-0.6), 'late' (0.91 - t^-0.5), 'flat' (0.80 - t^-0.7,
    never at 0.87); a constant s / iteration per configuration and cluster."""
    models = {("fast", None): (0.90, 1.2, 0.6), ("late", 0.001): (0.91, 1.0, 0.5), ("flat", 0.01): (0.80, 1.0, 0.7)}
    s_per_it = {("fast", "A"): 0.02, ("late", "A"): 0.003, ("flat", "A"): 0.001,
                ("fast", "B"): 0.001, ("late", "B"): 0.0005, ("flat", "B"): 0.001}
    rows = []
    for cl in ("A", "B"):
        for (alg, dens), (a, b, c) in models.items():
            for seed in (0, 1):
                acc = _curve(a + 0.001 * seed, b, c)
                for t, y in zip(GRID, acc):
                    rows.append({"algorithm": alg, "density": dens, "seed": seed, "cluster": cl, "iteration": int(t),
                                 "sim_time_s": t * s_per_it[alg, cl], "test_accuracy": float(y)})
    return rows, models, s_per_it


def test_validation_on_hand_made_curves_gives_exact_times_and_ranks():
    rows, models, s_per_it = _hand_made_curves()
    cases, fits, rankings = validate(rows, (0.87,), 0.2)
    assert len(cases) == 6 and len(fits) == 12 and len(rankings) == 6
    by = {(c["cluster"], c["algorithm"]): c for c in cases}
    # t*: fast 466.1 (seed 0), 443.0 (seed 1); late 625.0, 594.9: on the grid 470, 450 and 630, 600
    want = {"fast": 460.0, "late": 615.0, "flat": math.inf}
    for (cl, alg), c in by.items():
        assert c["predicted_iteration"] == c["measured_iteration"] == want[alg]
        assert c["iter_time_s"] == pytest.approx(s_per_it[alg, cl], rel=1e-12)
        if alg == "flat":
            assert c["predicted_tta_s"] == c["measured_tta_s"] == math.inf
            assert (c["n_predicted"], c["n_reached"]) == (0, 0)
        else:
            assert c["predicted_tta_s"] == pytest.approx(want[alg] * s_per_it[alg, cl], rel=1e-12)
            assert c["measured_tta_s"] == pytest.approx(want[alg] * s_per_it[alg, cl], rel=1e-12)
    # A: late 615 x 0.003 = 1.85 s, fast 460 x 0.02 = 9.2 s, flat never; B: late 0.31 s, fast 0.46 s
    for cl in ("A", "B"):
        assert [by[cl, a]["rank_measured"] for a in ("late", "fast", "flat")] == [1, 2, 3]
        assert [by[cl, a]["rank_predicted"] for a in ("late", "fast", "flat")] == [1, 2, 3]
    lc = {r["cluster"]: r for r in rankings if r["ranker"].startswith("learning curve")}
    assert lc["A"]["kendall_tau"] == pytest.approx(1.0) and lc["A"]["top1"] == "late 0.001" and lc["A"]["top1_agree"]
    # by s / iteration alone cluster A ranks flat (0.001) < late (0.003) < fast (0.02): 1 concordant pair, 2 not
    naive = next(r for r in rankings if r["cluster"] == "A" and r["ranker"] == "s / iteration")
    assert naive["kendall_tau"] == pytest.approx(-1 / 3) and naive["top1"] == "flat 0.01"
    assert naive["top1_agree"] is False


# ------------------------------------------------------------------ the command

@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("va") / "q"
    r = _invoke("--quick", "--jobs", "1", "--out", str(out))
    assert r.exit_code == 0, r.output
    return out, r.output


@needs_data
def test_quick_writes_the_files_and_runs_gives_the_same_bytes(quick, tmp_path):
    out, output = quick
    assert not out.with_name(out.name + ".partial").exists()
    for f in ("cases.csv", "fits.csv", "rankings.csv", "report.md", "validation.png", "validation.pdf",
              "tta/curves.csv", "tta/results.md"):
        assert (out / f).stat().st_size > 0, f
    cases, fits, rankings = _csv(out / "cases.csv"), _csv(out / "fits.csv"), _csv(out / "rankings.csv")
    assert tuple(_csv_header(out / "cases.csv")) == CASE_COLUMNS and tuple(_csv_header(out / "fits.csv")) == FIT_COLUMNS
    assert tuple(_csv_header(out / "rankings.csv")) == RANKING_COLUMNS
    # 2 targets x 2 clusters x 3 configurations (dense, topk, gtopk at 0.001) x 2 seeds; 3 rankers
    assert (len(cases), len(fits), len(rankings)) == (12, 24, 12)
    assert "## Agreement with the measured ranking" in output
    # --quick validates something: on each cluster and target the learning curve ranks 3 configurations (before:
    # 80 iterations, targets 0.72 / 0.75, every configuration 'never', tau n/a)
    lc = [r for r in rankings if r["ranker"] == "learning curve (20 %)"]
    assert len(lc) == 4 and all(int(r["configurations"]) == 3 for r in lc)
    assert all(math.isfinite(float(r["kendall_tau"])) and -1 <= float(r["kendall_tau"]) <= 1 for r in lc)
    assert all(r["top1"] and r["top1_measured"] and r["top1_agree"] in ("True", "False") for r in lc)
    assert int(lc[0]["measured_reached"]) == 3 and int(lc[0]["predicted_never"]) < 3
    # the measured side recomputed from the sweep's curves
    curves = _csv(out / "tta" / "curves.csv")
    for c in cases:
        per_seed = []
        for s in ("0", "1"):
            pts = [r for r in curves if (r["algorithm"], r["density"], r["seed"], r["cluster"])
                   == (c["algorithm"], c["density"], s, c["cluster"])]
            hit = next((r for r in pts if float(r["test_accuracy"]) >= float(c["target"])), None)
            per_seed.append(None if hit is None else float(hit["sim_time_s"]))
        if None in per_seed:
            assert c["measured_tta_s"] == "" and int(c["n_reached"]) == sum(x is not None for x in per_seed)
        else:
            assert float(c["measured_tta_s"]) == pytest.approx(np.mean(per_seed), rel=1e-15)
    again = tmp_path / "again"
    r = _invoke("--runs", str(out / "tta"), "--targets", "0.68,0.7", "--out", str(again))
    assert r.exit_code == 0, r.output
    for f in ("cases.csv", "fits.csv", "rankings.csv"):
        assert (again / f).read_bytes() == (out / f).read_bytes()
    assert not (again / "tta").exists()


def _csv_header(path):
    with open(path, newline="") as fh:
        return next(csv.reader(fh))


def _write_curves(path, rows):
    path.mkdir(parents=True)
    cols = ("algorithm", "density", "seed", "cluster", "iteration", "sim_time_s", "test_accuracy", "train_accuracy",
            "test_loss", "loss")
    with open(path / "curves.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow(["" if r.get(k) is None else r.get(k, "") for k in cols])


def test_runs_on_hand_made_curves_writes_the_report(tmp_path):
    rows, _m, _s = _hand_made_curves()
    _write_curves(tmp_path / "runs", rows)
    r = _invoke("--runs", str(tmp_path / "runs"), "--targets", "0.87", "--out", str(tmp_path / "v"))
    assert r.exit_code == 0, r.output
    cases = {(c["cluster"], c["algorithm"]): c for c in _csv(tmp_path / "v" / "cases.csv")}
    assert cases["A", "fast"]["predicted_iteration"] == "460.0" and cases["A", "flat"]["predicted_tta_s"] == ""
    assert "| fast | 0.02 | " in (tmp_path / "v" / "report.md").read_text()


@pytest.mark.parametrize("args, needle", [
    (["--targets", "0"], "--targets: '0' is out of range: valid 0 < target <= 1"),
    (["--targets", "1.5"], "--targets: '1.5' is out of range: valid 0 < target <= 1"),
    (["--targets", "nan"], "--targets: 'nan' is out of range"),
    (["--targets", "x"], "--targets: 'x' is not a number"),
    (["--targets", "0.8,0.8"], "names 0.8 twice"),
    (["--fraction", "1"], "--fraction 1.0 is out of range: valid 0 < fraction < 1"),
    (["--runs", "RUNS", "--quick"], "--quick with --runs"),
    (["--runs", "RUNS", "--jobs", "2"], "--jobs with --runs"),
    (["--runs", "EMPTY"], "holds no curves.csv: valid the output directory of sparsim experiment tta"),
    (["--runs", "MISSING"], "is not a directory"),
    (["--runs", "COARSE"], "hold 2 evaluation points after iteration 0 (eval every 25): valid >= 4"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    rows, _m, _s = _hand_made_curves()
    _write_curves(tmp_path / "RUNS", rows)
    (tmp_path / "EMPTY").mkdir()
    its = np.arange(0, 301, 25)  # tta's default grid: 25 and 50 in the first 60 iterations
    coarse = [{"algorithm": "dense", "density": None, "seed": 0, "cluster": "A", "iteration": int(t),
               "sim_time_s": 0.01 * t, "test_accuracy": float(y)} for t, y in zip(its, _curve(0.9, 1.0, 0.5, its))]
    _write_curves(tmp_path / "COARSE", coarse)
    args = [str(tmp_path / a) if a in ("RUNS", "EMPTY", "MISSING", "COARSE") else a for a in args]
    if "--runs" not in args:
        args = ["--runs", str(tmp_path / "RUNS"), *args]
    r = _invoke(*args, "--out", str(tmp_path / "t"))
    assert r.exit_code == 2 and r.output.startswith("error:") and needle in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()


def test_a_target_no_configuration_reaches_is_one_line_exit_2(tmp_path):
    """Before: exit 0 and a report of 'n/a' (every configuration 'not reached': nothing validated). The best a
    configuration reaches with both seeds is 'fast' seed 0 at iteration 1000: 0.90 - 1.2 x 1000^-0.6 = 0.881."""
    rows, _m, _s = _hand_made_curves()
    _write_curves(tmp_path / "runs", rows)
    r = _invoke("--runs", str(tmp_path / "runs"), "--targets", "0.87,0.95", "--out", str(tmp_path / "v"))
    assert r.exit_code == 2 and r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1, r.output
    assert ("--targets 0.95 is reached by no configuration of the runs with every seed, so no ranking can be "
            "validated at it (the best a configuration reaches with every seed is test accuracy 0.881): valid "
            "0 < target <= 0.881") in r.output
    assert not (tmp_path / "v").exists() and not (tmp_path / "v.partial").exists()
    with pytest.raises(ConfigError, match="--targets 0.882 is reached by no configuration"):
        validate(rows, (0.882,), 0.2)
    assert len(validate(rows, (0.88,), 0.2)[0]) == 6  # 0.88 < 0.881: 'fast' reaches it with both seeds


def test_a_bad_target_without_runs_fails_before_the_sweep(tmp_path):
    r = _invoke("--quick", "--targets", "0.7,2", "--out", str(tmp_path / "t"))
    assert r.exit_code == 2 and "--targets: '2' is out of range" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()

"""The paper experiments' --quick versions (delta, compression, memsgd) and their headline properties."""
from __future__ import annotations

import csv
import math

import pytest

from click.testing import CliRunner

from experiments.cli import main


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    r = CliRunner().invoke(main, ["experiment", name, "--quick", "--quiet", "--out", str(out), *extra],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert not (tmp_path / f"{name}.partial").exists()
    for suffix in ("png", "pdf"):
        assert (out / f"{name}.{suffix}").stat().st_size > 0
    return out, r.output


def test_delta_quick(tmp_path):
    out, output = _run(tmp_path, "delta")
    steps, summary = _csv(out / "delta.csv"), _csv(out / "summary.csv")
    assert {(s["objective"], s["algorithm"]) for s in summary} == {
        (o, a) for o in ("robust_regression", "softmax_digits") for a in ("topk", "gtopk")}
    for s in summary:
        d = [float(r["delta"]) for r in steps if r["objective"] == s["objective"] and r["algorithm"] == s["algorithm"]]
        assert len(d) == int(s["steps"]) == 150
        # the reported fraction, mean and max agree with the per-step CSV
        assert math.isclose(float(s["frac_le_1"]), sum(x <= 1 for x in d) / len(d))
        assert math.isclose(float(s["max_delta"]), max(d))
        assert math.isclose(float(s["mean_delta"]), sum(d) / len(d), rel_tol=1e-12)
        if s["algorithm"] == "gtopk":
            assert 0.9 <= float(s["mean_delta"]) <= 1.1  # the paper: delta just below 1
    assert int(summary[0]["c"]) == 1000
    assert "c = 640 (k = 1)" in output  # digits' scaled ratio is stated


def test_compression_quick(tmp_path):
    out, output = _run(tmp_path, "compression", "--algorithms", "gtopk,topk")
    bounds, curves = _csv(out / "bounds.csv"), _csv(out / "compression.csv")
    assert len(bounds) == 2 * (1 + 2 * 4)  # dense + 4 ratios x 2 algorithms, per objective
    assert {b["algorithm"].split(" ")[0] for b in bounds} == {"dense", "gtopk", "topk"}
    # at the same ratio Top-k (every worker's k entries) and gTop-k (k in all) apply different updates
    last = {r["algorithm"]: float(r["loss"]) for r in curves if r["objective"] == "softmax_digits"}
    assert last["topk c=32 (k=20)"] != last["gtopk c=32 (k=20)"]
    for b in bounds:
        assert float(b["bound_corrected"]) >= float(b["bound_published"]) > 0
    for obj in ("robust_regression", "softmax_digits"):
        dense = [float(r["loss"]) for r in curves if r["objective"] == obj and r["algorithm"] == "dense"]
        assert len(dense) == 61 and dense[-1] < dense[0]
    ks = sorted(int(b["k"]) for b in bounds if b["objective"] == "robust_regression" and b["algorithm"] != "dense"
                and b["algorithm"].startswith("gtopk"))
    assert ks == [1, 2, 5, 20]  # c = 20000, 10000, 4000, 1000 at d = 20000
    assert "scaled by d/20000" in output


def test_compression_refuses_a_dense_or_unknown_algorithm(tmp_path):
    for algs, needle in (("dense", "is not sparse"), ("nope", "is unknown"),
                         ("gtopk,topk,gtopk", "algorithms = gtopk,topk,gtopk names gtopk twice: valid each algorithm once")):
        r = CliRunner().invoke(main, ["experiment", "compression", "--quick", "--quiet", "--out",
                                      str(tmp_path / "c"), "--algorithms", algs])
        assert r.exit_code == 2 and needle in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "c").exists() and not (tmp_path / "c.partial").exists()


def test_memsgd_quick(tmp_path):
    out, output = _run(tmp_path, "memsgd")
    summary = _csv(out / "summary.csv")
    final = {(s["algorithm"], int(s["k"])): float(s["final_suboptimality"]) for s in summary}
    for s in summary:
        assert float(s["final_suboptimality"]) < float(s["initial_suboptimality"])  # decreased from the start
    for k in (1, 2, 3):
        assert final[("topk", k)] < final[("randk", k)]
    assert "L-BFGS-B" in output


def test_memsgd_bad_libsvm_is_one_line_error(tmp_path):
    r = CliRunner().invoke(main, ["experiment", "memsgd", "--quick", "--quiet", "--out", str(tmp_path / "m"),
                                  "--libsvm", str(tmp_path / "missing.svm")])
    assert r.exit_code == 2
    assert r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1


def test_existing_out_needs_force(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    for name in ("delta", "compression", "memsgd"):
        r = CliRunner().invoke(main, ["experiment", name, "--quick", "--quiet", "--out", str(tmp_path / "d")])
        assert r.exit_code == 2 and r.output.strip().startswith("error:")
    r = CliRunner().invoke(main, ["experiment", "delta", "--quick", "--quiet", "--jobs", "0", "--out",
                                  str(tmp_path / "e")])
    assert r.exit_code == 2 and "--jobs" in r.output


def test_delta_quick_on_a_dask_cluster_equals_local(tmp_path):
    """--scheduler sends the runs to a Dask cluster; the results are the same as a local run's."""
    distributed = pytest.importorskip("dask.distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cl:
        r = CliRunner().invoke(main, ["experiment", "delta", "--quick", "--quiet", "--out", str(tmp_path / "dask"),
                                      "--scheduler", cl.scheduler_address])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["experiment", "delta", "--quick", "--quiet", "--jobs", "1",
                                  "--out", str(tmp_path / "local")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "dask" / "delta.csv").read_bytes() == (tmp_path / "local" / "delta.csv").read_bytes()

"""The sparsim CLI: determinism of a run directory, and bad input -> one line, exit code 2, no output left."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner

from experiments.cli import main

QUICK = ["--set", "training.iterations=12", "--quiet"]


def _run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_default_scenario_run_directory_and_byte_identical_metrics(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ra = _run(["run", "--out", str(a), *QUICK])
    rb = _run(["run", "--out", str(b), *QUICK])
    assert ra.exit_code == 0 and rb.exit_code == 0, ra.output
    assert (a / "metrics.csv").read_bytes() == (b / "metrics.csv").read_bytes()
    for name in ("metrics.csv", "summary.json", "figure.png", "figure.pdf"):
        assert (a / name).stat().st_size > 0
    rows = list(csv.DictReader(open(a / "metrics.csv")))
    assert {r["algorithm"] for r in rows} == {"dense", "topk", "gtopk"}
    assert len(rows) == 3 * 13  # rows 0..12 per algorithm
    summary = json.loads((a / "summary.json").read_text())
    assert summary["seed"] == 0 and summary["resolved"]["d"] == 640 and summary["resolved"]["k"] == 6
    assert summary["versions"]["numpy"] == np.__version__
    dense = [r for r in rows if r["algorithm"] == "dense"]
    assert all(r["delta"] == "" for r in dense)
    # 1 GbE, P = 8: ring allreduce 14 alpha + ..., Top-k 3 alpha + ..., gTop-k tree 6 alpha + ... (per iteration)
    comm = {alg: float([r for r in rows if r["algorithm"] == alg][1]["comm_s"]) for alg in ("dense", "topk", "gtopk")}
    assert comm["topk"] < comm["gtopk"] < comm["dense"]
    assert not (tmp_path / "a.partial").exists()


def test_algorithms_option_and_set_override(tmp_path):
    out = tmp_path / "o"
    r = _run(["run", "--out", str(out), "--algorithms", "gtopk,gtopk_reference", "--set", "cluster.P=5", *QUICK])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert {r_["algorithm"] for r_ in rows} == {"gtopk", "gtopk[reference]"}
    assert json.loads((out / "summary.json").read_text())["resolved"]["P"] == 5


def _bad(tmp_path, args, needle):
    out = tmp_path / "bad"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", *args])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert not out.exists() and not (tmp_path / "bad.partial").exists()
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    (["--set", "compression.k=0"], "compression.k = 0"),
    (["--set", "compression.k=-3"], "compression.k = -3"),
    (["--set", "compression.k=641"], "k = 641 is out of range: valid 1 <= k <= d = 640"),
    (["--set", "cluster.P=0"], "cluster.P = 0"),
    (["--set", "cluster.network=custom", "--set", "cluster.bandwidth_Bps=0"], "bandwidth_Bps = 0"),
    (["--set", "cluster.network=custom", "--set", "cluster.bandwidth_Bps=-1e9"], "bandwidth_Bps = -1000000000.0"),
    (["--set", "cluster.network=5GbE"], "5GbE"),
    (["--set", "cluster.nodes=3"], "unknown key 'nodes'"),
    (["--set", "cluster.P=eight"], "cluster.P = 'eight'"),
    (["--set", "training.iterations=0"], "training.iterations = 0"),
    (["--set", "data.objective=logistic", "--set", "data.dataset=libsvm", "--set", "data.path=/no/such.svm"],
     "/no/such.svm"),
    (["--set", "data.objective=sines", "--set", "data.d=50", "--set", "training.lr=1e300"], "at iteration"),
    (["--algorithms", "dense,sgd"], "algorithms"),
])
def test_bad_input_one_line_exit_2_no_output(tmp_path, args, needle):
    _bad(tmp_path, args, needle)


def test_divergence_is_an_error_not_a_success(tmp_path):
    """A step size that makes the loss overflow ends the run with exit 2 (it used to exit 0 with empty losses)."""
    line = _bad(tmp_path, ["--set", "training.lr=1e200"], "diverged at iteration 1 of dense")
    assert "lower training.lr" in line


def test_nan_in_data_file(tmp_path):
    f = tmp_path / "nan.svm"
    f.write_text("1 1:0.5 2:nan\n-1 1:0.25 2:1.0\n1 1:1 2:2\n-1 1:3 2:1\n")
    line = _bad(tmp_path, ["--set", "data.objective=logistic", "--set", "data.dataset=libsvm",
                           "--set", f"data.path='{f}'", "--set", "cluster.P=2", "--set", "training.batch_size=1"],
                "nan.svm")
    assert "row" in line or "(0, 1)" in line


def test_malformed_scenario_files(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("[cluster]\nP = 4\nbogus = 1\n")
    _bad(tmp_path, [str(f)], "unknown key 'cluster.bogus'")
    f.write_text("[cluster\nP = 4\n")
    _bad(tmp_path, [str(f)], "invalid TOML")
    f.write_text('[cluster]\nP = "four"\n')
    _bad(tmp_path, [str(f)], "cluster.P = 'four'")
    _bad(tmp_path, [str(tmp_path / "missing.toml")], "missing.toml")


def test_existing_output_directory_is_not_overwritten(tmp_path):
    out = tmp_path / "bad"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = CliRunner().invoke(main, ["run", "--out", str(out), *QUICK])
    assert r.exit_code == 2 and "exists" in r.stderr
    assert (out / "keep.txt").read_text() == "x"


def test_predict_closed_forms():
    r = _run(["predict", "--P", "32,128", "--d", "25000000", "--density", "0.001"])
    assert r.exit_code == 0
    # docs/costs.md: modelled gTop-k (tree) vs Top-k at 25M parameters, density 0.001, 1 GbE: 23 ms vs 61 ms at P = 32
    line32 = [ln for ln in r.output.splitlines() if ln.strip().startswith("32 ")][0].split()
    assert float(line32[3]) == pytest.approx(57.980, abs=1e-3)  # allgather: 5 alpha + 31 k 8 beta
    assert float(line32[4]) == pytest.approx(22.501, abs=1e-3)  # gTop-k tree: 2 lg P (alpha + k 8 beta) + mask bytes
    # the published figures use the released script's d = 25 x 2^20: 23 ms vs 61 ms at P = 32, 33 vs 243 at P = 128
    r = _run(["predict", "--P", "32,128", "--d", str(25 * 2**20), "--density", "0.001"])
    rows = {ln.split()[0]: ln.split() for ln in r.output.splitlines() if ln.strip()[:1].isdigit()}
    assert round(float(rows["32"][3])) == 61 and round(float(rows["32"][4])) == 23
    assert round(float(rows["128"][3])) == 243 and round(float(rows["128"][4])) == 33


def test_force_replaces_only_sparsim_directories(tmp_path):
    out = tmp_path / "foreign"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--force", *QUICK])
    assert r.exit_code == 2 and "not written by sparsim" in r.stderr
    assert (out / "thesis.tex").read_text() == "precious"
    mine = tmp_path / "mine"
    assert _run(["run", "--out", str(mine), *QUICK]).exit_code == 0
    assert _run(["run", "--out", str(mine), "--force", *QUICK]).exit_code == 0


def test_a_foreign_partial_directory_is_never_removed(tmp_path):
    (tmp_path / "r.partial").mkdir()
    (tmp_path / "r.partial" / "notes.txt").write_text("precious")
    r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "r"), *QUICK])
    assert r.exit_code == 2 and "r.partial' exists and was not written by sparsim" in r.stderr
    assert (tmp_path / "r.partial" / "notes.txt").read_text() == "precious" and not (tmp_path / "r").exists()


def test_a_dense_only_run_and_its_check_print_no_warnings(tmp_path):
    import warnings

    out = tmp_path / "dense"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" legend warning included
        assert _run(["run", "--out", str(out), "--algorithms", "dense", *QUICK]).exit_code == 0
        r = CliRunner().invoke(main, ["check", str(out)])
    assert r.exit_code == 0 and r.stderr == "", r.stderr


@pytest.mark.parametrize("where", ["file", "", "unwritable"])
def test_unusable_out_is_a_one_line_error(tmp_path, where):
    if where == "file":
        out = tmp_path / "f"
        out.write_text("x")
    elif where == "unwritable":
        (tmp_path / "blocker").write_text("x")
        out = tmp_path / "blocker" / "sub" / "run"  # a parent that is a file cannot be created
    else:
        out = ""
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--force", *QUICK])
    assert r.exit_code == 2, r.output
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1 and r.stderr.startswith("error: ")


@pytest.mark.parametrize("args,needle", [
    (["run", "--bogus"], "No such option '--bogus'"),
    (["calibrate", "--pattern", "foo"], "'foo' is not one of 'exchange', 'pingpong'"),
    (["nosuch"], "No such command 'nosuch'"),
    (["theory", "show"], "Missing argument 'NAME'"),
])
def test_usage_errors_are_one_line_too(args, needle):
    r = CliRunner().invoke(main, args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and needle in lines[0] and "--help')" in lines[0], lines[0]


def test_help_and_version_still_exit_0():
    assert CliRunner().invoke(main, ["--help"]).exit_code == 0
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and ", version " in r.output


@pytest.mark.parametrize("args, needle", [
    (["--set", "data.path=\"/nonexistent.svm\""], "data.path = '/nonexistent.svm': used only with dataset = 'libsvm'"),
    (["--timeout", "5"], "--timeout applies to the torch backend only"),
    (["--dist-backend", "gloo"], "--dist-backend applies to the torch backend only"),
])
def test_settings_the_simulator_would_ignore_are_errors(tmp_path, args, needle):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["run", "--out", str(out), *QUICK, *args])
    assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("sets, needle", [
    (["cluster.P=\"8\""], "cluster.P = '8' must be an integer: valid 1 <= P <= 65_536"),
    (["training.lr=\"0.5\""], "training.lr = '0.5' must be a number: valid 0 < lr"),
    (["cluster.P=8.0"], "cluster.P = 8.0 must be an integer: valid 1 <= P <= 65_536"),
    (["compression.layer_sizes=[\"320\", 320]"], "compression.layer_sizes.0 = '320'"),
])
def test_strings_are_not_coerced_to_numbers(tmp_path, sets, needle):
    """Issue #13, case 6: the schema's types are strict (a string is not a number), as the key table says."""
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code == 2 and needle in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_summary_provenance_and_run_id(tmp_path):
    """Issue #13: summary.json says how and from what code the run was made; metrics.csv rows carry the run's id
    (the same scenario gives the same id; another scenario another)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run(["run", "--out", str(a), *QUICK]).exit_code == 0
    assert _run(["run", "--out", str(b), *QUICK, "--set", "seed=1"]).exit_code == 0
    s = json.loads((a / "summary.json").read_text())
    p = s["provenance"]
    assert p["schema_version"] == 2 and p["finished_utc"].endswith("+00:00")
    assert p["git_revision"] is None or len(p["git_revision"]) == 40
    ids_a = {r["run_id"] for r in csv.DictReader(open(a / "metrics.csv"))}
    ids_b = {r["run_id"] for r in csv.DictReader(open(b / "metrics.csv"))}
    assert len(ids_a) == 1 and len(ids_b) == 1 and ids_a != ids_b and len(next(iter(ids_a))) == 16


def test_importing_plots_keeps_the_matplotlib_backend():
    """Issue #13: a notebook importing the package keeps its backend; only the CLI picks Agg."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import experiments.plots, matplotlib; print(matplotlib.get_backend())"],
                         capture_output=True, text=True, env={**os.environ, "MPLBACKEND": "svg"}, timeout=120)
    assert out.stdout.strip().lower() == "svg", out.stderr


def test_predict_takes_alpha_beta_or_a_calibration_file(tmp_path):
    """Issue #13: predict accepts a custom alpha / bandwidth or a calibrate output, like a scenario does."""
    from sim.comm.costs import ring_allreduce_time

    r = _run(["predict", "--alpha-s", "1e-4", "--bandwidth-Bps", "1.25e9", "--P", "8", "--collectives", "ring"])
    assert r.exit_code == 0, r.output
    want = 1e3 * ring_allreduce_time(8, 25_000_000, 1e-4, 1 / 1.25e9, 4)
    assert f"{want:.3f}" in r.output
    cal = tmp_path / "cal.toml"
    cal.write_text('[cluster]\nnetwork = "custom"\nalpha_s = 0.0001\nbandwidth_Bps = 1.25e9\n')
    r2 = _run(["predict", "--calibration", str(cal), "--P", "8", "--collectives", "ring"])
    assert r2.exit_code == 0 and r2.output == r.output
    for args, msg in ((["--alpha-s", "1e-4"], "go together"), (["--alpha-s", "1e-4", "--bandwidth-Bps", "0"], "--bandwidth-Bps = 0.0"),
                      (["--network", "10GbE", "--calibration", str(cal)], "give one of them")):
        bad = CliRunner().invoke(main, ["predict", *args])
        assert bad.exit_code == 2 and msg in bad.output and len(bad.output.strip().splitlines()) == 1


@pytest.mark.parametrize("sets, needle", [
    (["data.d=50"], "data.d: used only by the synthetic objectives"),
    (["data.n=100"], "data.n: used only by the synthetic objectives"),
    (["data.objective=\"sines\"", "data.lam=0.1"], "data.lam: used only by the objectives that train on a data set"),
    (["data.objective=\"sines\"", "data.dataset=\"breast_cancer\""], "data.dataset: used only by"),
])
def test_data_keys_the_objective_ignores_are_errors(tmp_path, sets, needle):
    """Issue #13, case 1: a key the resolved scenario does not use is an error, not silently ignored."""
    r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "r"), "--quiet", *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code == 2 and needle in r.output and len(r.output.strip().splitlines()) == 1


def test_summary_records_only_the_keys_the_run_used(tmp_path):
    out = tmp_path / "r"
    assert _run(["run", "--out", str(out), *QUICK]).exit_code == 0
    sc = json.loads((out / "summary.json").read_text())["scenario"]
    assert "torch" not in sc and "workload" not in sc and "d" not in sc["data"] and "path" not in sc["data"]
    assert "alpha_s" not in sc["cluster"] and "gpus_per_node" not in sc["cluster"]
    from experiments.record import run_id
    from experiments.scenario import Scenario, load_scenario

    # reloading what was recorded gives the same run
    full = load_scenario(None, ["training.iterations=12"])
    assert run_id(Scenario.model_validate(sc)) == run_id(full)


def test_status_goes_through_logging_with_a_verbosity_flag(tmp_path):
    """Issue #13: status through the standard logging module (logger 'sparsim'), -v shows it, default hides it."""
    quiet = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "a"), *QUICK])
    loud = CliRunner().invoke(main, ["-v", "run", "--out", str(tmp_path / "b"), *QUICK])
    assert quiet.exit_code == loud.exit_code == 0
    assert "INFO" not in quiet.stderr
    assert "INFO: gtopk: 12 iterations simulated" in loud.stderr and "INFO: published" in loud.stderr


def test_predict_refuses_a_message_level_simulation_too_large_for_memory():
    """A fresh-clone check found --engine message at P = 65536 killed for memory: now one line, exit 2."""
    r = CliRunner().invoke(main, ["predict", "--simulate", "--engine", "message", "--P", "65536",
                                  "--collectives", "ring"])
    assert r.exit_code == 2 and "valid P <= 4096 with --engine message" in r.output


def test_summary_table_columns_never_run_together():
    """Every cell keeps a blank column on its left, also for large negative losses (a fresh user saw
    '1.624-37021.71045': sim time and final loss as one number)."""
    from experiments.run_summary import _fixed

    for x, width, prec in ((-37021.71045, 12, 5), (1.624, 11, 3), (123456.789, 11, 3), (-1e21, 12, 5), (0.29612, 12, 5)):
        cell = _fixed(x, width, prec)
        assert len(cell) == width and cell[0] == " ", (x, cell)
        assert float(cell) == pytest.approx(x, rel=1e-3)

"""Nothing silently wrong (issue #13, cases 2, 3, 7 and 8): extreme values, divergence, resources, data that
overflows and the torch backend's stderr each end in one line ``error: ...``, exit code 2, no run directory
(and no numpy warning on the way)."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from experiments.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _bad(tmp_path, args, *needles):
    """Run ``sparsim run`` in-process with numpy's RuntimeWarnings turned into errors; expect exit code 2, one
    line on stderr holding every needle, no ``--out`` and no ``.partial`` left. Returns the line."""
    out = tmp_path / "bad"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a warning on the way would be an exception: exit 1
        r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", *args])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists() and not (tmp_path / "bad.partial").exists()
    return lines[0]


def _cli(tmp_path, args, timeout=120, python_flags=()):
    """``python [flags] -m experiments.cli run --out tmp/out --quiet ARGS`` in a subprocess; returns it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *python_flags, "-m", "experiments.cli", "run", "--out",
                           str(tmp_path / "out"), "--quiet", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)


def _one_line(proc, tmp_path, *needles, partial_ok=False):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    if not partial_ok:
        assert not (tmp_path / "out.partial").exists()
    return lines[0]


# ------------------------------------------------------------------ case 2: extreme values, limits, divergence

@pytest.mark.parametrize("args, needles", [
    # used to report 0 ms per iteration after an overflow warning
    (["--set", "compute.forward_backward_s=1e308"], ("compute.forward_backward_s = 1e+308", "3600")),
    # used to print 300-digit times
    (["--set", "cluster.network=custom", "--set", "cluster.bandwidth_Bps=1e-300"], ("cluster.bandwidth_Bps = 1e-300",)),
    (["--set", "cluster.network=hierarchical", "--set", "cluster.intra_bandwidth_Bps=0.5"],
     ("cluster.intra_bandwidth_Bps = 0.5",)),
    # used to truncate every dense message to 0 ms
    (["--set", "cluster.quantum_s=1e-3"], ("cluster.quantum_s = 0.001",)),
    (["--set", "compute.straggler_factor=1e6"], ("compute.straggler_factor", "1000")),
    (["--set", "compute.jitter=lognormal", "--set", "compute.jitter_scale=50"], ("compute.jitter_scale", "3")),
    (["--set", "compute.select_coeff_s=10.0"], ("compute.select_coeff_s",)),
    (["--set", "compute.merge_coeff_s=2.0"], ("compute.merge_coeff_s",)),
    (["--set", "compute.reduce_coeff_s=2.0"], ("compute.reduce_coeff_s",)),
    (["--set", "compute.update_coeff_s=2.0"], ("compute.update_coeff_s",)),
    (["--set", "data.lam=1e300"], ("data.lam",)),
    (["--set", "data.mu=1e9"], ("data.mu",)),
])
def test_values_beyond_physical_limits_are_one_line_errors(tmp_path, args, needles):
    _bad(tmp_path, args, *needles)


def test_a_quantum_that_truncates_a_hop_to_zero_is_an_error_when_simulated(tmp_path):
    """1 us quanta (within the limit) on a zero-latency 1e15 B/s network: every hop's exact time (< 1 ns) would
    be truncated to 0, so messages would arrive in no time."""
    line = _bad(tmp_path, ["--set", "cluster.network=custom", "--set", "cluster.alpha_s=0.0",
                           "--set", "cluster.bandwidth_Bps=1e15", "--set", "cluster.quantum_s=1e-6",
                           "--set", "training.iterations=2"], "quantum_s = 1e-06 s truncates", "to 0")
    assert "valid quantum_s <=" in line


def test_compute_model_limits_in_the_library():
    from sim.machine.compute import ComputeModel
    from sim.base.errors import ConfigError
    from sim.machine.network import NetworkSpec

    with pytest.raises(ConfigError, match=r"forward_backward_s = 1e\+308 is out of range: valid .*<= 3600"):
        ComputeModel(forward_backward_s=1e308)
    with pytest.raises(ConfigError, match="straggler_factor"):
        ComputeModel(straggler_factor=1e4)
    with pytest.raises(ConfigError, match="quantum_s = 0.001"):
        NetworkSpec("star", 1e-6, 1e9, 1e-3)


def test_a_loss_beyond_1e100_stops_the_run_naming_iteration_algorithm_and_value(tmp_path):
    """sines at lr = 3 grows without bound; it used to end in a matplotlib OverflowError traceback after
    losses of 1e276 were written."""
    line = _bad(tmp_path, ["--set", "data.objective=sines", "--set", "data.d=100", "--set", "training.lr=3.0",
                           "--set", "training.iterations=200"],
                "the run diverged at iteration", "of dense", "loss = ", "lower training.lr")
    assert "e+10" in line  # the value beyond 1e100 is named


def test_a_huge_step_on_the_default_scenario_is_divergence_not_a_5e200_loss(tmp_path):
    """lr = 1e150 used to exit 0 with final losses near 1e149 and more; now the first accumulator beyond 1e100 stops it."""
    line = _bad(tmp_path, ["--set", "training.lr=1e150"], "the run diverged at iteration 1 of dense",
                "error-feedback accumulator of worker", "lower training.lr")
    assert "1e+100" in line


def test_the_clock_must_resolve_every_iteration(tmp_path):
    """Valid values whose times span 11 orders of magnitude (an hour of compute, lognormal sigma 3, 1000x
    stragglers): the clock reaches 1e8 s and can no longer tell a 3 ms iteration's steps apart; that used to
    exit 0 with those iterations' times rounded."""
    _bad(tmp_path, ["--set", "cluster.P=1", "--set", "compute.forward_backward_s=3600.0",
                    "--set", "compute.jitter=lognormal", "--set", "compute.jitter_scale=3.0",
                    "--set", "compute.straggler_prob=0.5", "--set", "compute.straggler_factor=1000.0",
                    "--set", "training.iterations=3000", "--set", "data.objective=double_well",
                    "--set", "data.d=10", "--set", "data.n=16", "--set", "training.eval_every=1000",
                    "--algorithms", "dense"],
         "the simulated clock at", "cannot resolve", "iteration", "of dense")


def test_limits_stay_in_the_readme_key_table():
    from experiments.scenario import scenario_keys

    rows = {k: valid for k, _t, _d, valid, _m in scenario_keys()}
    assert rows["compute.forward_backward_s"] == "0 <= forward_backward_s <= 3600"
    assert rows["cluster.bandwidth_Bps"].startswith("1 <= bandwidth_Bps")
    assert rows["cluster.quantum_s"] == "0 <= quantum_s <= 1e-06"
    readme = (ROOT / "docs" / "scenarios.md").read_text()
    for key in ("compute.forward_backward_s", "compute.straggler_factor", "cluster.quantum_s", "data.lam"):
        assert f"| `{key}` |" in readme and rows[key] in readme


def test_numerics_unchanged_below_the_limits(tmp_path):
    """The checks only read: a normal run gives the same rows as the lock-step reference driver."""
    from experiments.build import build
    from experiments.scenario import load_scenario
    from sim.engine.runner import run_algorithm

    sc = load_scenario(None, ["training.iterations=5"])
    b = build(sc)
    for spec in b.specs:
        a = run_algorithm(spec, b.workers, T=5, lr=b.lr, x0=b.x0, network=b.network, compute=b.compute)
        r = run_algorithm(spec, b.workers, T=5, lr=b.lr, x0=b.x0, driver="lockstep")
        assert [x["loss"] for x in a] == [x["loss"] for x in r]


# ------------------------------------------------------------------ case 3: resources

def test_a_run_that_does_not_fit_in_memory_is_refused_before_allocating(tmp_path):
    """P = 4096 workers of d = 10^7 parameters (~3.6 TiB): it used to start allocating and die in a traceback."""
    p = _cli(tmp_path, ["--set", "data.objective=double_well", "--set", "cluster.P=4096", "--set", "data.d=10000000",
                        "--set", "data.n=4096", "--set", "training.batch_size=1"], timeout=60)
    line = _one_line(p, tmp_path, "the run needs about", "TiB of memory", "P = 4096 workers", "available")


def test_memory_estimate_names_estimate_and_available(monkeypatch):
    from experiments import resources
    from experiments.scenario import load_scenario
    from sim.base.errors import ResourceError

    sc = load_scenario(None, ["data.objective=double_well", "cluster.P=16", "data.d=100000"])
    info = resources.check_resources(sc, 100_000, 8 * 10**6, available=10**12)
    assert info["memory_bytes"] == 8 * 100_000 * (12 * 16 + 8) + 8 * 10**6
    with pytest.raises(ResourceError, match=r"needs about 160 MiB of memory .* has 100 MiB available"):
        resources.check_resources(sc, 100_000, 8 * 10**6, available=100 * 2**20)
    torch_mem, how = resources.estimate_memory(sc, 100_000, 8 * 10**6, backend="torch")
    assert torch_mem > 16 * resources.TORCH_PROCESS_BYTES and "16 processes" in how
    assert resources.available_memory_bytes() > 0


def test_too_much_work_needs_yes(tmp_path, monkeypatch):
    """10^7 iterations of 8 workers on d = 10^5 (~2.5e13 units, weeks): refused at once without --yes; it
    used to start and run for weeks."""
    p = _cli(tmp_path, ["--set", "data.objective=double_well", "--set", "data.d=100000",
                        "--set", "training.iterations=10000000"], timeout=60)
    line = _one_line(p, tmp_path, "estimated work is", "valid work <= 1e+11 units", "--yes")
    assert "days" in line

    from experiments import resources
    from experiments.run import run_scenario
    from experiments.scenario import load_scenario
    from sim.base.errors import ResourceError

    monkeypatch.setattr(resources, "MAX_WORK", 10.0)
    sc = load_scenario(None, ["training.iterations=3", "algorithms=gtopk"])
    with pytest.raises(ResourceError, match="pass --yes"):
        run_scenario(sc, tmp_path / "small", progress=False, figure=False)
    assert not (tmp_path / "small").exists() and not (tmp_path / "small.partial").exists()
    assert (run_scenario(sc, tmp_path / "small", progress=False, figure=False, yes=True) / "metrics.csv").exists()


def test_work_estimate_counts_messages():
    """Messages per worker per step are counted from the algorithm's own rounds (#23 item 6: the old rule, at most
    2 ceil(lg P) + 2 per collective, was 30x low for Ok-Topk at P = 1024 and missed PowerSGD's second allreduce)."""
    import math

    from experiments.resources import (MESSAGE_UNITS, MESSAGES_EXACT_MAX_P, STEP_UNITS, estimate_work,
                                       messages_per_step)
    from experiments.scenario import load_scenario
    from sim.algorithms import AlgorithmSpec

    d = 100_000
    assert messages_per_step(AlgorithmSpec("dense", collective="ring"), 8, d) == 14  # 2 (P - 1)
    # binomial reduce + broadcast: 2 (P - 1) messages over all P ranks
    assert messages_per_step(AlgorithmSpec("gtopk", k=10, collective="tree"), 8, d) == 14 / 8
    assert messages_per_step(AlgorithmSpec("topk", k=10), 1, d) == 0
    # Bruck allgather: ceil(lg P) rounds, every rank sends in each
    assert messages_per_step(AlgorithmSpec("topk", k=10), 1000, d) == math.ceil(math.log2(1000))
    # hierarchical ring allreduce, G = 8, N = 4: 2 (G - 1) in the node and 2 (N - 1) across
    assert messages_per_step(AlgorithmSpec("dense", collective="hierarchical", gpus_per_node=8), 32, d) == 14 + 6
    # Ok-Topk: P - 1 pairwise rounds, then two Bruck allgathers (counts, blocks)
    P = 1024
    assert messages_per_step(AlgorithmSpec("oktopk", k=1000), P, d) == P - 1 + 2 * 10
    # PowerSGD (ring, compressed): two allreduces of a padded ring, 2 (P - 1) each
    assert messages_per_step(AlgorithmSpec("powersgd", collective="ring"), 16, d) == 2 * 2 * 15
    # above the enumeration limit: the count at the limit scaled by (P - 1) / (limit - 1): the ring's exactly,
    # an upper bound for the logarithmic ones and Ok-Topk
    P = 2 * MESSAGES_EXACT_MAX_P
    assert messages_per_step(AlgorithmSpec("dense", collective="ring"), P, d) == pytest.approx(2 * (P - 1), rel=1e-12)
    assert messages_per_step(AlgorithmSpec("topk", k=10), P, d) >= math.ceil(math.log2(P))
    assert messages_per_step(AlgorithmSpec("oktopk", k=10_000), P, d) >= P - 1 + 2 * math.ceil(math.log2(P))
    sc = load_scenario(None, ["algorithms=dense", "training.iterations=10"])
    assert estimate_work(sc, 640) == 10 * 8 * (640 + MESSAGE_UNITS * 14 + STEP_UNITS)
    sc = load_scenario(None, ["algorithms=oktopk", "training.iterations=2", "cluster.P=1024"])
    assert estimate_work(sc, 640) == 2 * 1024 * (640 + MESSAGE_UNITS * (1023 + 20) + STEP_UNITS)


def test_progress_estimates_the_whole_runs_wall_time(monkeypatch):
    from experiments import progress as run_mod

    t = iter([0.0, 10.0])
    monkeypatch.setattr(run_mod.time, "perf_counter", lambda: next(t))
    clock = run_mod._RunClock(total=100)
    assert clock.remaining_s() is None
    for _ in range(20):
        clock.tick()
    assert clock.remaining_s() == pytest.approx(40.0)  # 10 s for 20 of 100 iterations
    assert run_mod._fmt_wall(40.0) == "40s" and run_mod._fmt_wall(3725) == "1h02m"
    # no bar when stderr is not a terminal (as under pytest)
    assert run_mod._progress("dense", 10, True, clock).bar is None


# ------------------------------------------------------------------ case 7: data that overflows is named as data

def test_a_feature_of_1e300_is_a_data_error_with_file_line_and_feature(tmp_path):
    """It used to print two numpy RuntimeWarnings and blame the learning rate. -W error: any warning on the way
    would end in a traceback (exit 1)."""
    f = tmp_path / "big.svm"
    f.write_text("# a comment line\n1 1:0.5 2:1e300\n-1 1:0.25 2:1.0\n1 1:1 2:2\n-1 1:3 2:1\n")
    p = _cli(tmp_path, ["--set", "data.objective=logistic", "--set", "data.dataset=libsvm",
                        "--set", f"data.path='{f}'", "--set", "cluster.P=2", "--set", "training.batch_size=1",
                        "--set", "training.iterations=3"], python_flags=("-W", "error"))
    line = _one_line(p, tmp_path, "big.svm", "line 2", "feature 2", "1e+300", "valid |value| <= 1e+100")
    assert "lr" not in line and "Warning" not in p.stderr


def test_data_magnitude_checked_for_every_data_set():
    import scipy.sparse as sp

    from sim.workloads.data import DATA_ABS_MAX, Dataset, check_finite
    from sim.base.errors import DataError

    X = np.zeros((3, 4))
    X[2, 1] = -1e200
    with pytest.raises(DataError, match=r"'x' holds the value -1e\+200 at \(row, column\) = \(2, 1\)"):
        Dataset(X=X, y=np.zeros(3, dtype=np.int64), n_classes=1, name="x")
    with pytest.raises(DataError, match=r"\(row, column\) = \(2, 1\)"):
        check_finite(sp.csr_matrix(X), "s")
    X[2, 1] = DATA_ABS_MAX  # the limit itself is valid
    check_finite(X, "x")
    check_finite(sp.csr_matrix(X), "x")


# ------------------------------------------------------------------ case 8: torch backend, a tiny --timeout

def test_torch_tiny_timeout_prints_one_line_and_keeps_the_log(tmp_path):
    """--timeout 0.001 used to print ~40 lines of c10d C++ stack frames before the one-line error."""
    pytest.importorskip("torch")
    p = _cli(tmp_path, ["--backend", "torch", "--nproc", "2", "--timeout", "0.001", "--set", "training.iterations=3",
                        "--algorithms", "dense"], timeout=90)
    line = _one_line(p, tmp_path, "torch backend failed: rank", partial_ok=True)
    err = (tmp_path / "out.partial" / "error.txt").read_text()
    assert err.splitlines()[0] == line.removeprefix("error: ")
    assert "--- rank" in err  # the ranks' own logs and tracebacks are kept there


# ------------------------------------------------------------------ issue #23 item 3: schedule keys not in use

@pytest.mark.parametrize("sets, unused, users", [
    (["training.schedule='corollary2'", "training.lr=0.1"], "training.lr", "'constant' or 'inverse'"),
    (["training.theta=0.2"], "training.theta", "'corollary2'"),
    (["training.inverse_a=5.0"], "training.inverse_a", "'inverse'"),
    (["training.schedule='inverse'", "training.theta=0.3"], "training.theta", "'corollary2'"),
])
def test_a_key_the_schedule_does_not_step_with_is_an_error(sets, unused, users):
    """corollary2 ignored training.lr (the run stepped with theta sqrt(B/T) = 0.2530) while summary.json recorded
    lr = 0.1; a key the run does not use is an error naming the schedules that use it."""
    from experiments.scenario import load_scenario
    from sim.base.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"{unused}: unused by schedule .*{unused} is used by schedule = {users}"):
        load_scenario(None, sets)


def test_summary_records_only_the_schedule_keys_the_run_steps_with():
    from experiments.scenario import load_scenario, used_keys_dump

    tr = used_keys_dump(load_scenario(None, ["training.schedule='corollary2'", "training.theta=0.2"]))["training"]
    assert tr["theta"] == 0.2 and "lr" not in tr and "inverse_a" not in tr
    tr = used_keys_dump(load_scenario(None, ["training.schedule='inverse'", "training.lr=0.2"]))["training"]
    assert tr["lr"] == 0.2 and tr["inverse_a"] == 100.0 and "theta" not in tr
    tr = used_keys_dump(load_scenario(None))["training"]
    assert "lr" in tr and "theta" not in tr and "inverse_a" not in tr


def test_predict_calibration_without_a_cluster_table_is_an_error(tmp_path):
    """#23 item 4: a --calibration file without [cluster] predicted for the schema's default 1 GbE without a word."""
    from click.testing import CliRunner

    from experiments.cli import main

    f = tmp_path / "cal.toml"
    f.write_text('name = "x"\n[training]\niterations = 5\n')
    r = CliRunner().invoke(main, ["predict", "--calibration", str(f), "--d", "1000000", "--P", "8"])
    assert r.exit_code == 2 and "has no [cluster] table" in r.output and len(r.output.strip().splitlines()) == 1
    f.write_text('[cluster]\nnetwork = "custom"\nalpha_s = 1e-5\nbandwidth_Bps = 1e10\n')
    r = CliRunner().invoke(main, ["predict", "--calibration", str(f), "--d", "1000000", "--P", "8"])
    assert r.exit_code == 0 and "alpha = 1e-05 s, beta = 1e-10 s/byte" in r.output


def test_layerwise_run_reports_the_k_it_selected_and_check_uses_it(tmp_path):
    """#23 item 1: with 64 segments of 10 on digits each segment selects max(1, round(6/640 x 10)) = 1, so a worker
    selects 64 entries (c = 10), not k = 6 (c = 106.7); summary.json, the header and sparsim check say so."""
    import csv
    import json

    from click.testing import CliRunner

    from experiments.check import check_run
    from experiments.cli import main

    out = tmp_path / "ls"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--set", "training.iterations=3", "--algorithms", "topk",
                                  "--set", "compression.layer_sizes=[" + ",".join(["10"] * 64) + "]"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "summary.json").read_text())["resolved"]
    assert (res["k"], res["k_selected_per_worker"], res["n_segments"], res["compression_ratio_c_selected"]) == (6, 64, 64, 10.0)
    assert "64 selected per worker over 64 segments" in r.output
    with open(out / "metrics.csv") as fh:
        assert {float(row["selected_per_worker"]) for row in csv.DictReader(fh) if int(row["iteration"]) >= 1} == {64.0}
    rep = check_run(out, write=False)
    assert any(n.startswith("gamma = 0.9:") for n in rep.notes)  # 1 - 1/10, not 1 - 6/640


# ---------------------------------------------------------------- layer tables have the numerics runs' limits (#23 item 5)


@pytest.mark.parametrize("cols, row, needle", [
    ("forward_flops,backward_flops", "1e308,1", "forward_flops of layer 'fc' = 1e+308 is out of range: valid 0 <= forward_flops of layer 'fc' <= 1e+18"),
    ("forward_flops,backward_flops", "1,2e18", "backward_flops of layer 'fc' = 2e+18 is out of range"),
    ("forward_s,backward_s", "1e200,0.1", "forward_s of layer 'fc' = 1e+200 is out of range: valid 0 <= forward_s of layer 'fc' <= 3600"),
])
def test_layer_table_costs_have_limits(tmp_path, cols, row, needle):
    from sim.base.errors import ConfigError
    from sim.workloads import load_layer_table

    head = "# measured_batch = 32\n" if "forward_s" in cols else ""
    path = tmp_path / "t.csv"
    path.write_text(f"{head}layer,tensor,numel,{cols}\nfc,fc.weight,100,{row}\n")
    with pytest.raises(ConfigError) as e:
        load_layer_table(path)
    assert needle in str(e.value) and "\n" not in str(e.value)
    # at the limit the table loads
    ok = row.replace("1e308", "1e18").replace("2e18", "1e18").replace("1e200", "3600")
    path.write_text(f"{head}layer,tensor,numel,{cols}\nfc,fc.weight,100,{ok}\n")
    assert load_layer_table(path).d == 100


# ---------------------------------------------------------------- #23: the scenario name, and who is blamed for a bad value


def test_a_long_or_multiline_name_is_refused_at_once_and_a_mathtext_name_is_drawn_as_text(tmp_path):
    from click.testing import CliRunner

    from experiments.cli import main

    for name, needle in (("a" * 201, "(this one: 201 characters)"), ("a\nb", "1 to 200 characters"),
                         ("x" * 1_000_000, "... (1000002 characters)")):
        r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "r"), "--set", f"name={name!r}".replace("'", '"')])
        assert r.exit_code == 2 and needle in r.stderr, r.stderr[:300]
        assert len(r.stderr) < 400 and len(r.stderr.strip().splitlines()) == 1  # the value is cut, not echoed whole
        assert not (tmp_path / "r").exists()
    # "$x^$" is invalid mathtext: it used to be a matplotlib traceback after the whole run; now it is the title
    r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "m"), "--quiet", "--set", 'name="$x^$"',
                                  "--set", "training.iterations=2"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "m" / "figure.png").stat().st_size > 0


def test_a_bad_set_value_blames_the_set_not_the_scenario_file(tmp_path):
    from click.testing import CliRunner

    from experiments.cli import main

    r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "r"), "--set", "cluster.P=abc"])
    assert r.exit_code == 2
    assert r.stderr.strip() == ("error: --set cluster.P=abc: cluster.P = 'abc' must be an integer: valid "
                                "1 <= P <= 65_536")
    # a value from the file itself is still the file's
    f = tmp_path / "s.toml"
    f.write_text("[cluster]\nP = 0\n")
    r = CliRunner().invoke(main, ["run", str(f), "--out", str(tmp_path / "r"), "--set", "training.iterations=3"])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: {f}: cluster.P = 0 is out of range"), r.stderr


# ---------------------------------------------------------------- #23: --out that is a link, or a name too long, before the run


@pytest.mark.parametrize("make", ["link", "dangling", "loop", "long"])
def test_out_links_and_long_names_are_refused_before_the_run(tmp_path, make):
    import os

    from click.testing import CliRunner

    from experiments.cli import main

    (tmp_path / "real").mkdir()
    if make == "link":
        out = tmp_path / "out"
        out.symlink_to(tmp_path / "real")
        needle = "is a symbolic link (to "
    elif make == "dangling":
        out = tmp_path / "out"
        out.symlink_to(tmp_path / "nowhere")
        needle = "is a symbolic link (to "
    elif make == "loop":
        out = tmp_path / "out"
        out.symlink_to(out)
        needle = "is a symbolic link (to "
    else:
        out = tmp_path / ("x" * 250)
        needle = "its last name is 250 bytes: valid at most 247 bytes"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--force", "--set", "training.iterations=100000"])
    assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["real"] + ([] if make == "long" else ["out"]))
    assert not any((tmp_path / "real").iterdir())


# ---------------------------------------------------------------- #23: Ctrl-C exits 130 and says what is left


def test_ctrl_c_after_the_directory_is_published_says_it_is_complete(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import experiments.run_summary as rs
    from experiments import outdir
    from experiments.cli import main

    monkeypatch.setattr(outdir, "PUBLISHED", [])

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(rs, "summary_lines", interrupted)  # the SIGINT lands while the summary is printed
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--set", "training.iterations=3"])
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines()[-1] == f"interrupted after {str(out)!r} was written (complete; it stays)"
    assert (out / "metrics.csv").exists() and not (tmp_path / "r.partial").exists()


def test_ctrl_c_during_a_run_exits_130_and_leaves_nothing(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "run", "--out", str(out), "--jobs", "1",
                             "--set", "training.iterations=10000000", "--yes"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "r.partial").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted; nothing was written"
    assert not out.exists() and not (tmp_path / "r.partial").exists()


def test_a_sigterm_swallowed_by_a_finalizer_is_raised_again():
    """SIGTERM's SystemExit can be lost when the handler runs inside a finalizer (printed as "Exception ignored"):
    the pool's wait loop calls raise_if_signalled every 0.5 s, which raises it again."""
    import gc
    import signal

    from sim.base import process

    class Finalized:
        def __del__(self):
            process.exit_on_signal(signal.SIGTERM)  # as if the signal's handler ran here

    old = list(process._RECEIVED)
    try:
        process._RECEIVED.clear()
        process.raise_if_signalled()  # nothing received: nothing raised
        Finalized()  # __del__ raises SystemExit; Python swallows it ("Exception ignored")
        gc.collect()
        with pytest.raises(SystemExit) as e:
            process.raise_if_signalled()
        assert e.value.code == 128 + signal.SIGTERM
    finally:
        process._RECEIVED[:] = old

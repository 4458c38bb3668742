"""A scenario's algorithms simulated at the same time in forked processes (experiments.algorithm_pool).

The rows must be the serial run's, bit for bit and in the scenario's order; a failure must surface as the serial
run's failure (the earliest algorithm's error); bad --jobs values are one-line errors (exit 2).
"""
from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from experiments import algorithm_pool
from experiments.algorithm_pool import algorithm_jobs, run_algorithms, usable_cpus
from experiments.cli import main
from experiments.build import build
from experiments.scenario import load_scenario
from sim.base.errors import ConfigError, NonFiniteError, ResourceError, SparsimError

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forked processes need os.fork")

SMALL = ["training.iterations=25", "algorithms=dense,topk,gtopk"]


def _built(extra=()):
    return build(load_scenario(None, SMALL + list(extra)))


def test_parallel_rows_equal_serial_rows_bit_for_bit():
    b = _built()
    T, ev = b.scenario.training.iterations, b.scenario.training.eval_every
    serial = run_algorithms(b.specs, b, T=T, eval_every=ev, jobs=1)
    for jobs in (2, 3):
        par = run_algorithms(b.specs, _built(), T=T, eval_every=ev, jobs=jobs)
        assert [r[0]["algorithm"] for r in par] == [r[0]["algorithm"] for r in serial]
        assert repr(par) == repr(serial)  # every cell, float bits included (repr round-trips floats)


def test_cli_metrics_csv_identical_whatever_jobs(tmp_path):
    shas = []
    for jobs in ("1", "3"):
        out = tmp_path / f"j{jobs}"
        args = ["run", "--out", str(out), "--quiet", "--jobs", jobs] + [a for s in SMALL for a in ("--set", s)]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        shas.append(hashlib.sha256((out / "metrics.csv").read_bytes()).hexdigest())
    assert shas[0] == shas[1]


def test_earliest_failure_is_raised_as_in_the_serial_run():
    # a step size that makes every algorithm diverge: each raises NonFiniteError/divergence naming its label
    b = _built(["training.lr=1e300"])
    T, ev = b.scenario.training.iterations, b.scenario.training.eval_every
    with pytest.raises(SparsimError) as serial:
        run_algorithms(b.specs, b, T=T, eval_every=ev, jobs=1)
    with pytest.raises(SparsimError) as par:
        run_algorithms(b.specs, _built(["training.lr=1e300"]), T=T, eval_every=ev, jobs=3)
    assert type(par.value) is type(serial.value)
    assert str(par.value) == str(serial.value)
    assert isinstance(serial.value, NonFiniteError)


def test_a_process_that_dies_is_named(monkeypatch):
    real = algorithm_pool.run_algorithm

    def dies_for_topk(spec, workers, **kw):
        if spec.label == "topk":
            os._exit(7)
        return real(spec, workers, **kw)

    monkeypatch.setattr(algorithm_pool, "run_algorithm", dies_for_topk)  # the forked child sees the patch
    b = _built()
    with pytest.raises(SparsimError, match=r"simulating topk ended without a result \(exit code 7\)"):
        run_algorithms(b.specs, b, T=25, eval_every=1, jobs=3)


def test_progress_ticks_reach_the_parent_in_order():
    b = _built()
    seen: dict = {}

    class Bar:
        def __init__(self, label):
            self.label, self.shown = label, True  # a shown bar: ticks are sent

        def on_row(self, row):
            seen.setdefault(self.label, []).append(row["iteration"])

        def close(self):
            seen.setdefault(self.label, []).append("closed")

    run_algorithms(b.specs, b, T=25, eval_every=1, jobs=3, bar_for=lambda s: Bar(s.label))
    for spec in b.specs:
        assert seen[spec.label] == list(range(0, 26)) + ["closed"]


def test_algorithm_jobs_rules():
    cpus = usable_cpus()
    assert algorithm_jobs(None, 1) == 1
    assert algorithm_jobs(None, 3) == min(3, 2 * cpus)
    assert algorithm_jobs(5, 3) == 3  # capped at the algorithms
    assert algorithm_jobs(1, 3) == 1
    gib = 2**30
    # half the available memory must hold every process's estimate
    assert algorithm_jobs(None, 3, {"memory_bytes": 10 * gib, "available_bytes": 24 * gib}) == 1
    assert algorithm_jobs(None, 3, {"memory_bytes": 4 * gib, "available_bytes": 24 * gib}) == min(3, 2 * cpus)
    assert algorithm_jobs(None, 8, {"memory_bytes": 4 * gib, "available_bytes": 24 * gib}) == min(3, 2 * cpus)
    with pytest.raises(ResourceError, match=r"--jobs 3 .* valid jobs <= 2"):
        algorithm_jobs(3, 3, {"memory_bytes": 10 * gib, "available_bytes": 24 * gib})
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="valid jobs >= 1"):
            algorithm_jobs(bad, 3)


@pytest.mark.parametrize("args, needle", [
    (["--jobs", "0"], "--jobs 0 is out of range: valid jobs >= 1"),
    (["--jobs", "2", "--backend", "torch"], "valid with --backend sim"),
    (["--jobs", "0", "--set", "workload.model=resnet20-cifar"], "--jobs 0 is out of range: valid jobs >= 1"),
    (["--jobs", "2", "--set", "workload.model=resnet20-cifar"], "without workload.model"),
])
def test_cli_bad_jobs_is_one_line_exit_2(tmp_path, args, needle):
    r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "o"), "--quiet"] + args)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_later_algorithms_earlier_failure_waits_for_the_earlier_algorithm(monkeypatch):
    # topk and gtopk fail at once, dense only after a while: the serial run would have raised dense's error
    import time

    def fails(spec, workers, **kw):
        if spec.label == "dense":
            time.sleep(0.5)
        raise ConfigError(f"failure of {spec.label}")

    monkeypatch.setattr(algorithm_pool, "run_algorithm", fails)
    b = _built()
    with pytest.raises(ConfigError, match="failure of dense"):
        run_algorithms(b.specs, b, T=25, eval_every=1, jobs=3)
    with pytest.raises(ConfigError, match="failure of dense"):
        run_algorithms(b.specs, b, T=25, eval_every=1, jobs=1)


def _sparsim_children_after(sig, tmp_path):
    """Start a parallel `sparsim run` long enough to be interrupted, send ``sig`` to the parent once its three
    children run, and return (parent's exit code, the children still alive 10 s later, what is left in tmp_path)."""
    import signal
    import subprocess
    import sys
    import time

    psutil = pytest.importorskip("psutil")
    cmd = [sys.executable, "-c", "import sys; from experiments.cli import main; sys.argv[0] = 'sparsim'; main()",
           "run", "--out", str(tmp_path / "r"), "--quiet", "--jobs", "3", "--algorithms", "topk,randk,gtopk",
           "--set", "data.objective=sines", "--set", "data.d=10", "--set", "cluster.P=2", "--set", "data.n=64",
           "--set", "training.batch_size=2", "--set", "training.lr=0.01", "--set", "training.iterations=200000"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        parent = psutil.Process(p.pid)
        t0 = time.time()
        # a loaded machine takes tens of seconds to import and fork (30 s seen with four other jobs running)
        while len(parent.children()) < 3 and time.time() - t0 < 300:
            time.sleep(0.05)
        kids = parent.children()
        assert len(kids) == 3
        os.kill(p.pid, sig)
        rc = p.wait(timeout=30)
        gone, alive = psutil.wait_procs(kids, timeout=10)
        return rc, alive, sorted(x.name for x in tmp_path.iterdir())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_sigterm_to_the_parent_stops_every_child_and_leaves_no_directory(tmp_path):
    import signal

    rc, alive, left = _sparsim_children_after(signal.SIGTERM, tmp_path)
    assert rc == 128 + signal.SIGTERM
    assert alive == [] and left == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_a_killed_parent(tmp_path):
    import signal

    rc, alive, _left = _sparsim_children_after(signal.SIGKILL, tmp_path)
    assert rc == -signal.SIGKILL
    assert alive == []  # no orphan goes on simulating (or blocks on its pipe) for the run that nobody reads


def test_prefetch_keeps_what_fits_and_draws_nothing_more(monkeypatch):
    import sim.engine.runner as R

    b = _built()
    w = b.workers
    one = w.batch_indices(10**6).nbytes  # an iteration's (P, b) int64 array (not kept: an iteration never run)
    w._batch_memo.clear()
    monkeypatch.setattr(R, "BATCH_MEMO_BYTES", 5 * one)
    calls = []
    real = R.minibatch
    monkeypatch.setattr(R, "minibatch", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    assert w.prefetch_batches(25) == 5
    assert sorted(w._batch_memo) == [1, 2, 3, 4, 5]
    assert sorted(set(calls)) == [1, 2, 3, 4, 5, 6]  # the 6th drawn once, found not to fit, and not kept
    assert w.prefetch_batches(25) == 5 and sorted(set(calls)) == [1, 2, 3, 4, 5, 6]
    for t in (1, 5):  # the kept draws are the ones a run makes
        assert (w._batch_memo[t] == np.stack([real(s, w.b, w.seed, r, t) for r, s in enumerate(w.shards)])).all()

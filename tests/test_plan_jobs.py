"""``sparsim plan --jobs``: each P's distinct collectives are simulated on worker processes before its configurations
run (experiments/plan.py: plan_collective_keys, prefetch_collectives, simulate_plan(jobs=)). The rows are those of
the serial run, bit for bit; the dry pass asks for exactly the collectives the serial run simulates (Horovod's
value-dependent fusion aside); jobs = 1 starts no process; a worker's error is the serial run's error; an
interrupted prefetch leaves no worker behind; --jobs out of range is one line, exit 2."""
from __future__ import annotations

import multiprocessing

import pytest
from click.testing import CliRunner

from experiments import plan as pl
from experiments.cli import main
from sim.base.errors import ConfigError
from sim.engine.timeline import CollectiveTimer


def _plan(model="mlp-256", network="dgx-h100", P="64,256", densities="0.001,0.01", overrides=(), **kw):
    return pl.resolve_plan(None, list(overrides), model=model, network=network, P=P, densities=densities, **kw)


@pytest.mark.parametrize("network", ["dgx-h100", "gtopk-icdcs"])
def test_rows_equal_the_serial_run_exactly(network):
    """Every algorithm x collective x density x policy (hybrid included) at P = 64 and 256: jobs = 2 gives the serial
    rows, every column equal (==, no tolerance), in the same order."""
    inp = _plan(network=network)
    assert {c.policy for c in inp.configs} >= {"model", "bucket", "layer", "hybrid", "ddp"}
    serial = pl.simulate_plan(inp, jobs=1)
    info = []
    par = pl.simulate_plan(inp, jobs=2, on_prefetch=info.append)
    assert [i["P"] for i in info] == [64, 256]
    assert all(i["jobs"] == 2 and i["simulated"] == i["collectives"] > 100 for i in info), info
    assert len(serial) == 2 * len(inp.configs)
    assert par == serial


def test_rows_equal_under_horovod_and_jitter():
    """Horovod's tensor fusion (its buffers depend on the collectives' times: left to the serial pass) and a
    jittered compute model over 2 iterations: jobs = 2 still gives the serial rows exactly."""
    inp = _plan(model="resnet20-cifar", network="10GbE", P="4,16", densities="0.01",
                overrides=["workload.dense_policy='horovod'", "compute.jitter='lognormal'",
                           "compute.jitter_scale=0.2"], iterations=2)
    assert pl.simulate_plan(inp, jobs=2) == pl.simulate_plan(inp, jobs=1)


class _Counting(CollectiveTimer):
    """A real timer that also lists the keys it simulates (its misses)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.misses = []

    def _run(self, spec, numel):
        if self.missing([self.key(spec, numel)]):
            self.misses.append(self.key(spec, numel))
        return super()._run(spec, numel)


def _serial_misses(inp, P):
    net = inp.network_of(P)
    timer = _Counting(P, net, inp.compute, inp.sc.cluster.engine)
    for cfg, policy in pl._plan_runs(inp, inp.configs):
        pl._simulate(inp, cfg, P, net, timer, policy)
    return timer.misses


@pytest.mark.parametrize("network", ["dgx-h100", "gtopk-icdcs"])
def test_dry_pass_asks_for_exactly_the_serial_collectives(network):
    """The hybrid optimiser's choice depends on the times, but what it asks for does not: the dry pass's keys are
    the serial run's misses, the same set and the same first-asked order."""
    inp = _plan(network=network, P="256")
    keys = pl.plan_collective_keys(inp, 256)
    assert len(keys) == len(set(keys)) > 100
    assert keys == _serial_misses(inp, 256)


def test_dry_pass_leaves_out_horovod_only():
    inp = _plan(model="resnet20-cifar", network="10GbE", P="16", densities="0.01",
                overrides=["workload.dense_policy='horovod'"])
    keys, misses = pl.plan_collective_keys(inp, 16), _serial_misses(inp, 16)
    assert set(keys) < set(misses)
    left = {spec.name for spec, _n in set(misses) - set(keys)}
    assert left and left <= {"dense", "powersgd"}  # the algorithms without k, under Horovod's fusion


def test_jobs_1_starts_no_process(monkeypatch, tmp_path):
    started = []

    class Spy(pl.ProcessPoolExecutor):
        def __init__(self, *a, **kw):
            started.append(kw.get("max_workers"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(pl, "ProcessPoolExecutor", Spy)
    inp = _plan(P="64")
    rows = pl.simulate_plan(inp, jobs=1)
    r = CliRunner().invoke(main, ["plan", "--model", "resnet20-cifar", "--network", "10GbE", "--P", "4",
                                  "--densities", "0.01", "--out", str(tmp_path / "p1"), "--quiet", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert started == []
    assert pl.simulate_plan(inp, jobs=3) == rows  # the spy does see a pool when jobs > 1
    assert started == [3]


def test_cli_jobs_writes_the_same_plan(tmp_path):
    args = ["plan", "--model", "resnet20-cifar", "--network", "10GbE", "--P", "4,8", "--densities", "0.01,0.1",
            "--quiet"]
    for j in ("1", "2"):
        r = CliRunner().invoke(main, args + ["--out", str(tmp_path / j), "--jobs", j])
        assert r.exit_code == 0, r.output
    assert (tmp_path / "1" / "plan.csv").read_bytes() == (tmp_path / "2" / "plan.csv").read_bytes()
    assert (tmp_path / "1" / "plan.md").read_bytes() == (tmp_path / "2" / "plan.md").read_bytes()


@pytest.mark.parametrize("jobs", ["0", "-1", "1025"])
def test_cli_jobs_out_of_range(jobs, tmp_path):
    r = CliRunner().invoke(main, ["plan", "--model", "resnet20-cifar", "--network", "10GbE", "--P", "4",
                                  "--out", str(tmp_path / "p"), "--jobs", jobs])
    assert r.exit_code == 2
    assert r.output.strip() == f"error: --jobs {jobs} is out of range: valid 1 <= jobs <= 1024 (1: the collectives " \
                               "are simulated in this process)"
    assert not (tmp_path / "p").exists()


def test_anchors_refuse_jobs(tmp_path):
    """--anchors fixes the papers' settings and runs serially: --jobs is refused like the other plan options."""
    r = CliRunner().invoke(main, ["plan", "--anchors", "--jobs", "2", "--out", str(tmp_path / "a")])
    assert r.exit_code == 2 and r.output.strip() == ("error: --jobs: --anchors runs the papers' settings, which fix "
                                                     "these: valid --anchors with --out, --force, --quiet only")


def test_jobs_checked_and_default():
    for bad in (0, 1025, True, 2.0, "2"):
        with pytest.raises(ConfigError, match="--jobs"):
            pl.check_plan_jobs(bad)
    assert pl.check_plan_jobs(1) == 1 and pl.check_plan_jobs(1024) == 1024
    from experiments.algorithm_pool import usable_cpus

    assert pl.default_jobs() == min(usable_cpus(), 8)


def _fail_gtopk(orig):
    def simulate(spec, numel, *ctx):
        if spec.name == "gtopk" and numel < 10_000:
            raise ConfigError(f"no collective for {spec.label} over {numel} elements: valid more")
        return orig(spec, numel, *ctx)

    return staticmethod(simulate)


def test_worker_error_is_the_serial_error(monkeypatch):
    """A collective whose simulation raises in a worker is simulated again by the serial pass, so the plan raises the
    serial run's error (same class, same message) after the same rows."""
    monkeypatch.setattr(CollectiveTimer, "simulate", _fail_gtopk(CollectiveTimer.simulate))  # forked workers see it
    inp = _plan(P="64")
    errors, rows = [], []
    for jobs in (1, 2):
        done = []
        with pytest.raises(ConfigError) as err:
            pl.simulate_plan(inp, jobs=jobs, on_row=lambda r, _w: done.append(r))
        errors.append((type(err.value), str(err.value)))
        rows.append(done)
    assert errors[0] == errors[1] and errors[0][1].startswith("no collective for gtopk")
    assert rows[0] == rows[1] and len(rows[0]) > 1


def test_interrupted_prefetch_leaves_no_worker(monkeypatch):
    """Ctrl-C while the workers run: the tasks not started are cancelled, the running ones waited for, and no worker
    process is left."""
    inp = _plan(P="256")
    net = inp.network_of(256)
    keys = pl.plan_collective_keys(inp, 256, net)
    calls = []

    def interrupted(pending, timeout=None, return_when=None):
        calls.append(len(pending))
        raise KeyboardInterrupt

    monkeypatch.setattr(pl, "futures_wait", interrupted)
    timer = CollectiveTimer(256, net, inp.compute, inp.sc.cluster.engine)
    with pytest.raises(KeyboardInterrupt):
        pl.prefetch_collectives(timer, keys, 2)
    assert calls == [len(keys)]
    assert multiprocessing.active_children() == []
    assert timer.missing(keys) == keys  # nothing half-filled


def test_timer_fill_and_missing_are_the_cache():
    inp = _plan(P="64")
    net = inp.network_of(64)
    keys = pl.plan_collective_keys(inp, 64, net)[:5]
    a = CollectiveTimer(64, net, inp.compute, inp.sc.cluster.engine)
    b = CollectiveTimer(64, net, inp.compute, inp.sc.cluster.engine)
    assert a.missing(keys + keys[:2]) == keys
    b.fill({k: CollectiveTimer.simulate(*k, *b.context()) for k in keys[:3]})
    assert b.missing(keys) == keys[3:]
    for spec, n in keys:
        assert (b(spec, n), b.wire_bytes(spec, n)) == (a(spec, n), a.wire_bytes(spec, n))
    b.fill({keys[0]: (-1.0, -1.0)})  # a cached key keeps its value
    assert b(*keys[0]) == a(*keys[0])


def test_the_default_jobs_prefetch_only_where_it_pays(monkeypatch, tmp_path):
    """Without --jobs (jobs None), a P below AUTO_PREFETCH_MIN_P on a fabric with no shared link (dgx-h100, a flat star)
    runs its collectives in the plan's process; P >= 2048 there, or any P on gtopk-icdcs (shared NICs and PCIe), gets
    the workers. An explicit --jobs is used as given. The rows are the same either way."""
    from sim.machine.network import NetworkSpec
    from sim.machine.topology import get_cluster_preset

    dgx, icdcs = get_cluster_preset("dgx-h100", 64), get_cluster_preset("gtopk-icdcs", 64)
    star = NetworkSpec.from_alpha_beta(1e-5, 1e-9)
    assert pl.prefetch_jobs(None, 64, dgx) == 1 and pl.prefetch_jobs(None, 1024, star) == 1
    assert pl.prefetch_jobs(None, 2048, get_cluster_preset("dgx-h100", 2048)) == pl.default_jobs()
    assert pl.prefetch_jobs(None, 64, icdcs) == pl.default_jobs()
    assert pl.prefetch_jobs(2, 64, dgx) == 2 and pl.prefetch_jobs(1, 4096, icdcs) == 1
    info = []
    inp = _plan(P="64")
    assert pl.simulate_plan(inp, jobs=None, on_prefetch=info.append) == pl.simulate_plan(inp, jobs=1)
    assert info == []  # no prefetch at all: the serial path
    seen = []
    monkeypatch.setattr(pl, "simulate_plan", lambda inp, **kw: seen.append(kw) or [])
    monkeypatch.setattr(pl, "rank_rows", lambda rows: rows)
    for extra, jobs in (([], None), (["--jobs", "2"], 2)):
        CliRunner().invoke(main, ["plan", "--model", "resnet20-cifar", "--network", "10GbE", "--P", "4", "--densities",
                                  "0.01", "--out", str(tmp_path / f"p{len(seen)}"), "--quiet", *extra])
        assert seen and seen[-1]["jobs"] == jobs, seen

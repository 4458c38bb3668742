"""experiments.sweep.map_jobs: input order, inline/process/Dask paths, clear errors."""
import builtins

import pytest

from experiments.sweep import map_jobs, resolve_jobs
from sim.base.errors import ConfigError, SparsimError


def _slow_square(x, delay):
    import time

    time.sleep(delay)
    return x * x


ARGS = [(i, 0.05 * (5 - i)) for i in range(6)]  # later jobs finish first
WANT = [i * i for i in range(6)]


def test_inline_and_processes_keep_input_order():
    assert map_jobs(_slow_square, ARGS, jobs=1, progress=False) == WANT
    assert map_jobs(_slow_square, ARGS, jobs=3, progress=False) == WANT
    assert map_jobs(_slow_square, ARGS, progress=False) == WANT  # default: os.cpu_count() processes
    assert map_jobs(_slow_square, [], jobs=2, progress=False) == []


def test_bad_jobs_is_a_config_error():
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="--jobs"):
            map_jobs(_slow_square, ARGS, jobs=bad, progress=False)
    assert resolve_jobs(4) == 4 and resolve_jobs(None) >= 1


def test_missing_dask_is_one_clear_error(monkeypatch):
    real_import = builtins.__import__

    def no_dask(name, *a, **kw):
        if name == "dask" or name.startswith("dask."):
            raise ImportError(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_dask)
    with pytest.raises(SparsimError, match=r"pip install -e '\.\[experiments\]'"):
        map_jobs(_slow_square, ARGS, scheduler="tcp://127.0.0.1:1", progress=False)


def test_dask_scheduler_address():
    distributed = pytest.importorskip("dask.distributed")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cl:
        assert map_jobs(_slow_square, ARGS, scheduler=cl.scheduler_address, progress=False) == WANT


@pytest.mark.parametrize("address", ["garbage", "", "tcp://host:notaport"])
def test_a_malformed_scheduler_is_one_error_before_any_output(tmp_path, address):
    pytest.importorskip("dask.distributed")
    from click.testing import CliRunner

    from experiments.cli import main

    out = tmp_path / "d"
    r = CliRunner().invoke(main, ["experiment", "delta", "--quick", "--scheduler", address, "--out", str(out)])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "cannot connect to the Dask scheduler" in lines[0], r.stderr
    assert not out.exists() and not (tmp_path / "d.partial").exists()  # nothing prepared before the check


@pytest.mark.parametrize("address", ["garbage", "tcp://host:notaport"])
def test_a_malformed_scheduler_builds_no_client(monkeypatch, address):
    """A Client that raises on a malformed address is left half-built; its finalizer, run by a later garbage
    collection inside another client's start, deadlocked on the loop runner's lock (the full suite hung once in
    the test above). The address is now parsed first: no Client is ever constructed for it."""
    distributed = pytest.importorskip("dask.distributed")
    from experiments.sweep import resolve_jobs
    from sim.base.errors import SparsimError

    def no_client(*a, **k):
        raise AssertionError("a Client was constructed for a malformed address")

    monkeypatch.setattr(distributed, "Client", no_client)
    with pytest.raises(SparsimError, match="cannot connect to the Dask scheduler"):
        resolve_jobs(None, address)

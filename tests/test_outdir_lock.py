"""Two runs on one --out, and a disk that refuses writes (issue #13, case 4): one line, exit 2, nothing of
the other run touched, nothing that looks complete."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from filelock import FileLock

from experiments.cli import main
from experiments.outdir import lock_path

ROOT = Path(__file__).resolve().parents[1]


def test_two_runs_on_one_out_exactly_one_wins(tmp_path):
    out = tmp_path / "same"
    cmd = [sys.executable, "-m", "experiments.cli", "run", "--out", str(out), "--quiet",
           "--set", "training.iterations=150"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    res = [(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(r[0] for r in res)
    assert codes == [0, 2], res
    loser = [r for r in res if r[0] == 2][0]
    line = loser[2].strip()
    assert "\n" not in line and line.startswith("error: ") and "Traceback" not in line
    assert "another sparsim run is writing" in line or "exists and is not empty" in line
    # the winner's directory is complete and untouched: 3 algorithms x 151 rows
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 * 151
    assert not (tmp_path / "same.partial").exists()


def test_a_held_lock_stops_the_run_at_once(tmp_path):
    out = tmp_path / "r"
    held = FileLock(str(lock_path(out)), timeout=0, is_singleton=False)
    held.acquire()
    try:
        r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", "--set", "training.iterations=3"])
    finally:
        held.release()
    assert r.exit_code == 2
    assert r.output.strip().startswith("error: another sparsim run is writing") and "\n" not in r.output.strip()
    assert not out.exists() and not (tmp_path / "r.partial").exists()
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", "--set", "training.iterations=3"])
    assert r.exit_code == 0, r.output  # the lock is free again


def test_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import experiments.run as run_mod

    def full(path, rows, *rest):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(run_mod, "write_metrics", full)
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", "--set", "training.iterations=3"])
    assert r.exit_code == 2
    line = r.output.strip()
    assert "\n" not in line and "No space left on device" in line and "metrics.csv" in line
    assert not out.exists() and not (tmp_path / "r.partial").exists()


def test_partial_dir_resumes_only_the_same_settings(tmp_path):
    """An interrupted sweep's DIR.partial is kept for a sweep with the same resume key and emptied otherwise
    (a --quick sweep's runs, named by configuration only, must not stand in for the full sweep's)."""
    from experiments.outdir import MARKER, RESUME_KEY, partial_dir

    out = tmp_path / "x"
    tmp = partial_dir(out, fresh=False, resume_key="bounds quick=True")
    (tmp / "run_a").write_text("quick run")
    assert (partial_dir(out, fresh=False, resume_key="bounds quick=True") / "run_a").read_text() == "quick run"
    tmp = partial_dir(out, fresh=False, resume_key="bounds quick=False")
    assert not (tmp / "run_a").exists() and (tmp / MARKER).exists()
    assert (tmp / RESUME_KEY).read_text() == "bounds quick=False"
    (tmp / "run_b").write_text("full run")
    (tmp / RESUME_KEY).unlink()  # left by a version that wrote no key: not resumed either
    assert not (partial_dir(out, fresh=False, resume_key="bounds quick=False") / "run_b").exists()

"""Byte identity of the user-facing numbers across refactorings: the default scenario's metrics.csv, a workload
run's metrics.csv and trace.json, a network ([model]) run's metrics.csv, and two ``sparsim predict --simulate``
tables, each hashed (sha256) and compared with tests/fixtures/identity.json.

A change that moves code must leave every hash as it is. A change that means to alter a number regenerates the
file with ``SPARSIM_UPDATE_IDENTITY=1 python -m pytest tests/test_identity.py`` and says why in its commit. The
predict tables drop the ``wall s`` column (this machine's seconds); everything else is compared byte for byte.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "identity.json"
SCEN = ROOT / "experiments" / "scenarios"

# name -> (sparsim arguments, what to hash: a file of the --out directory, or "stdout")
CASES = {
    "default_metrics": (["run", "--out", "{out}"], "metrics.csv"),
    "workload_metrics": (["run", str(SCEN / "resnet50-1gbe.toml"), "--out", "{out}"], "metrics.csv"),
    "workload_trace": (["run", str(SCEN / "resnet50-1gbe.toml"), "--out", "{out}"], "trace.json"),
    "net_metrics": (["run", str(SCEN / "fmnist-resnet20-gtopk-icdcs.toml"), "--set", "training.iterations=3",
                     "--set", "model.name=lenet5", "--out", "{out}"], "metrics.csv"),
    "predict_flat": (["predict", "--simulate", "--P", "4,16,64", "--d", "1000000"], "stdout"),
    "predict_cluster": (["predict", "--simulate", "--network", "dgx-h100", "--P", "8,64", "--d", "1000000"], "stdout"),
}


def _without_wall(text: str) -> str:
    """A predict table without its last column (``wall s``, this machine's seconds) on the rows that have it."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if line.rstrip().endswith("wall s") or (parts and parts[0].isdigit()):
            line = line.rstrip().rsplit(None, 1)[0] if len(parts) > 1 else line
        out.append(line)
    return "\n".join(out)


def _digest(name: str, tmp_path: Path) -> str:
    args, what = CASES[name]
    out = tmp_path / name
    argv = [a.format(out=out) for a in args]
    proc = subprocess.run([sys.executable, "-m", "experiments.cli", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = _without_wall(proc.stdout).encode() if what == "stdout" else (out / what).read_bytes()
    return hashlib.sha256(data).hexdigest()


def _stored() -> dict:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


@pytest.mark.parametrize("name", list(CASES))
def test_numbers_are_byte_identical(name, tmp_path):
    got = _digest(name, tmp_path)
    if os.environ.get("SPARSIM_UPDATE_IDENTITY") == "1":
        stored = _stored()
        stored[name] = got
        FIXTURE.write_text(json.dumps(dict(sorted(stored.items())), indent=1) + "\n")
        return
    want = _stored().get(name)
    assert want is not None, f"{name}: no stored hash in {FIXTURE} (SPARSIM_UPDATE_IDENTITY=1 writes it)"
    assert got == want, f"{name}: sha256 {got} differs from the stored {want}: a number changed"

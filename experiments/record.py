"""The records every run directory shares, whatever the run kind (:mod:`experiments.run`'s numerics on the
simulator or on torch, :mod:`experiments.workload_run`'s timeline):

- ``metrics.csv`` (:func:`write_metrics`, read back by :func:`read_metrics`): one row per (algorithm,
  iteration), columns :data:`sim.engine.runner.METRIC_COLUMNS`, every row carrying the run's :func:`run_id`;
- summary.json's ``versions`` (:func:`versions`) and ``provenance`` (:func:`provenance`, with the layout's
  :data:`SUMMARY_SCHEMA_VERSION`).

Nothing here runs anything: it records rows computed elsewhere.
"""
from __future__ import annotations

import csv
import json
import math
import platform
from importlib import metadata
from pathlib import Path

from sim.base.errors import ConfigError
from sim.engine.runner import METRIC_COLUMNS

from .outdir import write_csv
from .scenario import Scenario, used_keys_dump

__all__ = ["SUMMARY_SCHEMA_VERSION", "run_id", "provenance", "versions", "write_metrics", "read_metrics"]


def run_id(sc: Scenario, backend: str = "sim") -> str:
    """A run's identity in metrics.csv's ``run_id`` column: the first 16 hex digits of the sha256 of the keys the
    run uses (:func:`experiments.scenario.used_keys_dump`, canonical JSON) and the backend, so rows of different
    runs concatenated stay apart, the same scenario gives the same id on every machine, and a key added for
    another kind of run does not change this one's id. training.dtype, momentum and weight_decay and the
    [algorithm] table enter only when set away from their defaults."""
    import hashlib

    dump = used_keys_dump(sc, backend if backend in ("sim", "torch") else "sim")
    # keys added after a run kind existed enter only when set away from their default, so old ids stay valid
    for table, key, default in (("training", "dtype", "float64"), ("training", "momentum", 0.0),
                                ("training", "weight_decay", 0.0), ("torch", "select_device", "auto")):
        if dump.get(table, {}).get(key, default) == default:
            dump.get(table, {}).pop(key, None)
    if not dump.get("algorithm", True):
        del dump["algorithm"]
    tr = dump.get("training", {})
    if "schedule" in tr:  # the schedule's unused step keys (at their defaults: others are refused) entered the old ids
        for key in ("lr", "theta", "inverse_a"):
            tr.setdefault(key, getattr(sc.training, key))
    text = json.dumps({"scenario": dump, "backend": backend}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def provenance() -> dict:
    """summary.json's ``provenance``: the command line, the UTC time the run finished, the git revision of the
    code (None outside a git checkout) and the summary's schema version."""
    import datetime
    import subprocess
    import sys

    rev = None
    try:
        here = Path(__file__).resolve().parent.parent
        if (here / ".git").exists():
            rev = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                 timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {"command": " ".join(sys.argv), "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "git_revision": rev, "schema_version": SUMMARY_SCHEMA_VERSION}


#: Version of summary.json's layout (2: provenance, metrics_csv checksum, run_id column).
SUMMARY_SCHEMA_VERSION = 2


def write_metrics(path: Path, rows: list[dict], rid: str | None = None) -> None:
    """Write rows to CSV with the :data:`METRIC_COLUMNS` header; floats in repr (round-trip) form, nan/None empty.
    rid: the run's :func:`run_id`, written in every row's ``run_id`` column (rows keep any they already have)."""
    if rid is not None:
        for r in rows:
            r.setdefault("run_id", rid)
    write_csv(path, METRIC_COLUMNS, rows)


def _num(s: str) -> float:
    return math.nan if s == "" else float(s)


def read_metrics(run_dir: Path) -> dict[str, list[dict]]:
    """metrics.csv of a run, grouped by algorithm, numbers parsed (empty -> nan; algorithm and run_id stay text).
    Raises ConfigError if missing."""
    p = Path(run_dir) / "metrics.csv"
    if not p.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a finished run directory: {p.name} is missing")
    out: dict[str, list[dict]] = {}
    with open(p, newline="") as fh:
        for r in csv.DictReader(fh):
            row = {k: (r[k] if k in ("algorithm", "run_id") else _num(r[k])) for k in r}
            out.setdefault(r["algorithm"], []).append(row)
    return out


def versions() -> dict:
    """summary.json's ``versions``: the Python version and the installed version of sparsim and of each package
    whose code makes its numbers (numpy, scipy, simpy, sympy, scikit-learn, matplotlib); None for one not
    installed."""
    out = {"python": platform.python_version()}
    for pkg in ("sparsim", "numpy", "scipy", "simpy", "sympy", "scikit-learn", "matplotlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out

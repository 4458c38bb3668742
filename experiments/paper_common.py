"""Shared machinery of the paper experiments ``delta``, ``compression`` and ``memsgd``.

Each experiment is a list of independent *jobs* (one algorithm run each). A job's metrics rows are
cached in ``DIR.partial/runs/<job name>/metrics.csv`` (written to a temporary file and renamed, so a
file that exists is complete): a re-run after an interruption reuses every finished job. Jobs run in
parallel through :func:`experiments.sweep.map_jobs` (all local cores by default, or a Dask cluster). The experiments use the
lock-step driver (numerics only): their figures are against iterations or bits, not simulated time,
and the lock-step driver computes the same numbers as the SimPy cluster (tests/test_algorithms.py).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


__all__ = ["cached_run"]


def cached_run(run_dir: Path, compute: Callable[[], list[dict]]) -> list[dict]:
    """Metrics rows of one run: read ``run_dir/metrics.csv`` if it exists, else ``compute()`` and write it.

    Rows are dicts with :data:`sim.engine.runner.METRIC_COLUMNS`; read back with empty cells as nan. The file
    is written atomically (temporary file + rename), so an existing file is always complete.
    """
    from .record import read_metrics, write_metrics

    run_dir = Path(run_dir)
    path = run_dir / "metrics.csv"
    if path.is_file():
        groups = read_metrics(run_dir)
        return [r for rows in groups.values() for r in rows]
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # several runs share the cores: one BLAS thread each
        rows = compute()
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix="metrics.csv.")
    os.close(fd)
    write_metrics(Path(tmp), rows)
    os.replace(tmp, path)
    return rows

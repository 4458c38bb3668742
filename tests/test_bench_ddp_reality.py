"""Smoke test of benchmarks/bench_ddp_reality.py: one tiny case (P = 2, the MLP, one bucket cap, dense and
gTop-k hook) through the benchmark's core function, on a fixed network. Checks the CSV's columns and
that the times are finite and positive; asserts nothing about speed or the prediction error."""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def test_quick_case_writes_finite_positive_rows(tmp_path):
    sys.path.insert(0, str(BENCH))  # spawned ranks inherit sys.path, so they import the module by name too
    try:
        import bench_ddp_reality as b
    finally:
        sys.path.remove(str(BENCH))
    out = tmp_path / "ddp_reality.csv"
    # a fixed network (alpha 50 us, 1 GB/s) instead of the calibration, which the benchmark runs once per run
    rows, probes = b.run(["mlp"], [2], [25.0], b.ALGORITHMS, warmup=2, iters=2, profile_iters=2,
                         alpha_beta=(5e-5, 1e-9), csv_path=out, probe=True, timeout_s=60.0, log=lambda *a: None)
    with out.open() as fh:
        got = list(csv.DictReader(fh))
    assert list(got[0]) == b.CSV_COLUMNS
    assert [(r["model"], r["P"], r["bucket_cap_mb"], r["algorithm"]) for r in got] == \
        [("mlp", "2", "25.0", "dense"), ("mlp", "2", "25.0", "gtopk")]
    for r in got:
        for col in ("measured_ms", "measured_mean_ms", "measured_profiled_ms", "predicted_ms",
                    "predicted_overlapped_ms", "layer_compute_ms", "forward_ms", "backward_ms", "update_ms",
                    "predicted_comm_ms", "alpha_s", "beta_s_per_byte"):
            v = float(r[col])
            assert math.isfinite(v) and v > 0, (r["algorithm"], col, r[col])
        assert math.isfinite(float(r["rel_error"]))
        assert int(r["buckets"]) >= 1 and int(r["d"]) == 2_176_010
        assert r["buckets_match_ddp"] == "True"  # the timeline's buckets are the ones DDP rebuilt
    assert float(got[1]["hook_local_ms"]) > 0  # the gTop-k hook's local work was measured
    assert float(got[0]["predicted_gloo_net_ms"]) > 0 and got[1]["predicted_gloo_net_ms"] == ""
    assert [n for n, _, _ in probes[0][1]] == b.PROBE_SIZES  # the gloo allreduce probe
    assert all(m > 0 and p > 0 for _, m, p in probes[0][1])
    assert "median |error|" in b.report(rows, probes)

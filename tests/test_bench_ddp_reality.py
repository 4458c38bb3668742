"""Smoke test of benchmarks/bench_ddp_reality.py: one tiny case (P = 2, the MLP, one bucket cap, dense and
gTop-k hook) through the benchmark's core function, on fixed networks (one per calibration). Checks the CSV's
columns, that each algorithm is predicted on its transport's calibration (dense: allreduce, gTop-k hook:
exchange) and that the times are finite and positive; asserts nothing about speed or the prediction error."""
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
    # fixed networks instead of the calibrations, which the benchmark runs before the cases
    nets = {"allreduce": (5e-5, 1e-9), "exchange": (1e-3, 3e-9)}
    rows, calibrations = b.run(["mlp"], [2], [25.0], b.ALGORITHMS, warmup=2, iters=2, profile_iters=2,
                               networks=nets, csv_path=out, timeout_s=60.0, log=lambda *a: None)
    assert calibrations == []
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
    # each algorithm on the calibration of the transport it uses; the other one as a diagnostic
    assert [(r["calibration"], float(r["alpha_s"])) for r in got] == [("allreduce", 5e-5), ("exchange", 1e-3)]
    assert all(float(r["predicted_other_calibration_ms"]) > 0 for r in got)
    # dense on the slower exchange network predicts more communication than on the allreduce one
    assert float(got[0]["predicted_other_calibration_ms"]) >= float(got[0]["predicted_ms"])
    text = b.report(rows, calibrations)
    assert "median |error|" in text and "dense on the exchange network instead" in text
    # the report's calibration table, from a calibration dict as run() returns it
    cal = [{"pattern": "exchange", "nproc": 2, "alpha_s": 1e-3, "beta_s_per_byte": 3e-9, "rms_rel_residual": 0.1,
            "points": [(4, 1e-3), (4000, 1.1e-3)]},
           {"pattern": "allreduce", "nproc": 2, "alpha_s": 5e-5, "beta_s_per_byte": 1e-9, "rms_rel_residual": 0.1,
            "points": [(4, 1e-4), (4000, 1.1e-4)]}]
    assert "allreduce-fit ring ms" in b.report(rows, cal)

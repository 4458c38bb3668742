"""``sparsim experiment bounds --quick``: results.csv rows, bound ordering, CI, figures, reuse, bad --out."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from click.testing import CliRunner

from experiments.bounds_sweep import confidence_interval
from experiments.cli import main


def _rows(path):
    with open(path / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_quick_bounds_sweep(tmp_path):
    out = tmp_path / "bounds"
    r = CliRunner().invoke(main, ["experiment", "bounds", "--quick", "--quiet", "--out", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "bounds.partial").exists()
    rows = _rows(out)
    # quick: digits softmax, c in {10, 100}, one B (P = 4, b = 4), two seeds, T = 30, topk and gtopk
    assert {(x["algorithm"], int(x["c"])) for x in rows} == {(a, c) for a in ("topk", "gtopk") for c in (10, 100)}
    assert len(rows) == 4
    for x in rows:
        assert x["objective"] == "softmax_digits"
        assert int(x["d"]) == 640 and int(x["k"]) == round(640 / int(x["c"]))
        assert int(x["B"]) == 16 and int(x["T"]) == 30 and int(x["seeds"]) == 2
        emp, lo, hi = float(x["empirical_mean"]), float(x["ci_low"]), float(x["ci_high"])
        bp, bc = float(x["bound_published"]), float(x["bound_corrected"])
        assert emp > 0 and lo <= emp <= hi
        assert bc >= bp > 0  # B > 1: the corrected M^2 step is larger than the published M^2/B
        assert (x["published_holds"] == "True") == (bp >= emp)
        assert (x["corrected_holds"] == "True") == (bc >= emp)
    for name in ("bounds.png", "bounds.pdf", "results.md"):
        assert (out / name).stat().st_size > 0
    assert "| softmax_digits |" in r.output
    # the printed answer follows from the rows: YES iff some configuration has the published bound below
    # the empirical value while the corrected one holds
    hits = sum(x["published_holds"] == "False" and x["corrected_holds"] == "True" for x in rows)
    assert (f"YES: in {hits} of 4 configurations" if hits else "NO: in none of 4 configurations") in r.output

    # an existing non-empty --out without --force: one-line error, exit code 2
    bad = CliRunner().invoke(main, ["experiment", "bounds", "--quick", "--quiet", "--out", str(out)])
    assert bad.exit_code == 2
    assert bad.output.strip().startswith("error:") and len(bad.output.strip().splitlines()) == 1


def test_confidence_interval_contains_mean():
    m, lo, hi = confidence_interval([1.0, 2.0, 4.0])
    assert lo < m < hi and abs(m - 7 / 3) < 1e-12
    assert confidence_interval([3.0, 3.0]) == (3.0, 3.0, 3.0)
    assert confidence_interval([5.0]) == (5.0, 5.0, 5.0)


def test_confidence_interval_of_a_non_negative_quantity_stops_at_zero():
    from scipy import stats

    x = [0.01, 0.02, 3.0]  # heavy-tailed, 3 seeds: the plain t-interval reaches below 0
    m, lo, hi = confidence_interval(x)
    t_lo, t_hi = stats.t.interval(0.95, 2, loc=np.mean(x), scale=stats.sem(x))
    assert lo == pytest.approx(t_lo) and lo < 0 and hi == pytest.approx(t_hi)
    m2, lo2, hi2 = confidence_interval(x, lower=0.0)
    assert (m2, lo2, hi2) == (m, 0.0, hi)

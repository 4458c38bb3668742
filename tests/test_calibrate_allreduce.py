"""``sparsim calibrate --pattern allreduce``: the fit of the simulator's ring allreduce to gloo's all_reduce.

The fit (:func:`experiments.calibrate.fit_ring_allreduce`) recovers alpha and beta exactly from times that the
simulator's closed form (:func:`sim.comm.costs.ring_allreduce_time`, 2(P-1) alpha + 2(P-1)/P n beta) generates,
sizes divisible by P or not; a real quick run on P = 2 (gloo, loopback) writes a valid ``[cluster]`` preset
with positive finite alpha and beta. Nothing is asserted about speed.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from sim.comm.costs import ring_allreduce_time


@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("alpha,beta", [(1.5e-4, 8.0e-10), (2e-3, 3.3e-9), (0.0, 1e-9)])
def test_fit_recovers_alpha_beta_of_the_closed_form(P, alpha, beta):
    from experiments.calibrate import fit_ring_allreduce, message_sizes

    elements = sorted({max(1, n // 4) for n in message_sizes(1, 1 << 24)}) + [1001, 4097]  # some not divisible by P
    pts = [(d, ring_allreduce_time(P, d, alpha, beta)) for d in elements]
    fit = fit_ring_allreduce(P, pts)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-9, abs=1e-15)
    assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-9)
    assert fit["rms_rel_residual"] < 1e-9 and fit["rms_abs_residual_s"] < 1e-12
    # the fitted network gives the measured times back through the simulator's own formula
    for d, t in pts:
        assert ring_allreduce_time(P, d, fit["alpha_s"], fit["beta_s_per_byte"]) == pytest.approx(t, rel=1e-9)


def test_fit_rejects_one_rank():
    from experiments.calibrate import fit_ring_allreduce
    from sim.base.errors import SparsimError

    with pytest.raises(SparsimError, match="P >= 2"):
        fit_ring_allreduce(1, [(10, 1e-3), (1000, 2e-3)])


def test_unknown_pattern_is_refused():
    pytest.importorskip("torch")
    from experiments.calibrate import calibrate
    from sim.base.errors import SparsimError

    with pytest.raises(SparsimError, match="allreduce"):
        calibrate(2, pattern="foo")


def test_quick_real_run_on_two_ranks_writes_a_preset(tmp_path):
    """A real run (gloo, loopback, P = 2), small: through the CLI, as a user would."""
    pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[torch]' (torch==2.13.0)")
    import tomllib

    from click.testing import CliRunner

    from experiments.cli import main
    from sim.machine.network import NetworkSpec

    out = tmp_path / "ar.toml"
    r = CliRunner().invoke(main, ["calibrate", "--pattern", "allreduce", "--nproc", "2", "--out", str(out),
                                  "--min-bytes", "4", "--max-bytes", "1000000", "--repeats", "3", "--timeout", "25"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "#   allreduce: alpha =" in text and "<- this preset" in text and "2 (P - 1) alpha" in text
    cl = tomllib.loads(text)["cluster"]
    assert cl["network"] == "custom" and cl["topology"] == "star"
    assert math.isfinite(cl["alpha_s"]) and cl["alpha_s"] > 0
    assert math.isfinite(cl["bandwidth_Bps"]) and cl["bandwidth_Bps"] > 0
    NetworkSpec.from_alpha_beta(cl["alpha_s"], 1.0 / cl["bandwidth_Bps"], cl["topology"])  # a valid network
    # one comment row per size, measured and fitted times positive
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("#   ") and ln.split()[1][:1].isdigit()]
    assert len(rows) >= 5 and all(float(x[2]) > 0 and float(x[3]) > 0 for x in rows)
    assert np.all(np.diff([int(x[1]) for x in rows]) > 0)

"""``sparsim experiment scaling --quick``: the ICDCS 2019 headline at P = 32 and the Top-k/dense crossover."""
from __future__ import annotations

import csv

import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.scaling import MODELS, crossover_closed_form, crossover_simulated
from sim.network import PRESETS

#: Stated tolerance: the simulated gTop-k/dense efficiency ratio of ResNet-50 at P = 32 lies within 20% of the
#: published 3.65x (simulated 3.16x, -14%: the model's dense ring is slower than measured at small P and
#: faster at P = 32, see README "Experiment: scaling").
RATIO_TOL = 0.20


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_quick_scaling(tmp_path):
    out = tmp_path / "scaling"
    r = CliRunner().invoke(main, ["experiment", "scaling", "--quick", "--quiet", "--out", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "scaling.partial").exists()
    for name in ("scaling.csv", "ratios.csv", "crossover.csv", "scaling.png", "scaling.pdf", "report.md"):
        assert (out / name).stat().st_size > 0
    rows = _csv(out / "scaling.csv")
    assert {int(x["P"]) for x in rows} == {4, 8, 16, 32} and {x["model"] for x in rows} == {"ResNet-50"}
    for x in rows:  # timing-only simulation = the sim.costs closed form of each collective
        assert abs(float(x["comm_rel_diff"])) < 1e-9
    eff = {(x["variant"], int(x["P"])): float(x["efficiency_pct"]) for x in rows}
    # headline: ordering at P = 32 and the gTop-k/dense ratio within the stated tolerance of the published 3.65x
    assert eff[("gtopk", 32)] > eff[("topk", 32)] > eff[("dense", 32)]
    ratios = {(x["kind"], x["quantity"], int(x["P"])): x for x in _csv(out / "ratios.csv")}
    head = ratios[("headline_ratio", "gtopk/dense", 32)]
    assert float(head["published"]) == MODELS["ResNet-50"].headline[0] == 3.65
    assert float(head["simulated"]) == pytest.approx(eff[("gtopk", 32)] / eff[("dense", 32)])
    assert abs(float(head["rel_error"])) <= RATIO_TOL
    # crossover (density 0.05 in the quick size): simulation = closed form
    (cx,) = _csv(out / "crossover.csv")
    assert cx["crossover_simulated"] == cx["crossover_closed_form"] == "21" and cx["agree"] == "True"
    assert "| ResNet-50 (32) | 32 |" in r.output and "Headline ratios" in r.output

    # re-run with --force reuses the finished cases left in DIR.partial; a non-empty --out without it is an error
    bad = CliRunner().invoke(main, ["experiment", "scaling", "--quick", "--quiet", "--out", str(out)])
    assert bad.exit_code == 2 and bad.output.strip().startswith("error:")
    assert len(bad.output.strip().splitlines()) == 1


def test_resume_reuses_finished_cases(tmp_path):
    """An interrupted run leaves DIR.partial/cases/*.json; the next run reads them instead of simulating."""
    import json

    from experiments.scaling import run_scaling, simulate_case

    out = tmp_path / "s"
    from experiments.outdir import MARKER

    cases = tmp_path / "s.partial" / "cases"
    cases.mkdir(parents=True)
    (tmp_path / "s.partial" / MARKER).write_text("")  # as partial_dir leaves it: an interrupted sparsim run
    row = {**simulate_case("ResNet-50", "dense", 4), "marker": "reused"}
    (cases / "ResNet-50_dense_P4_it1.json").write_text(json.dumps(row))
    run_scaling(out, quick=True, jobs=1, progress=False)
    assert json.loads((out / "cases" / "ResNet-50_dense_P4_it1.json").read_text())["marker"] == "reused"


def test_crossover_simulated_equals_closed_form_small():
    alpha, beta = PRESETS["1GbE"].end_to_end_alpha_beta()
    d, k = 1_000_000, 100_000  # density 0.1: Top-k's allgather overtakes the ring near P = 12
    cf = crossover_closed_form(d, k, alpha, beta)
    sim, evaluated = crossover_simulated(d, k, 16)
    assert cf is not None and cf <= 16 and sim == cf and (cf - 1 in evaluated or cf == 2)
    assert crossover_closed_form(270_000, 270, alpha, beta, p_max=4096) is None  # ResNet-20 at 0.001: never

"""Properties every registered algorithm must have (sim.algorithms.REGISTRY): its timing-only simulated time
equals its closed form on a contention-free network, the fast engine agrees with the message engine, every rank
ends a step with the same parameters, mass is accounted for, and no module outside sim/algorithms/ lists
algorithm names or dispatches on them. A new algorithm file is tested here without editing this file."""
import ast
import re
from pathlib import Path

import numpy as np
import pytest

from sim.algorithms import REGISTRY, AlgorithmSpec, get, resolve
from sim.workloads.data import shard_indices
from sim.base.errors import ConfigError
from sim.machine.network import PRESETS
from sim.workloads.objectives import make_objective
from sim.engine.runner import Workers, run_algorithm
from sim.engine.timing import closed_form_comm_s, simulate_timing

NET = PRESETS["1GbE"]
ALPHA, BETA = NET.end_to_end_alpha_beta()
ROOT = Path(__file__).resolve().parents[1]
#: collectives that need something a flat simulated network does not have (tested in their own files)
SPECIAL = ("backend_allreduce", "hierarchical")


def _flat_specs(k):
    """One spec per (algorithm, flat collective) at default options."""
    out = []
    for name, algo in REGISTRY.items():
        for coll in algo.collectives:
            if coll not in SPECIAL:
                out.append(AlgorithmSpec(name, k=k if algo.sparse else None, collective=coll))
    return out


@pytest.mark.parametrize("P", list(range(1, 17)) + [31, 32, 33])
def test_timing_only_time_equals_the_closed_form(P):
    d, k = 10_007, 37  # d not divisible by P
    for spec in _flat_specs(k):
        t = simulate_timing(spec, P, d, network=NET).iter_s[0]  # no compute model: the exchange alone
        assert t == pytest.approx(closed_form_comm_s(spec, P, d, ALPHA, BETA), rel=1e-12, abs=1e-15), spec


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8, 13, 32])
def test_fast_engine_equals_the_message_engine(P):
    d, k = 5_003, 29
    for spec in _flat_specs(k):
        msg = simulate_timing(spec, P, d, network=NET, engine="message")
        fast = simulate_timing(spec, P, d, network=NET, engine="fast")
        assert fast.iter_s[0] == pytest.approx(msg.iter_s[0], rel=1e-9), spec
        assert (fast.messages, fast.bytes) == (msg.messages, msg.bytes), spec


def _workers(P, seed=3):
    obj = make_objective("sines", d=24, n=48, seed=seed)
    return Workers(obj, shard_indices(obj.n, P, seed=seed), 4, seed), obj.x0(seed)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_every_rank_agrees_and_mass_is_accounted_for(P):
    w, x0 = _workers(P)
    for spec in _flat_specs(5) + [AlgorithmSpec(n, k=5 if a.sparse else None, segments=(4, 11, 9))
                                  for n, a in REGISTRY.items()]:
        seen = []
        rows = run_algorithm(spec, w, T=6, lr=lambda t: 0.05, x0=x0, driver="lockstep",
                             on_step=lambda t, outs: seen.append(outs))
        for outs in seen:
            for o in outs[1:]:
                assert np.array_equal(o.v, outs[0].v) and np.array_equal(o.update, outs[0].update), spec
        if not REGISTRY[spec.name].drops_mass(spec):
            assert max(r["mass_error"] for r in rows) <= 1e-12, spec
        # metrics.csv's selected_per_worker is the mean of what the workers sent, step by step
        assert rows[0]["selected_per_worker"] == 0.0
        for r, outs in zip(rows[1:], seen):
            assert r["selected_per_worker"] == sum(o.n_selected for o in outs) / P, spec
            if spec.name in ("topk", "gtopk") and spec.segments is None:
                assert r["selected_per_worker"] == 5  # k, the sines' accumulators have no exact zeros
            if spec.name == "dense":
                assert r["selected_per_worker"] == 24  # d


def test_gaussiank_reports_the_count_its_threshold_keeps():
    """Gaussian-k selects what its threshold keeps (about k, not exactly): the per-step count varies and is
    what metrics.csv reports."""
    w, x0 = _workers(4)
    rows = run_algorithm(AlgorithmSpec("gaussiank", k=5), w, T=12, lr=lambda t: 0.05, x0=x0, driver="lockstep")
    counts = [r["selected_per_worker"] for r in rows[1:]]
    assert all(0 < c <= 24 for c in counts) and len(set(counts)) > 1, counts


def test_single_segment_is_whole_model_selection():
    w, x0 = _workers(3)
    for name, algo in REGISTRY.items():
        a = AlgorithmSpec(name, k=5 if algo.sparse else None)
        b = AlgorithmSpec(name, k=5 if algo.sparse else None, segments=(24,))
        ra = run_algorithm(a, w, T=4, lr=lambda t: 0.05, x0=x0, driver="lockstep")
        rb = run_algorithm(b, w, T=4, lr=lambda t: 0.05, x0=x0, driver="lockstep")
        assert [r["loss"] for r in ra] == [r["loss"] for r in rb], name


def test_momentum_and_weight_decay_follow_their_definition():
    """u_t = m u_{t-1} + g_t / P, v_t = v_{t-1} - u_t, the decay added to the local gradient (dense, P = 2)."""
    w, x0 = _workers(2)
    m, wd, lr = 0.9, 0.01, 0.05
    plain, heavy = [], []
    run_algorithm(AlgorithmSpec("dense"), w, T=5, lr=lambda t: lr, x0=x0, driver="lockstep",
                  on_step=lambda t, outs: plain.append(outs))
    run_algorithm(AlgorithmSpec("dense", momentum=m, weight_decay=wd), w, T=5, lr=lambda t: lr, x0=x0,
                  driver="lockstep", on_step=lambda t, outs: heavy.append(outs))
    v, u = x0.copy(), np.zeros_like(x0)
    for outs in heavy:
        g = outs[0].update
        expect_g = sum(lr * (o.grad + wd * v) for o in outs)
        np.testing.assert_allclose(g, expect_g, rtol=1e-12, atol=1e-15)
        u = m * u + g / 2
        v = v - u
        np.testing.assert_allclose(outs[0].v, v, rtol=1e-12, atol=1e-15)
    assert not np.allclose(plain[-1][0].v, heavy[-1][0].v)


def test_bad_names_and_options_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"algorithm = 'nope' is unknown: valid algorithms are dense, topk"):
        AlgorithmSpec("nope")
    with pytest.raises(ConfigError, match="unknown: valid algorithms are"):
        resolve("nope")
    with pytest.raises(ConfigError, match="momentum = 1.0 is out of range"):
        AlgorithmSpec("dense", momentum=1.0)
    with pytest.raises(ConfigError, match="option 'rank' is unknown for topk"):
        AlgorithmSpec("topk", k=3, options=(("rank", 2),))
    assert resolve("gtopk_reference") == ("gtopk", {"mask": "reference"})
    assert get("gtopk") is REGISTRY["gtopk"]


# ------------------------------------------------------------------ the registry is the only list of algorithms

#: a line that legitimately names algorithms outside the registry says why with this marker
MARKER = "# algorithms:"


def _stray(path: Path) -> list[str]:
    names = set(REGISTRY) | {a for algo in REGISTRY.values() for a in algo.aliases}
    src = path.read_text()
    lines = src.splitlines()
    bad = []
    tree = ast.parse(src)
    skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)}  # function names
    for node in ast.walk(tree):
        hits = None
        if id(node) in skip:
            continue
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            lits = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
            if len(set(lits)) >= 2:
                hits = lits
        elif isinstance(node, ast.Dict):
            lits = [e.value for e in node.keys if isinstance(e, ast.Constant) and e.value in names]
            if len(set(lits)) >= 2:
                hits = lits
        elif isinstance(node, ast.Compare):
            consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant) and c.value in names]
            if consts and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                hits = [c.value for c in consts]
        if hits:
            span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
            if not any(MARKER in ln for ln in span) and not any(MARKER in ln for ln in lines[node.lineno - 2:node.lineno - 1]):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {sorted(set(hits))}")
    return bad


def test_no_algorithm_lists_or_dispatch_outside_the_registry():
    files = [p for d in ("sim", "experiments") for p in (ROOT / d).rglob("*.py")
             if "algorithms" not in p.relative_to(ROOT).parts[:2]]
    bad = [b for p in files for b in _stray(p)]
    assert not bad, "algorithm names listed or compared outside sim/algorithms/ (mark a deliberate " \
                    f"experiment choice with '{MARKER} why'):\n" + "\n".join(bad)


def test_the_stray_list_check_finds_a_list():
    p = ROOT / "tests" / "_stray_probe.py"
    try:
        p.write_text('X = ("dense", "topk")\nif name == "gtopk":\n    pass\nY = ("topk", "gtopk")  # algorithms: why\n')
        assert [re.sub(r".*:(\d+):.*", r"\1", b) for b in _stray(p)] == ["1", "2"]
    finally:
        p.unlink()


@pytest.mark.parametrize("sets, needle", [
    (["algorithm.powersgd.rank=0"], "powersgd.rank = 0 is out of range: valid 1 <= powersgd.rank"),
    (["algorithm.oktopk.tau=0"], "oktopk.tau = 0 is out of range: valid 1 <= oktopk.tau"),
    (['algorithm.dgc.warmup_densities="0.1, 0.5"'], "is not decreasing in density"),
    (["algorithm.dgc.warmup_densities=[0.1, 0.5]"], "dgc.warmup_densities = [0.1, 0.5] is not decreasing in density"),
    (["algorithm.dgc.nesterov=maybe"], "dgc.nesterov = 'maybe' is not a switch: valid on, off, true, false, 1, 0"),
    (["algorithm.nope.x=1"], "algorithm = 'nope' is unknown: valid algorithms are dense, topk, gtopk"),
    (["algorithm.powersgd.bogus=1"], "algorithm.powersgd.bogus is unknown: valid keys are collective, rank"),
    (["algorithm.topk.collective=tree"], "algorithm.topk.collective = 'tree' is unknown: valid allgather"),
    (["algorithm.powersgd=1"], "expected algorithm.NAME.KEY=value"),
])
def test_cli_bad_algorithm_options_are_one_line_exit_2(tmp_path, sets, needle):
    from click.testing import CliRunner

    from experiments.cli import main

    args = ["run", "--out", str(tmp_path / "r"), "--quiet", "--algorithms", "powersgd,oktopk,dgc"]
    for s in sets:
        args += ["--set", s]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and needle in r.output, r.output
    assert r.output.startswith("error:") and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_cli_algorithm_options_reach_the_spec(tmp_path):
    """--set algorithm.NAME.KEY and a TOML boolean reach AlgorithmSpec.options (the label shows PowerSGD's rank)."""
    import csv
    import json

    from click.testing import CliRunner

    from experiments.cli import main

    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", "--algorithms", "powersgd",
                                  "--set", "algorithm.powersgd.rank=2", "--set", "algorithm.powersgd.warm_start=false",
                                  "--set", "training.iterations=3"])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert {row["algorithm"] for row in rows} == {AlgorithmSpec("powersgd", options=(("rank", 2),)).label}
    assert json.loads((out / "summary.json").read_text())["scenario"]["algorithm"] == {
        "powersgd": {"rank": 2, "warm_start": False}}
    # a TOML list for DGC's warm-up densities, and a TOML boolean for one of its on/off switches
    sc = tmp_path / "dgc.toml"
    sc.write_text('algorithms = ["dgc"]\n[training]\niterations = 3\nmomentum = 0.9\n'  # nesterov needs a momentum
                  '[algorithm.dgc]\nwarmup_iters = 1\nwarmup_densities = [0.25, 0.0625]\nnesterov = true\n')
    r = CliRunner().invoke(main, ["run", str(sc), "--out", str(tmp_path / "d"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["scenario"]["algorithm"] == {
        "dgc": {"warmup_iters": 1, "warmup_densities": [0.25, 0.0625], "nesterov": True}}

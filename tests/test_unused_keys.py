"""No key is silently ignored (issue #23, "Keys still silently ignored"): a key the run does not use is one line
``error: ...`` naming the key and the setting that would use it, exit code 2, no run directory; the same key in a
run that uses it still works. Keys shared between the backends follow the documented rule instead: a torch run
records the simulator's network and compute keys as ``backend.unused_keys`` in summary.json (docs/scenarios.md).

The compute cost keys follow the algorithms' :attr:`sim.algorithms.Algorithm.cost_kinds`, which the last tests here
hold against what each algorithm's numerics charge."""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
from click.testing import CliRunner

from experiments.cli import main
from experiments.scenario import Scenario, load_scenario, used_keys_dump
from sim.base.errors import ConfigError

QUICK = ["--set", "training.iterations=2"]
R50 = "experiments/scenarios/resnet50-1gbe.toml"


def _bad(tmp_path, args, *needles):
    """``sparsim run ARGS`` exits 2 with one line on stderr holding every needle and leaves no directory."""
    out = tmp_path / "bad"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        r = CliRunner().invoke(main, ["run", "--out", str(out), "--quiet", *args])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists() and not (tmp_path / "bad.partial").exists()
    return lines[0]


def _sets(*kv):
    return [x for s in kv for x in ("--set", s)]


# (the key alone: --set overrides, the key and the setting the error names) and (the same key where it is used)
CASES = {
    "jitter_scale without jitter": (
        ["compute.jitter_scale=0.5"], ("compute.jitter_scale", "compute.jitter = 'lognormal' or 'exponential'"),
        ["compute.jitter_scale=0.5", "compute.jitter='lognormal'"]),
    "straggler_factor without stragglers": (
        ["compute.straggler_factor=3.0"], ("compute.straggler_factor", "compute.straggler_prob > 0"),
        ["compute.straggler_factor=3.0", "compute.straggler_prob=0.25"]),
    "gtopk_collective with only dense": (
        ["algorithms=dense", "compression.gtopk_collective='recursive_doubling'"],
        ("compression.gtopk_collective", "used only with gtopk among the algorithms"),
        ["algorithms=gtopk", "compression.gtopk_collective='recursive_doubling'"]),
    "gtopk_mask with only dense": (
        ["algorithms=dense", "compression.gtopk_mask='reference'"],
        ("compression.gtopk_mask", "used only with gtopk among the algorithms"),
        ["algorithms=dense,gtopk", "compression.gtopk_mask='reference'"]),
    "gtopk_mask with only gtopk_reference (its preset fixes the mask)": (
        ["algorithms=gtopk_reference", "compression.gtopk_mask='reference'"],
        ("compression.gtopk_mask", "gtopk_reference fixes its own mask"),
        ["algorithms=gtopk_reference,gtopk", "compression.gtopk_mask='reference'"]),
    "index_bytes with only dense": (
        ["algorithms=dense", "compression.index_bytes=8"],
        ("compression.index_bytes", "used only with an algorithm that selects k coordinates", "topk, gtopk"),
        ["algorithms=dense,topk", "compression.index_bytes=8"]),
    "density with only dense": (
        ["algorithms=dense", "compression.density=0.1"],
        ("compression.density", "used only with an algorithm that selects k coordinates"),
        ["algorithms=topk", "compression.density=0.1"]),
    "k with only powersgd": (
        ["algorithms=powersgd", "compression.k=5"],
        ("compression.k", "used only with an algorithm that selects k coordinates", "here algorithms = powersgd"),
        ["algorithms=powersgd,randk", "compression.k=5"]),
    "layer_sizes with only dense": (
        ["algorithms=dense", "compression.layer_sizes=[320, 320]"],
        ("compression.layer_sizes", "used only with an algorithm that exchanges per layer", "topk, gtopk"),
        ["algorithms=dense,topk", "compression.layer_sizes=[320, 320]"]),
    "merge_coeff_s with only dense": (
        ["algorithms=dense", "compute.merge_coeff_s=1e-9"],
        ("compute.merge_coeff_s = 1e-09", "no algorithm of this run charges a merge", "used only with gtopk"),
        ["algorithms=dense,gtopk", "compute.merge_coeff_s=1e-9"]),
    "select_coeff_s with only dense": (
        ["algorithms=dense", "compute.select_coeff_s=1e-9"],
        ("compute.select_coeff_s = 1e-09", "charges a select", "used only with topk, gtopk"),
        ["algorithms=topk", "compute.select_coeff_s=1e-9"]),
    "reduce_coeff_s with only gtopk": (  # the case was Top-k, whose allgathered sum is now charged a reduce
        ["algorithms=gtopk", "compute.reduce_coeff_s=1e-9"],
        ("compute.reduce_coeff_s = 1e-09", "charges a reduce", "used only with dense, topk"),
        ["algorithms=topk", "compute.reduce_coeff_s=1e-9"]),
    "density together with k": (
        ["compression.k=5", "compression.density=0.1"],
        ("compression.density = 0.1", "unused when compression.k is set"),
        ["compression.density=0.1"]),
    "topk_collective when only gtopk runs": (
        ["algorithms=gtopk", "compression.topk_collective='hierarchical'"],
        ("compression.topk_collective", "used only with topk or randk or gaussiank among the algorithms"),
        ["algorithms=topk", "compression.topk_collective='hierarchical'", "cluster.network='hierarchical'",
         "cluster.gpus_per_node=2"]),
    "topk_collective when [algorithm.topk] collective overrides it": (
        ["algorithms=topk", "compression.topk_collective='hierarchical'", "algorithm.topk.collective='allgather'"],
        ("compression.topk_collective", "[algorithm.topk] collective overrides it"),
        ["algorithms=topk,randk", "compression.topk_collective='hierarchical'", "algorithm.topk.collective='allgather'",
         "cluster.network='hierarchical'", "cluster.gpus_per_node=2"]),
    "[algorithm.powersgd] when powersgd does not run": (
        ["algorithm.powersgd.rank=2"],
        ("algorithm.powersgd.rank", "[algorithm.powersgd] is used only with powersgd among the algorithms"),
        ["algorithms=dense,powersgd", "algorithm.powersgd.rank=2"]),
    "[algorithm.gtopk] collective when neither gtopk nor its alias runs": (
        ["algorithms=topk", "algorithm.gtopk.collective='recursive_doubling'"],
        ("algorithm.gtopk.collective", "used only with gtopk or gtopk_reference"),
        ["algorithms=gtopk_reference", "algorithm.gtopk.collective='recursive_doubling'"]),
    "dgc sample_ratio with exact selection": (
        ["algorithms=dgc", "algorithm.dgc.selection='exact'", "algorithm.dgc.sample_ratio=0.5"],
        ("algorithm.dgc.sample_ratio = 0.5", "selection = 'sampled'"),
        ["algorithms=dgc", "algorithm.dgc.sample_ratio=0.5"]),
    "dgc resample with exact selection": (
        ["algorithms=dgc", "algorithm.dgc.selection='exact'", "algorithm.dgc.resample='off'"],
        ("algorithm.dgc.resample = 'off'", "selection = 'sampled'"),
        ["algorithms=dgc", "algorithm.dgc.resample='off'"]),
    "dgc warmup_densities without warm-up iterations": (
        ["algorithms=dgc", "algorithm.dgc.warmup_densities=[0.5, 0.1]"],
        ("algorithm.dgc.warmup_densities = [0.5, 0.1]", "used only with warmup_iters >= 1"),
        ["algorithms=dgc", "algorithm.dgc.warmup_densities=[0.5, 0.1]", "algorithm.dgc.warmup_iters=1"]),
    "dgc adaptation bounds with a whole-segment sample": (
        ["algorithms=dgc", "algorithm.dgc.sample_ratio=1.0", "algorithm.dgc.compress_upper_bound=2.0"],
        ("algorithm.dgc.compress_upper_bound = 2.0", "used only with sample_ratio < 1"),
        ["algorithms=dgc", "algorithm.dgc.sample_ratio=0.5", "algorithm.dgc.compress_upper_bound=2.0"]),
    "dgc nesterov without momentum": (
        ["algorithms=dgc", "algorithm.dgc.nesterov=true"],
        ("algorithm.dgc.nesterov = True", "used only with training.momentum > 0"),
        ["algorithms=dgc", "algorithm.dgc.nesterov=true", "training.momentum=0.9"]),
    "powersgd start_iter >= iterations": (
        ["algorithms=powersgd", "training.iterations=2", "algorithm.powersgd.start_iter=2"],
        ("algorithm.powersgd.start_iter = 2", "a dense run labelled powersgd", "valid start_iter < training.iterations = 2"),
        ["algorithms=powersgd", "training.iterations=2", "algorithm.powersgd.start_iter=1"]),
    "hook_blocks_backward with dense_policy = none": (
        ["algorithms=dense", "workload.dense_policy='none'", "workload.hook_blocks_backward=true"],
        ("workload.hook_blocks_backward = true", "dense_policy = 'ddp' and a dense algorithm"),
        ["algorithms=dense", "workload.dense_policy='ddp'", "workload.hook_blocks_backward=true"]),
    "hook_blocks_backward with whole-model selection": (
        ["algorithms=gtopk", "workload.hook_blocks_backward=true"],
        ("workload.hook_blocks_backward = true", "sparse_policy = 'bucket', 'layer' or 'hybrid'"),
        ["algorithms=gtopk", "workload.sparse_policy='bucket'", "workload.hook_blocks_backward=true"]),
}
WORKLOAD = {"hook_blocks_backward with dense_policy = none", "hook_blocks_backward with whole-model selection"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_key_the_run_does_not_use_is_one_line_naming_the_setting_that_would(tmp_path, case):
    alone, needles, used = CASES[case]
    wl = ["workload.model='resnet20-cifar'"] if case in WORKLOAD else []
    line = _bad(tmp_path, _sets(*wl, *alone), *needles)
    # the line blames the --set that gave the key, not the scenario file
    assert line.startswith("error: --set "), line
    # the same key where the run uses it is accepted
    assert isinstance(load_scenario(None, [*wl, *used]), Scenario)


@pytest.mark.parametrize("case", ["density with only dense", "reduce_coeff_s with only gtopk", "dgc nesterov without momentum",
                                  "powersgd start_iter >= iterations", "[algorithm.powersgd] when powersgd does not run"])
def test_the_same_key_where_it_is_used_still_runs(tmp_path, case):
    _, _, used = CASES[case]
    r = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "r"), "--quiet", *QUICK, *_sets(*used)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "r" / "summary.json").is_file()


def test_reduce_coeff_s_prices_the_top_k_sum():
    """Top-k's reduce key is used (the issue's case predates it): it adds reduce_coeff_s x P k per step."""
    from experiments.algorithm_pool import run_algorithms
    from experiments.build import build

    times = []
    for extra in ([], ["compute.reduce_coeff_s=1e-3"]):
        sc = load_scenario(None, ["algorithms=topk", "training.iterations=2", *extra])
        b = build(sc)
        times.append(run_algorithms(b.specs, b, T=2, eval_every=1)[0][-1]["sim_time_s"])
    P, k = 8, 6  # digits softmax: d = 640, k = round(0.01 x 640)
    assert times[1] - times[0] == pytest.approx(2 * 1e-3 * P * k, rel=1e-9)


def test_an_algorithm_table_at_its_defaults_is_not_a_use():
    """As every other key: a value equal to the default changes nothing, so it is accepted wherever it stands."""
    load_scenario(None, ["algorithm.powersgd.rank=1", "algorithm.dgc.selection='sampled'"])
    load_scenario(None, ["algorithms=dgc", "algorithm.dgc.selection='exact'", "algorithm.dgc.sample_ratio=0.01"])


# ------------------------------------------------------------------ a summary.json reloads

@pytest.mark.parametrize("sets, path", [
    (["algorithms=dense"], None),
    (["algorithms=gtopk"], None),
    (["algorithms=powersgd", "algorithm.powersgd.rank=2"], None),
    (["algorithms=dense", "workload.model='resnet50'", "workload.device='H100'"], None),
    (["algorithms=topk", "workload.device='V100'"], R50),
])
def test_the_recorded_scenario_reloads_to_the_same_run(sets, path):
    """summary.json records the cost keys at the values the run used, also those no algorithm charges (the run id
    hashes them): such a value is the one the key takes unset, so reloading it is no error and gives the same id."""
    from experiments.record import run_id

    sc = load_scenario(path, sets)
    again = Scenario.model_validate(json.loads(json.dumps(used_keys_dump(sc))))
    assert run_id(again) == run_id(sc)
    assert used_keys_dump(again) == used_keys_dump(sc)


def test_a_cost_key_at_another_value_than_the_unset_one_is_refused_even_close_to_it():
    load_scenario(None, ["algorithms=dense", "compute.select_coeff_s=2.19e-10"])  # the papers' value: what unset gives
    with pytest.raises(ConfigError, match="compute.select_coeff_s = 2.2e-10"):
        load_scenario(None, ["algorithms=dense", "compute.select_coeff_s=2.2e-10"])


# ------------------------------------------------------------------ the backends

@pytest.mark.parametrize("sets, needle", [
    (["torch.timeout_s=5"], "torch.timeout_s (--timeout): used only with --backend torch"),
    (["torch.stall_timeout_s=5"], "torch.stall_timeout_s: used only with --backend torch"),
    (["torch.select_device='cpu'"], "torch.select_device: used only with --backend torch"),
    (["torch.dist_backend='auto'"], "torch.dist_backend (--dist-backend): used only with --backend torch"),
])
def test_torch_keys_on_the_simulator_are_one_line(tmp_path, sets, needle):
    _bad(tmp_path, _sets(*sets), needle)


def test_torch_keys_in_a_workload_run_are_one_line(tmp_path):
    _bad(tmp_path, [R50, *_sets("torch.timeout_s=5")], "torch.timeout_s (--timeout): used only with --backend torch")


def test_torch_run_records_the_simulators_keys_as_unused():
    from experiments.torch_job import torch_backend_info, torch_unused_keys

    sc = load_scenario(None, ["cluster.network='custom'", "cluster.alpha_s=1e-5", "compute.jitter='lognormal'",
                              "compute.jitter_scale=0.2", "cluster.engine='message'"])
    unused = torch_unused_keys(sc)
    dump = used_keys_dump(sc, "torch")
    assert set(unused) == {f"cluster.{k}" for k in dump["cluster"] if k != "P"} | {f"compute.{k}" for k in dump["compute"]}
    assert unused["cluster.alpha_s"] == 1e-5 and unused["compute.jitter_scale"] == 0.2
    info = torch_backend_info(sc, 8, launcher="sparsim run")
    assert info["unused_keys"] == unused and "measures its own network and compute" in info["unused_why"]
    # a hierarchical collective takes its ranks per node from the cluster: those keys are used
    hier = load_scenario(None, ["cluster.network='hierarchical'", "cluster.gpus_per_node=2",
                                "compression.topk_collective='hierarchical'"])
    assert "cluster.network" not in torch_unused_keys(hier) and "cluster.gpus_per_node" not in torch_unused_keys(hier)
    assert "cluster.alpha_s" in torch_unused_keys(hier)
    # a [model] run with a time budget runs the simulator's iterations, timed on that network and compute model
    net = load_scenario("experiments/scenarios/fmnist-resnet20-gtopk-icdcs.toml", ["training.time_budget_s=5.0"])
    assert torch_unused_keys(net) == {}
    no_budget = torch_unused_keys(load_scenario("experiments/scenarios/fmnist-resnet20-gtopk-icdcs.toml"))
    assert no_budget["cluster.network"] == "gtopk-icdcs" and no_budget["workload.device"] == "P102-100"


def test_torch_run_warns_about_the_simulators_keys_it_was_given(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "t"
    r = CliRunner().invoke(main, ["run", "--backend", "torch", "--nproc", "2", "--out", str(out), "--quiet",
                                  "--algorithms", "dense", *_sets("training.iterations=2", "cluster.network='10GbE'",
                                                                  "compute.forward_backward_s=0.5")])
    assert r.exit_code == 0, r.output
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("WARNING:")]
    assert warn == ["WARNING: cluster.network, compute.forward_backward_s: unused by --backend torch, which measures "
                    "its own network and compute; recorded in summary.json as backend.unused_keys"]
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"]["unused_keys"]["cluster.network"] == s["scenario"]["cluster"]["network"] == "10GbE"
    assert s["backend"]["unused_keys"]["compute.forward_backward_s"] == 0.5


# ------------------------------------------------------------------ cost_kinds against what the numerics charge

def _charged(name, coll, network):
    """The compute kinds (select, merge, reduce, scan, matmul) that change the simulated time of ``name`` at
    collective ``coll``: each coefficient set to 1e-3 s per unit in turn on the built run, bypassing the scenario's
    refusal."""
    from experiments.algorithm_pool import run_algorithms
    from experiments.build import build

    base = ["data.objective='double_well'", "data.d=200", "data.n=256", "training.iterations=3", "cluster.P=4",
            "training.batch_size=4", "training.lr=0.01", f"algorithms={name}", *network]
    if coll is not None:
        base.append(f"algorithm.{name}.collective='{coll}'")
    b = build(load_scenario(None, base))

    def sim_time(**kw):
        b.compute = dataclasses.replace(b.compute, **kw)
        return run_algorithms(b.specs, b, T=3, eval_every=1)[0][-1]["sim_time_s"]

    plain, model = sim_time(), b.compute
    out = set()
    for kind in ("select", "merge", "reduce", "scan", "matmul"):
        if sim_time(**{f"{kind}_coeff_s": 1e-3}) != plain:
            out.add(kind)
        b.compute = model
    return out


def _cases():
    from sim.algorithms import REGISTRY

    for name, algo in REGISTRY.items():
        for coll in algo.collectives:
            if coll == "backend_allreduce":  # the torch backend's allreduce: no simulated collective
                continue
            net = ["cluster.network='hierarchical'", "cluster.gpus_per_node=2"] if coll == "hierarchical" else []
            yield name, coll, net


@pytest.mark.parametrize("name, coll, net", list(_cases()))
def test_cost_kinds_hold_every_kind_the_numerics_charge(name, coll, net):
    """A key of a kind outside the declaration is refused: that kind must change nothing (and, for the declarations
    narrower than the default, every declared kind is charged, so the declaration is no wider than needed)."""
    from sim.algorithms import get

    algo = get(name)
    charged = _charged(name, coll, net)
    assert charged <= set(algo.cost_kinds), (name, coll, charged)
    if set(algo.cost_kinds) != {"select", "merge", "reduce"}:
        assert charged == set(algo.cost_kinds), (name, coll, charged)


@pytest.mark.parametrize("name, coll, net", list(_cases()))
def test_cost_kinds_hold_every_kind_the_timing_only_form_charges(name, coll, net):
    """The workload timeline and the fast engine time an exchange from :meth:`Algorithm.fast_rounds`: its Work kinds
    are declared too (a hybrid plan's dense buckets add the dense reduce, which the scenario adds itself)."""
    from sim.algorithms import AlgorithmSpec, get
    from sim.comm.rounds import Work

    algo = get(name)
    spec = AlgorithmSpec(name, k=50 if algo.sparse else None, collective=coll, gpus_per_node=2)
    kinds = {w.kind for w in algo.fast_rounds(spec, 8, 5000, 1, 2) if isinstance(w, Work)}
    assert kinds and kinds <= set(algo.cost_kinds), (name, coll, kinds)

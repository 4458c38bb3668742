"""A [model] run: scenario keys, the time-budget rule of the timeline clock, segments from buckets, and (with torch and
the Fashion-MNIST files) a whole run through the CLI."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from experiments.scenario import load_scenario
from sim.base.errors import ConfigError
from sim.engine.timeline import Bucket, TimelineClock, TimelineResult, flat_segments
from sim.workloads.model import LayerCost, ParamTensor, Workload

FMNIST = "/usr/share/datasets/fashion-mnist"
HAVE_DATA = os.path.isdir(FMNIST)
needs_data = pytest.mark.skipif(not HAVE_DATA and os.environ.get("CI") != "true",
                                reason="dataset-fashion-mnist not installed (CI installs it)")


def _res(iter_s):
    z = np.zeros(len(iter_s))
    return TimelineResult(np.asarray(iter_s, dtype=float), z, z, z, z, z, [], [], 0.0, [])


def _clock(budget):
    wl = Workload("w", (LayerCost("l", 1.0, 2.0),), (ParamTensor("t", 10, "l"),))
    return TimelineClock(wl, 1, None, None, None, 1, None, time_budget_s=budget)


def test_budget_keeps_iterations_whose_float_clock_is_within():
    # 0.1 + 0.2 = 0.30000000000000004 > 0.3: the second iteration ends a rounding step after a budget of 0.3
    assert _clock(0.3).iterations_within(_res([0.1, 0.2, 0.1])) == 1
    # an iteration ending exactly at the budget runs: 0.25 + 0.25 = 0.5 exactly
    assert _clock(0.5).iterations_within(_res([0.25, 0.25, 0.25])) == 2
    assert _clock(math.nextafter(0.5, 0)).iterations_within(_res([0.25, 0.25, 0.25])) == 1
    assert _clock(0.0).iterations_within(_res([0.25] * 7)) == 7  # no budget: every iteration
    assert _clock(0.1).iterations_within(_res([0.25, 0.25])) == 0


def test_budget_matches_cumsum_for_random_times():
    rng = np.random.default_rng(0)
    for _ in range(50):
        it = rng.uniform(1e-3, 1.0, size=20)
        budget = float(rng.uniform(0, it.sum()))
        n = _clock(budget).iterations_within(_res(it))
        clock = np.cumsum(it)
        assert (clock[:n] <= budget).all() and (n == len(it) or clock[n] > budget)


def test_flat_segments_orders_buckets_by_position_and_refuses_interleaving():
    layers = tuple(LayerCost(f"l{i}", 1.0, 2.0) for i in range(4))
    tensors = tuple(ParamTensor(f"t{i}", 10 * (i + 1), f"l{i}") for i in range(4))
    wl = Workload("w", layers, tensors)
    assert flat_segments(wl, [Bucket((3, 2), 70), Bucket((1, 0), 30)]) == (30, 70)
    assert flat_segments(wl, [Bucket((0, 1, 2, 3), 100)]) == (100,)
    with pytest.raises(ConfigError, match="not consecutive"):
        flat_segments(wl, [Bucket((3, 1), 60), Bucket((2, 0), 40)])


@pytest.mark.parametrize("overrides, match", [
    (["data.dataset='fashion-mnist'"], "holds images"),
    (["model.name='lenet5'"], "valid fashion-mnist or mnist"),
    (["model.name='lenet5'", "data.dataset='fashion-mnist'", "data.lam=0.1"], "data.lam"),
    (["model.name='lenet5'", "data.dataset='fashion-mnist'", "compute.forward_backward_s=0.1"], "forward_backward_s"),
    (["model.name='lenet5'", "data.dataset='fashion-mnist'", "workload.model='resnet50'"], "workload.model"),
    (["model.eval_samples=10"], "used only with model.name"),
    (["training.time_budget_s=10.0"], "used only with model.name"),
    (["workload.device='V100'"], "model.name"),
])
def test_model_keys_unused_or_inconsistent_are_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_scenario(None, overrides)


def test_model_scenario_uses_workload_keys_and_dumps_what_it_uses():
    from experiments.scenario import used_keys_dump

    sc = load_scenario(None, ["model.name='lenet5'", "data.dataset='fashion-mnist'", "workload.device='V100'",
                              "workload.sparse_policy='bucket'", "training.time_budget_s=2.5"])
    dump = used_keys_dump(sc)
    assert dump["model"]["name"] == "lenet5" and dump["training"]["time_budget_s"] == 2.5
    assert "model" not in dump["workload"] and "objective" not in dump["data"]
    assert dump["workload"]["device"] == "V100"
    plain = used_keys_dump(load_scenario(None))
    assert "model" not in plain and "time_budget_s" not in plain["training"]


SMALL = ["--set", "model.name='lenet5'", "--set", "data.dataset='fashion-mnist'", "--set", "cluster.P=4",
         "--set", "training.batch_size=8", "--set", "model.eval_samples=64", "--set", "model.test_samples=100",
         "--set", "training.dtype='float32'", "--set", "compression.value_bytes=4", "--set", "cluster.network='gtopk-icdcs'",
         "--set", "workload.device='P102-100'"]


@needs_data
def test_a_model_run_through_the_cli_is_timed_by_the_networks_timeline(tmp_path):
    """Whole run: accuracy columns filled at evaluations, each iteration's time = the network's timeline for that
    algorithm on the cluster (recomputed here), the clock its float64 running sum; a time budget keeps exactly the
    iterations whose clock is within it; sparsim check reports delta on every step."""
    import csv
    import json

    from click.testing import CliRunner

    from experiments.check import check_run
    from experiments.cli import main
    from experiments.build import build
    from experiments.scenario import load_scenario
    from sim.engine.timeline import simulate_timeline

    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["run", "--out", str(out), "--algorithms", "dense,gtopk", "--set", "training.iterations=4",
                                  "--set", "training.eval_every=2", *SMALL])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    sc = load_scenario(None, [a for a in SMALL if a != "--set"] + ["training.iterations=4", "training.eval_every=2"])
    built = build(sc)
    for spec in [s for s in built.specs if s.label in ("dense", "gtopk")]:
        mine = [x for x in rows if x["algorithm"] == spec.label and int(x["iteration"]) >= 1]
        res = simulate_timeline(spec, built.workload, 4, network=built.network, policy=built.clock.policy,
                                device=built.clock.device, batch_size=8, compute=built.compute, iterations=4)
        assert [float(x["sim_time_s"]) for x in mine] == np.cumsum(res.iter_s).tolist()  # the clock, bit for bit
        # iter_time_s is the clock's difference (as in every run), the timeline's time up to that subtraction's rounding
        assert [float(x["iter_time_s"]) for x in mine] == pytest.approx(res.iter_s.tolist(), rel=1e-12)
        ev = [x for x in rows if x["algorithm"] == spec.label and x["test_accuracy"] not in ("", "nan")]
        assert [int(x["iteration"]) for x in ev] == [0, 2, 4]
        assert all(0 <= float(x[c]) <= 1 for x in ev for c in ("train_accuracy", "test_accuracy"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "network on images" and summary["resolved"]["workload"]["parameters"] == 61_706
    rep = check_run(out, write=False)
    assert [t for t, _ in rep.deltas["gtopk"]] == [1, 2, 3, 4]
    assert any("smoothness constant L is unknown" in n for n in rep.notes)
    # a budget between the 2nd and 3rd iteration's clock keeps 2 iterations
    g = [float(x["sim_time_s"]) for x in rows if x["algorithm"] == "gtopk" and int(x["iteration"]) >= 1]
    budget = (g[1] + g[2]) / 2
    out2 = tmp_path / "b"
    r = CliRunner().invoke(main, ["run", "--out", str(out2), "--algorithms", "gtopk", "--set", "training.iterations=4",
                                  "--set", f"training.time_budget_s={budget!r}", *SMALL])
    assert r.exit_code == 0, r.output
    kept = [x for x in csv.DictReader(open(out2 / "metrics.csv")) if int(x["iteration"]) >= 1]
    assert [float(x["sim_time_s"]) for x in kept] == g[:2]


def test_activation_estimate_counts_the_images_in_flight():
    """The memory check's activation term (found 23x low for ResNet-20 at b = 1000: 1.03 GiB estimated, 23.9 GB peak):
    factor x leaf outputs per image x dtype size x images in flight (P x b for vmap, the loop's threads x b)."""
    pytest.importorskip("torch")
    import os

    import torch

    from experiments.run_net import ACTIVATION_FACTOR, activation_bytes
    from sim.workloads.nets import LOOP_MAX_THREADS, build_net

    def sc(**kw):
        sets = {"model.name": "'resnet20'", "data.dataset": "'fashion-mnist'", "cluster.P": 4, "training.batch_size": 300,
                "training.dtype": "'float64'", **kw}
        return load_scenario(None, [f"{k}={v}" for k, v in sets.items()])

    m = build_net("resnet20", dtype="float32")
    outs = []
    for mod in m.modules():
        if not list(mod.children()):
            mod.register_forward_hook(lambda _m, _i, o: outs.append(o.numel()))
    with torch.no_grad():
        m.eval()
        m(torch.zeros(1, 1, 28, 28))
    threads = min(os.cpu_count() or 1, 4, LOOP_MAX_THREADS)
    assert activation_bytes(sc()) == ACTIVATION_FACTOR * sum(outs) * 8 * threads * 300
    assert activation_bytes(sc(**{"model.gradients": "'vmap'"})) == ACTIVATION_FACTOR * sum(outs) * 8 * 4 * 300
    assert activation_bytes(sc(**{"training.dtype": "'float32'"})) * 2 == activation_bytes(sc())


@needs_data
def test_powersgd_exchanges_per_ddp_bucket_as_the_timeline_charges(tmp_path):
    """A [model] run's PowerSGD compressed the whole model as one matrix while the clock charged one per DDP bucket
    (LeNet-5, 0.05 MiB buckets); now its segments are the DDP buckets in flat order, and Horovod is refused."""
    from experiments.build import build
    from sim.engine.timeline import ddp_buckets, flat_segments

    sets = ["model.name='lenet5'", "data.dataset='fashion-mnist'", "cluster.P=2", "training.batch_size=8",
            "workload.bucket_cap_mb=0.05", "algorithms=['dense', 'powersgd']"]
    built = build(load_scenario(None, sets))
    specs = {s.name: s for s in built.specs}
    want = flat_segments(built.workload, ddp_buckets(built.workload, built.clock.policy, 4))
    assert len(want) > 1 and specs["powersgd"].segments == want and sum(want) == 61_706
    assert specs["dense"].segments is None
    with pytest.raises(ConfigError, match="horovod"):
        build(load_scenario(None, sets + ["workload.dense_policy='horovod'"]))

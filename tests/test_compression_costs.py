"""Each algorithm's compression priced as what it does (issue 22, item 0): rand-k gathers k values, Gaussian-k makes
passes over d, DGC's sampled selection runs its top-k on the sample and filters d, PowerSGD multiplies matrices --
instead of every one of them being charged a full Top-k selection (PowerSGD: dense reductions, free on the
P102-100). The closed forms are written here with literals (bandwidths, peaks, bytes), not the modules' constants;
the timeline's compression of one bucket equals the fast engine's and the numerics' for the same spec; Top-k and
gTop-k keep the P102-100 fit bit for bit; and a plan on the P102-100 now puts rand-k ahead of Top-k."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from experiments.resolve import compute_costs, resolve_compute, resolve_device
from experiments.run_summary import costs_lines
from experiments.scenario import load_scenario, used_keys_dump
from sim.algorithms import AlgorithmSpec, get
from sim.algorithms.powersgd import segment_plan
from sim.base.ops import Compute
from sim.engine.drivers import run_lockstep
from sim.engine.timeline import TimelinePolicy, compression_s, simulate_timeline
from sim.engine.timing import simulate_timing
from sim.machine.compute import ComputeModel
from sim.machine.network import get_preset
from sim.workloads.devices import get_device
from sim.workloads.zoo import get_model

R50_D = 25_557_032  # ResNet-50's parameters (torchvision)
R50_K = 25_557  # density 0.001
#: achieved memory bandwidth (0.87 x datasheet, bytes/s) and matrix FLOP/s (peak x 0.4) per preset, as literals
MEM = {"H100": 0.87 * 3.35e12, "P102-100": 0.87 * 440.3e9, "V100": 0.87 * 900e9}
FLOPS = {"H100": 989e12 * 0.4, "P102-100": 10.77e12 * 0.4, "V100": 125e12 * 0.4}


def _compute(device: str, algorithms: str) -> ComputeModel:
    """The compute model a ResNet-50 workload run of ``algorithms`` on ``device`` builds (experiments.resolve)."""
    sc = load_scenario(None, ["workload.model='resnet50'", "training.iterations=1", f"workload.device='{device}'",
                              f"algorithms={algorithms}"])
    return resolve_compute(sc, resolve_device(sc))


def _spec(name: str, k: int | None = R50_K, **kw) -> AlgorithmSpec:
    return AlgorithmSpec(name, k=k, **kw)


# ------------------------------------------------------------------ closed forms per algorithm

@pytest.mark.parametrize("device", ["H100", "P102-100"])
def test_randk_pays_for_k_gathers_not_a_selection_over_d(device):
    """rand-k at d, k: k (2 x 4 B index written and read + 32 B sector gathered + 4 B value written) / achieved
    bandwidth; independent of d."""
    cm = _compute(device, '["randk"]')
    want = R50_K * (2 * 4 + 32 + 4) / MEM[device]
    assert compression_s(cm, _spec("randk"), R50_D, R50_K) == pytest.approx(want, rel=1e-14)
    assert compression_s(cm, _spec("randk"), 10 * R50_D, R50_K) == pytest.approx(want, rel=1e-14)
    topk = _compute(device, '["topk"]')
    assert compression_s(topk, _spec("topk"), R50_D, R50_K) > 100 * want


def test_the_p102_100_keeps_the_papers_fit_for_topk_and_gtopk_bit_for_bit():
    cm = _compute("P102-100", '["topk", "gtopk", "randk"]')
    fit = 2.19e-10 * R50_D * math.log2(R50_D)
    assert compression_s(cm, _spec("topk"), R50_D, R50_K) == fit
    assert compression_s(cm, _spec("gtopk"), R50_D, R50_K) == fit
    assert compression_s(cm, _spec("dense", k=None), R50_D, None) == 0.0


@pytest.mark.parametrize("device", ["H100", "P102-100"])
def test_gaussiank_is_its_passes_over_d(device):
    """mean + std (2 x 4 B) + abs (2 x 4 B) + loops x (4 B read + 1 B mask written + 1 B read) per element, and
    the k values gathered (32 B) and written (4 B)."""
    cm = _compute(device, '["gaussiank"]')
    for loops in (1, 3, 5):
        spec = _spec("gaussiank", options={"loops": loops})
        want = (R50_D * (16 + loops * 6) + R50_K * 36) / MEM[device]
        assert compression_s(cm, spec, R50_D, R50_K) == pytest.approx(want, rel=1e-14)
    assert get("gaussiank").compression_work(_spec("gaussiank"), 1000, 10) == (("scan", 1000 * 34 + 10 * 36),)


@pytest.mark.parametrize("device", ["H100", "P102-100"])
def test_dgc_exact_is_topk_and_sampled_is_a_selection_of_the_sample_plus_a_filter_over_d(device):
    cm = _compute(device, '["dgc", "topk"]')
    exact = _spec("dgc", options={"selection": "exact"})
    assert compression_s(cm, exact, R50_D, R50_K) == compression_s(cm, _spec("topk"), R50_D, R50_K)
    # sampled, sample_ratio 0.01: the official layout gives at least ceil(0.01 d) samples at a stride 32 j + 1 - 8 i
    work = get("dgc").compression_work(_spec("dgc"), R50_D, R50_K)
    (k1, n_s), (k2, nbytes) = work
    assert (k1, k2) == ("select", "scan")
    assert math.ceil(0.01 * R50_D) <= n_s <= R50_D // 65 and n_s == R50_D // (R50_D // n_s)
    assert nbytes == R50_D * (3 * 4 + 2) + n_s * 32 + R50_K * 36
    want = cm.seconds("select", n_s, 0, 1) + nbytes / MEM[device]
    assert compression_s(cm, _spec("dgc"), R50_D, R50_K) == pytest.approx(want, rel=1e-14)
    # a segment small enough to be its own sample (d <= 2 / density): its whole top-k, no sample gathered
    assert get("dgc").compression_work(_spec("dgc", k=10), 1000, 10) == (("select", 1000), ("scan", 14000 + 360))


@pytest.mark.parametrize("device", ["H100", "P102-100", "V100"])
def test_powersgd_matmul_seconds_are_its_flops_at_peak_times_efficiency(device):
    """Three products of 2 rows cols r FLOPs each and the two orthogonalisations (2 r^2 cols, 2 r^2 rows), at
    peak x efficiency; their bytes at the achieved bandwidth."""
    cm = _compute(device, '["powersgd"]')
    for r in (1, 4):
        spec = AlgorithmSpec("powersgd", options={"rank": r})
        (e,) = segment_plan(R50_D, r).compressed
        m, n = e.rows, e.cols
        assert m * n >= R50_D and e.r == r
        work = get("powersgd").compression_work(spec, R50_D, None)
        flops = sum(w for kind, w in work if kind == "matmul")
        assert flops == 3 * 2 * m * n * r + 2 * r * r * (m + n)
        nbytes = sum(w for kind, w in work if kind == "scan")
        gs = lambda x: x * r * (5 * r + 1) // 2  # noqa: E731  (Gram-Schmidt's values read or written)
        assert nbytes == spec.value_bytes * (3 * m * n + 3 * (m + n) * r + gs(m) + gs(n))
        matmul_s = sum(cm.seconds(kind, w, 0, 1) for kind, w in work if kind == "matmul")
        assert matmul_s == pytest.approx((6 * m * n * r + 2 * r * r * (m + n)) / FLOPS[device], rel=1e-14)
        assert compression_s(cm, spec, R50_D, None) == pytest.approx(matmul_s + nbytes / MEM[device], rel=1e-14)
    # rank 1: the memory traffic, not the FLOPs, is the cost (4 B read per 2 FLOPs): 270x on an H100, 22x on the
    # P102-100 (FP32 peak)
    work = dict(get("powersgd").compression_work(AlgorithmSpec("powersgd"), R50_D, None)[:2])
    ratio = cm.seconds("scan", work["scan"], 0, 1) / cm.seconds("matmul", work["matmul"], 0, 1)
    assert ratio > {"H100": 250, "P102-100": 20, "V100": 60}[device]


def test_powersgd_is_no_longer_free_on_the_p102_100():
    cm = _compute("P102-100", '["powersgd"]')
    assert cm.reduce_coeff_s == 0.0  # the papers' model charges no reduction ...
    # ... but the products read or write M three times (3 x 4 B x d / (0.87 x 440.3 GB/s) = 0.80 ms) and make
    # 6 d FLOPs (0.036 ms at 10.77 TFLOP/s x 0.4)
    assert 3 * 4 * R50_D / MEM["P102-100"] + 6 * R50_D / FLOPS["P102-100"] \
        < compression_s(cm, AlgorithmSpec("powersgd"), R50_D, None) < 0.9e-3


# ------------------------------------------------------------------ one definition for every engine

CASES = [("randk", {}), ("gaussiank", {}), ("dgc", {}), ("dgc", {"selection": "exact"}), ("topk", {}),
         ("powersgd", {}), ("powersgd", {"rank": 2})]


@pytest.mark.parametrize("name, options", CASES)
def test_timeline_compression_of_one_bucket_equals_the_fast_and_message_engines(name, options):
    """The whole-model policy (one bucket, after backward): the timeline's compress_s is the timing-only engines'
    compress seconds (category 1 of rank 0) for the same spec, on the H100's costs."""
    wl = get_model("resnet20-cifar")
    d = wl.d
    k = max(1, d // 100)
    spec = AlgorithmSpec(name, k=k if get(name).sparse else None, options=options)
    cm = dataclasses.replace(_compute("H100", f'["{name}"]'), forward_backward_s=0.0)
    P = 4
    net = get_preset("10GbE")
    pol = TimelinePolicy(dense="none", sparse="model")
    tl = simulate_timeline(spec, wl, P, network=net, policy=pol, device=get_device("H100"), compute=cm,
                           engine="fast")
    want = compression_s(cm, spec, d, spec.k)
    assert want > 0
    assert tl.compress_s[0] == pytest.approx(want, rel=1e-12)
    for engine in ("fast", "message"):
        r = simulate_timing(spec, P, d, network=net, compute=cm, engine=engine)
        assert r.compress_s == pytest.approx(want, rel=1e-12), engine


@pytest.mark.parametrize("name, options", [c for c in CASES if c[0] != "powersgd"] + [("gtopk", {})])
def test_the_numerics_exchange_charges_compression_work_first(name, options):
    """The numerics' exchange yields exactly compression_work's operations before its first message."""
    d, k = 5000, 50
    spec = AlgorithmSpec(name, k=k, options=options)
    acc = np.random.default_rng(0).standard_normal(d)
    from sim.algorithms.base import StepContext

    ctx = StepContext(0, 2, 1, d, 0, 0, d, {})
    gen = get(name).exchange(spec, acc, k, ctx)
    ops = []
    op = next(gen)
    while isinstance(op, Compute):
        ops.append((op.kind, op.work))
        op = next(gen)
    assert tuple(ops) == get(name).compression_work(spec, d, k)


def test_powersgd_numerics_charge_the_three_stages_between_its_allreduces():
    """powersgd's per-rank program (lock-step, 2 ranks) yields matmul and scan Compute operations summing to
    compression_work, in three stages."""
    d = 4096
    spec = AlgorithmSpec("powersgd", options={"rank": 2})
    from sim.algorithms.base import StepContext

    seen = []

    def prog(rank):
        acc = np.random.default_rng(rank).standard_normal(d)
        ctx = StepContext(rank, 2, 1, d, 0, 0, d, {})
        gen = get("powersgd").exchange(spec, acc, None, ctx)
        got = None
        while True:
            try:
                op = gen.send(got)
            except StopIteration as stop:
                return stop.value
            if rank == 0:
                seen.append((op.kind, op.work) if isinstance(op, Compute) else ("message", None))
            got = yield op

    run_lockstep([prog(0), prog(1)])
    comp = [(kind, w) for kind, w in seen if kind in ("matmul", "scan")]
    assert tuple(comp) == get("powersgd").compression_work(spec, d, None)
    # the stages: before the P allreduce, between it and the Q allreduce, after it
    pattern = "".join("c" if kind in ("matmul", "scan") else "m" for kind, _ in seen if kind != "reduce")
    assert pattern.startswith("cc") and pattern.endswith("cc")
    assert [run for run in pattern.split("m") if run] == ["cc", "cc", "cc"]


# ------------------------------------------------------------------ the scenario, the summary, the plan

def test_summary_prints_which_model_priced_scan_and_matmul():
    sc = load_scenario(None, ["workload.model='resnet50'", "training.iterations=1", "workload.device='H100'",
                              'algorithms=["dense", "randk", "powersgd"]'])
    costs = compute_costs(sc, resolve_device(sc))
    assert costs["scan"]["coeff_s"] == pytest.approx(1 / MEM["H100"], rel=1e-15) and costs["scan"]["unit"] == "byte"
    assert costs["matmul"]["coeff_s"] == pytest.approx(1 / FLOPS["H100"], rel=1e-15)
    text = "\n".join(costs_lines(costs))
    assert "scan 3.43e-13 s/byte" in text and "matmul 2.53e-15 s/FLOP" in text
    assert "H100 memory model" in text and "H100 FLOP model" in text
    # a run of Top-k alone neither prices nor records them (its run_id, a hash of the dump, is unchanged)
    top = load_scenario(None, ["workload.model='resnet50'", "training.iterations=1", "workload.device='H100'"])
    assert set(compute_costs(top, resolve_device(top))) == {"select", "merge", "reduce", "update"}
    assert "scan_coeff_s" not in used_keys_dump(top)["compute"]
    assert used_keys_dump(sc)["compute"]["scan_coeff_s"] == costs["scan"]["coeff_s"]


def test_without_a_device_scan_and_matmul_take_the_p102_100s_models():
    sc = load_scenario(None, ['algorithms=["randk", "powersgd"]'])
    costs = compute_costs(sc, None)
    assert costs["scan"]["coeff_s"] == 1 / MEM["P102-100"] and costs["scan"]["from"] == "default"
    assert costs["matmul"]["coeff_s"] == 1 / FLOPS["P102-100"]
    assert costs["select"]["coeff_s"] == 2.19e-10


def test_a_scan_key_for_a_run_that_scans_nothing_is_refused():
    from sim.base.errors import ConfigError

    with pytest.raises(ConfigError, match=r"compute.scan_coeff_s = 1e-12: no algorithm of this run charges a scan"):
        load_scenario(None, ["compute.scan_coeff_s=1e-12"])
    sc = load_scenario(None, ["compute.scan_coeff_s=1e-12", 'algorithms=["randk"]'])
    assert compute_costs(sc, None)["scan"] == {"coeff_s": 1e-12, "scaling": "x", "model": "1e-12 s x x",
                                               "source": "compute.scan_coeff_s (the scenario)", "passes": None,
                                               "from": "scenario", "unit": "byte"}


def test_a_plan_on_the_p102_100_puts_randk_ahead_of_topk():
    """ResNet-50 on the gTop-k authors' cluster (16 P102-100, 1 GbE): at the same density rand-k's iteration is
    Top-k's less the selection fit (0.138 s) plus its k gathers (3 us): faster, as the formulas say."""
    from experiments.plan import resolve_plan, simulate_plan

    inp = resolve_plan(model="resnet50", network="1GbE", P="16", densities="0.001", algorithms="topk,randk",
                       policies="model", device="P102-100")
    rows = {r["algorithm"]: r for r in simulate_plan(inp)}
    top, rnd = rows["topk"], rows["randk"]
    assert top["select_s"] == 2.19e-10 * R50_D * math.log2(R50_D)
    assert rnd["select_s"] == pytest.approx(R50_K * 44 / MEM["P102-100"], rel=1e-12)
    assert rnd["comm_s"] == top["comm_s"]  # the same allgather of k entries
    assert rnd["iter_s"] < top["iter_s"]
    assert top["iter_s"] - rnd["iter_s"] == pytest.approx(top["select_s"] - rnd["select_s"], rel=1e-9)

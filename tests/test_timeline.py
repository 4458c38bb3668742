"""The iteration timeline (sim/engine/timeline.py): DDP buckets equal torch's, closed forms on hand-checkable timelines,
the one-bucket timeline equals the non-overlapped model, Horovod fusion, and the Chrome trace."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.algorithms import AlgorithmSpec
from sim.machine.compute import ComputeModel
from sim.base.errors import ConfigError
from sim.machine.network import get_preset
from sim.engine.timeline import (CollectiveTimer, TimelinePolicy, _bucket_assignment, chrome_trace, ddp_buckets,
                          horovod_fusion, layer_buckets, simulate_timeline)
from sim.engine.timing import simulate_timing
from sim.workloads import LayerCost, ParamTensor, Workload

NET = get_preset("1GbE")


def toy(L=4, numel=300_000, fwd=0.01, bwd=0.02, bias=True):
    layers = [LayerCost(f"l{i}", forward_s=fwd, backward_s=bwd) for i in range(L)]
    tensors = []
    for i in range(L):
        tensors.append(ParamTensor(f"l{i}.weight", numel, f"l{i}"))
        if bias:
            tensors.append(ParamTensor(f"l{i}.bias", 10, f"l{i}"))
    return Workload("toy", layers, tensors, measured_batch=32)


def test_bucket_assignment_rule_by_hand():
    # 4-byte elements; limits [1000, 2000]: close as soon as the size reaches the limit
    assert _bucket_assignment([400, 400, 400, 100], [1000, 2000]) == [[0, 1, 2], [3]]
    assert _bucket_assignment([1200, 10, 3000, 5], [1000, 2000]) == [[0], [1, 2], [3]]
    assert _bucket_assignment([5], [1000]) == [[0]]


def _torch():  # torch is optional: only these tests need it
    return pytest.importorskip("torch")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 400_000), min_size=1, max_size=30), st.integers(1, 3 * 2**20), st.integers(1, 3 * 2**20))
def test_bucket_assignment_equals_torch(numels, first, cap):
    t = _torch()
    import torch.distributed as dist

    ps = [t.empty(n) for n in numels]
    want, _ = dist._compute_bucket_assignment_by_size(ps, [first, cap], [False] * len(ps), list(range(len(ps))))
    assert _bucket_assignment([4 * n for n in numels], [first, cap]) == [list(b) for b in want]


_DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.nn as nn, torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = sys.argv[1]
    dist.init_process_group("gloo", rank=0, world_size=1)
    from tests.test_timeline import ddp_models
    out = {}
    for name, (make, shape) in ddp_models().items():
        for cap in (None, 1, 5, 25):
            torch.manual_seed(0)
            m = make()
            ddp = nn.parallel.DistributedDataParallel(m) if cap is None else nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap)
            for _ in range(3):  # DDP rebuilds its buckets at the forward after the first backward
                o = ddp(torch.randn(*shape)); (o[0] if isinstance(o, tuple) else o).float().sum().backward()
            ld = ddp._get_ddp_logging_data()
            out[f"{name}/{cap}"] = [[int(i) for i in b.split()] for b in ld["rebuilt_per_bucket_param_indices"].split(",")]
    print(json.dumps(out))
""")


def ddp_models():
    """Models whose DDP buckets the test compares: a CNN (conv weight before bias in autograd), an MLP with
    large layers (several buckets at 1 and 5 MiB) and an LSTM."""
    import torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(2000, 256)
            self.lstm = nn.LSTM(256, 256, 2, batch_first=True)
            self.out = nn.Linear(256, 2000)

        def forward(self, x):
            return self.out(self.lstm(self.emb(x.abs().long() % 2000))[0])

    return {
        "cnn": (lambda: nn.Sequential(nn.Conv2d(3, 64, 3), nn.ReLU(), nn.Conv2d(64, 128, 3), nn.ReLU(), nn.Flatten(),
                                      nn.Linear(128 * 4 * 4, 512), nn.ReLU(), nn.Linear(512, 10)), (2, 3, 8, 8)),
        "mlp": (lambda: nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                                      nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)), (4, 784)),
        "lstm": (LM, (2, 12)),
    }


def _workload_of(module, example):
    from sim.workloads.ready import observe_ready_order

    names = [n for n, _ in module.named_parameters()]
    layers = sorted({n.rsplit(".", 1)[0] for n in names}, key=lambda l: [n.rsplit(".", 1)[0] for n in names].index(l))
    tensors = [ParamTensor(n, p.numel(), n.rsplit(".", 1)[0]) for n, p in module.named_parameters()]
    return Workload("m", [LayerCost(l, 1.0, 2.0) for l in layers], tensors,
                    ready_order=observe_ready_order(module, example))


def test_ddp_buckets_equal_real_ddp(tmp_path):
    """The tensor-to-bucket assignment equals what a real DistributedDataParallel builds after its rebuild."""
    t = _torch()
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = str(29500 + os.getpid() % 1000)
    res = subprocess.run([sys.executable, "-c", _DDP_SCRIPT, port], capture_output=True, text=True, cwd=root,
                         timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert res.returncode == 0, res.stderr[-2000:]
    real = json.loads(res.stdout.strip().splitlines()[-1])
    for name, (make, shape) in ddp_models().items():
        t.manual_seed(0)
        m = make()
        w = _workload_of(m, t.randn(*shape))
        for cap in (None, 1, 5, 25):
            ours = [list(b.tensors) for b in ddp_buckets(w, TimelinePolicy(bucket_cap_mb=cap))]
            assert ours == real[f"{name}/{cap}"], (name, cap)
    assert len(real["mlp/1"]) > 2  # the comparison covers several buckets


def _allreduce_s(numel, P=4):
    return CollectiveTimer(P, NET, None)(AlgorithmSpec("dense"), numel)


def test_exposed_is_last_bucket_when_backward_dominates():
    w = toy(L=4, bwd=10.0)  # each layer's backward (10 s) >> any bucket's allreduce (~0.01 s)
    pol = TimelinePolicy(bucket_cap_mb=1.0)
    r = simulate_timeline(AlgorithmSpec("dense"), w, 4, network=NET, policy=pol)
    last = r.buckets[-1]
    assert len(r.buckets) == 4
    assert r.exposed_comm_s[0] == pytest.approx(_allreduce_s(last.numel), rel=1e-12)
    assert r.comm_s[0] == pytest.approx(sum(_allreduce_s(b.numel) for b in r.buckets), rel=1e-12)


def test_exposed_is_sum_of_buckets_with_zero_backward():
    w = toy(L=4, fwd=0.05, bwd=0.0)
    r = simulate_timeline(AlgorithmSpec("dense"), w, 4, network=NET, policy=TimelinePolicy(bucket_cap_mb=1.0))
    total = sum(_allreduce_s(b.numel) for b in r.buckets)
    assert r.exposed_comm_s[0] == pytest.approx(total, rel=1e-12)
    assert r.overlap_ratio[0] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("spec,policy", [
    (AlgorithmSpec("dense"), TimelinePolicy(dense="none")),
    (AlgorithmSpec("dense"), TimelinePolicy(bucket_cap_mb=1000.0, first_bucket_mb=1000.0)),  # one DDP bucket
    (AlgorithmSpec("topk", k=12_000), TimelinePolicy(sparse="model")),
    (AlgorithmSpec("gtopk", k=12_000), TimelinePolicy(sparse="model")),
    (AlgorithmSpec("gtopk", k=12_000, collective="recursive_doubling"), TimelinePolicy(sparse="model")),
])
def test_one_bucket_equals_the_non_overlapped_model(spec, policy):
    w = toy(L=4)
    cm = ComputeModel(select_coeff_s=2.19e-10, update_coeff_s=1e-9, reduce_coeff_s=1e-10)
    r = simulate_timeline(spec, w, 8, network=NET, policy=policy, compute=cm)
    F = 4 * 0.01 + 4 * 0.02
    ref = simulate_timing(spec, 8, w.d, network=NET, compute=ComputeModel(forward_backward_s=F, select_coeff_s=2.19e-10,
                                                                        update_coeff_s=1e-9, reduce_coeff_s=1e-10))
    assert len(r.buckets) == 1
    assert r.iter_s[0] == pytest.approx(ref.iter_s[0], rel=1e-12)
    assert r.compute_s[0] == pytest.approx(ref.compute_s, rel=1e-12)  # forward/backward + update
    assert r.exposed_comm_s[0] == pytest.approx(ref.iter_s[0] - ref.compute_s, rel=1e-12)


def test_layerwise_with_one_layer_equals_whole_model():
    w = Workload("one", [LayerCost("l", forward_s=0.01, backward_s=0.02)], [ParamTensor("l.w", 100_000, "l")],
                 measured_batch=8)
    g = AlgorithmSpec("gtopk", k=1000)
    a = simulate_timeline(g, w, 4, network=NET, policy=TimelinePolicy(sparse="layer"))
    b = simulate_timeline(g, w, 4, network=NET, policy=TimelinePolicy(sparse="model"))
    assert a.iter_s[0] == b.iter_s[0] and a.ks == b.ks == [1000]


def test_layer_buckets_and_bucket_k():
    w = toy(L=3)
    bs = layer_buckets(w)
    assert [b.tensors for b in bs] == [(5, 4), (3, 2), (1, 0)]
    r = simulate_timeline(AlgorithmSpec("topk", k=int(0.01 * w.d)), w, 4, network=NET, policy=TimelinePolicy(sparse="layer"))
    assert r.ks == [round(0.01 * 300_010)] * 3


def test_horovod_fusion_closed_forms():
    # all tensors ready at once at t = 0.0025, cycle 1 ms: the first cycle after is 3 ms; one fused buffer
    ready = np.full(5, 0.0025)
    numel = np.array([10, 20, 30, 40, 50])
    sched = horovod_fusion(ready, numel, 10**9, 1e-3, lambda n: n * 1e-6)
    assert len(sched) == 1 and sched[0][0] == [0, 1, 2, 3, 4]
    assert sched[0][1] == pytest.approx(3e-3) and sched[0][2] == pytest.approx(3e-3 + 150e-6)
    # threshold 55 elements: 10 + 20 fit, 30 starts a new buffer, 40 and 50 go alone; back to back
    sched = horovod_fusion(ready, numel, 4 * 55, 1e-3, lambda n: n * 1e-6)
    assert [g for g, _, _ in sched] == [[0, 1], [2], [3], [4]]
    assert sched[-1][2] == pytest.approx(3e-3 + 150e-6)
    # tensors ready far apart: each waits for the next cycle after it is ready
    sched = horovod_fusion(np.array([0.0101, 0.02055]), np.array([1, 1]), 10**9, 1e-3, lambda n: 1e-4)
    assert sched[0][1] == pytest.approx(0.011) and sched[1][1] == pytest.approx(0.021)


def test_horovod_timeline_zero_backward():
    w = toy(L=4, fwd=0.0125, bwd=0.0)  # forward ends at 0.05 s; every gradient ready then
    r = simulate_timeline(AlgorithmSpec("dense"), w, 4, network=NET, policy=TimelinePolicy(dense="horovod"))
    assert r.exposed_comm_s[0] == pytest.approx(_allreduce_s(w.d), rel=1e-9)  # 0.05 is a cycle boundary


def test_straggler_sets_the_iteration_time():
    """straggler_prob = 1, factor 3: every rank's forward and backward take 3x, the collectives do not.

    toy(L=2, bwd=0.1): layers l0, l1 of forward 0.01 s and backward 0.1 s, 300,010 parameters each; at
    bucket_cap_mb = 1 DDP makes one bucket per layer (4 x 300,010 bytes >= 1 MiB), bucket 0 = l1 first. With
    F = 0.02, B = 0.2: bucket 0 is ready at 3 (F + 0.1) = 0.36 s and its ring allreduce ends at 0.36 + ring, before
    bucket 1 is ready at the end of backward, 3 (F + B) = 0.66 s; bucket 1's allreduce then ends the iteration
    (update_coeff_s = 0): iter = 3 (F + B) + ring, ring = 2 (P-1)(alpha + ceil(300,010 / 4) 4 beta) at P = 4."""
    from sim.comm.costs import ring_allreduce_time

    w = toy(L=2, bwd=0.1)
    pol = TimelinePolicy(bucket_cap_mb=1.0)
    cm = ComputeModel(straggler_prob=1.0, straggler_factor=3.0)
    r = simulate_timeline(AlgorithmSpec("dense"), w, 4, network=NET, compute=cm, policy=pol, trace_iterations=[1])
    base = simulate_timeline(AlgorithmSpec("dense"), w, 4, network=NET, policy=pol)
    assert r.compute_s[0] == pytest.approx(3 * base.compute_s[0])
    assert [b.numel for b in r.buckets] == [300_010, 300_010] and r.buckets[0].tensors == (3, 2)
    F, B = 2 * 0.01, 2 * 0.1
    alpha, beta = NET.end_to_end_alpha_beta()
    ring = ring_allreduce_time(4, 300_010, alpha, beta)
    assert 3 * (F + 0.1) + ring < 3 * (F + B)  # bucket 0 is over before bucket 1 is ready: nothing queues
    assert r.iter_s[0] == pytest.approx(3 * (F + B) + ring, rel=1e-12)
    assert r.comm_s[0] == pytest.approx(2 * ring, rel=1e-12)  # the collectives are not stretched
    assert r.exposed_comm_s[0] == pytest.approx(ring, rel=1e-12)  # bucket 1's allreduce, after rank 0's backward
    # = the timeline without stragglers of the same workload with 3x layer times
    slow = simulate_timeline(AlgorithmSpec("dense"), toy(L=2, fwd=0.03, bwd=0.3), 4, network=NET, policy=pol,
                             trace_iterations=[1])
    for f in ("iter_s", "compute_s", "comm_s", "exposed_comm_s"):
        assert getattr(r, f)[0] == pytest.approx(getattr(slow, f)[0], rel=1e-12), f
    # every rank straggles (not only the slowest, which alone sets iter_s): on each of the 4 ranks forward takes
    # 0.03 s and backward 0.3 s per layer, backward ends at 3 (F + B), and each allreduce lasts ring
    (tl,), (tl_slow,) = r.timelines, slow.timelines
    assert len(tl.compute) == 4
    for rank in range(4):
        comp = {name: (s, e) for name, s, e, _ in tl.compute[rank]}
        for name, want in (("forward l0", 0.03), ("forward l1", 0.03), ("backward l1", 0.3), ("backward l0", 0.3)):
            assert comp[name][1] - comp[name][0] == pytest.approx(want, rel=1e-12), (rank, name)
        assert comp["backward l0"][1] == pytest.approx(3 * (F + B), rel=1e-12), rank
        assert [(n, pytest.approx(s, rel=1e-12), pytest.approx(e, rel=1e-12)) for n, s, e, _ in tl.compute[rank]] \
            == [(n, s, e) for n, s, e, _ in tl_slow.compute[rank]]
        assert [e - s for _, s, e, _ in tl.comm[rank]] == pytest.approx([ring, ring], rel=1e-12), rank


def test_trace_is_valid_and_sums_match(tmp_path):
    w = toy(L=5)
    g = AlgorithmSpec("gtopk", k=3000)
    cm = ComputeModel(select_coeff_s=1e-9, update_coeff_s=1e-9)
    runs = {"dense": simulate_timeline(AlgorithmSpec("dense"), w, 4, network=NET, compute=cm, iterations=3,
                                       trace_iterations=[1, 3], policy=TimelinePolicy(bucket_cap_mb=1.0)),
            "gtopk": simulate_timeline(g, w, 4, network=NET, compute=cm, iterations=2, trace_iterations=[2],
                                       policy=TimelinePolicy(sparse="bucket", bucket_cap_mb=1.0)),
            "hvd": simulate_timeline(AlgorithmSpec("dense"), w, 4, network=NET, compute=cm, iterations=1,
                                     trace_iterations=[1], policy=TimelinePolicy(dense="horovod"))}
    path = tmp_path / "trace.json"
    chrome_trace({k: v.timelines for k, v in runs.items()}, path)
    doc = json.loads(path.read_text())
    ev = doc["traceEvents"]
    names = {(e["pid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert len(names) == 12
    slices = [e for e in ev if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and {"name", "ts", "pid", "tid"} <= set(e) for e in slices)
    by = {}
    for e in slices:
        by.setdefault((e["pid"], e["tid"], e["args"]["iteration"]), []).append(e)
    for key, es in by.items():
        es.sort(key=lambda e: e["ts"])
        for a, b in zip(es, es[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, key  # no overlap within a stream
    for label, res in runs.items():
        pid0 = [p for p, n in names.items() if n == f"{label} rank 0"][0]
        for tl in res.timelines:
            i = tl.iteration - 1
            comp = sum(e["dur"] for e in by[(pid0, 0, tl.iteration)]) / 1e6
            comm = [e for e in by[(pid0, 1, tl.iteration)]]
            coll = sum(e["dur"] for e in comm if not e["name"].startswith("select")) / 1e6
            sel = sum(e["dur"] for e in comm if e["name"].startswith("select")) / 1e6
            assert comp == pytest.approx(res.compute_s[i], rel=1e-9)
            assert coll == pytest.approx(res.comm_s[i], rel=1e-9)
            assert sel == pytest.approx(res.compress_s[i], rel=1e-9, abs=1e-15)
            assert sum(e["args"]["bytes"] for e in comm if "bytes" in e["args"]) == res.bytes_per_rank
    assert not (tmp_path / "trace.json.partial").exists()
    # the time axis is the simulated clock: iteration 3 starts after iterations 1 and 2 (iteration 2 not traced)
    d = runs["dense"]
    pid0 = [p for p, n in names.items() if n == "dense rank 0"][0]
    first3 = min(e["ts"] for e in by[(pid0, 0, 3)])
    assert first3 == pytest.approx(1e6 * (d.iter_s[0] + d.iter_s[1]), rel=1e-12)


@pytest.mark.parametrize("kw,msg", [
    (dict(bucket_cap_mb=0.0), "bucket_cap_mb = 0.0 is out of range"),
    (dict(bucket_cap_mb=-1.0), "bucket_cap_mb = -1.0"),
    (dict(dense="fusion"), "dense policy = 'fusion' is unknown: valid ddp, horovod, none"),
    (dict(sparse="tensor"), "valid model, bucket, layer"),
    (dict(cycle_time_s=0.0), "cycle_time_s = 0.0"),
    (dict(fusion_threshold_mb=math.nan), "fusion_threshold_mb = nan"),
])
def test_bad_policy(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        TimelinePolicy(**kw)


def test_ready_order_validated():
    with pytest.raises(ConfigError, match="permutation"):
        Workload("w", [LayerCost("l", 1, 1)], [ParamTensor("a", 1, "l"), ParamTensor("b", 1, "l")], ready_order=(0, 0))


def test_bucket_caps_follow_ddp_defaults():
    assert TimelinePolicy().bucket_limits_bytes() == (1 << 20, 25 << 20)
    assert TimelinePolicy(bucket_cap_mb=5).bucket_limits_bytes() == (5 << 20, 5 << 20)  # explicit cap: no small first
    assert TimelinePolicy(bucket_cap_mb=5, first_bucket_mb=1).bucket_limits_bytes() == (1 << 20, 5 << 20)


def test_blocking_hook_stalls_backward_closed_form():
    """blocking = True (a synchronous comm hook): every bucket's selection and collective stall backward, so the
    iteration is F + B + sum over buckets of (selection + collective); overlapped, only the last one is exposed."""
    w = toy(L=4, fwd=0.01, bwd=10.0, bias=False)  # 4 tensors of 1.2 MB: one bucket per layer at a 1 MiB cap
    F, B = 4 * 0.01, 4 * 10.0
    dense = AlgorithmSpec("dense")
    r = simulate_timeline(dense, w, 4, network=NET, policy=TimelinePolicy(bucket_cap_mb=1.0, blocking=True),
                          trace_iterations=(1,))
    colls = [_allreduce_s(b.numel) for b in r.buckets]
    assert len(r.buckets) == 4
    assert r.iter_s[0] == pytest.approx(F + B + sum(colls), rel=1e-12)
    assert r.compute_s[0] == pytest.approx(F + B, rel=1e-12)
    assert r.exposed_comm_s[0] == pytest.approx(sum(colls), rel=1e-9)
    over = simulate_timeline(dense, w, 4, network=NET, policy=TimelinePolicy(bucket_cap_mb=1.0))
    assert over.iter_s[0] == pytest.approx(F + B + colls[-1], rel=1e-12)
    # the trace: layer l's backward (reverse order) starts after the stalls of the buckets before it
    bw = [s for s in r.timelines[0].compute[0] if s[0].startswith("backward")]
    for i, (_, s, e, _) in enumerate(bw):
        assert s == pytest.approx(F + i * 10.0 + sum(colls[:i]), rel=1e-12)
        assert e - s == pytest.approx(10.0, rel=1e-12)
    # sparse per-bucket selection: each stall is the bucket's selection plus its collective
    k = 12_000
    sp = AlgorithmSpec("gtopk", k=k)
    comp = ComputeModel(select_coeff_s=1e-8)
    rs = simulate_timeline(sp, w, 4, network=NET, compute=comp,
                           policy=TimelinePolicy(sparse="bucket", bucket_cap_mb=1.0, blocking=True))
    timer = CollectiveTimer(4, NET, comp)
    stalls = [comp.seconds("select", b.numel, 0, 1) + timer(AlgorithmSpec("gtopk", k=kb), b.numel)
              for b, kb in zip(rs.buckets, rs.ks)]
    assert rs.iter_s[0] == pytest.approx(F + B + sum(stalls), rel=1e-12)
    with pytest.raises(ConfigError, match="blocking = True does not apply to dense policy 'horovod'"):
        simulate_timeline(dense, w, 4, network=NET, policy=TimelinePolicy(dense="horovod", blocking=True))
    with pytest.raises(ConfigError, match="blocking = 1 is not a bool"):
        TimelinePolicy(blocking=1)

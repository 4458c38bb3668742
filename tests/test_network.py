"""Tests of sim.machine.network (SimPy link model) and sim.machine.compute (compute model) against exact values.

Oracles: ASTRA-sim congestion-aware backend integer-ns values and the alpha-beta closed forms
(docs/costs.md), nccl-tests busbw convention.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import simpy

from sim.machine.compute import ComputeModel
from sim.base.errors import ConfigError, SparsimError
from sim.machine.network import PRESETS, Network, NetworkSpec, busbw, get_preset

GIB = 2**30
MIB = 2**20


def run_one(spec: NetworkSpec, P: int, src: int, dst: int, nbytes: int) -> float:
    """Simulate one message on an idle network; return its completion time in seconds."""
    env = simpy.Environment()
    net = Network(env, P, spec)
    done = {}

    def proc():
        yield net.transfer(src, dst, nbytes)
        done["t"] = env.now

    env.process(proc())
    env.run()
    return done["t"]


def run_many(spec: NetworkSpec, P: int, msgs):
    """Start all ``(src, dst, nbytes)`` messages at t = 0 (in list order); return finish times."""
    env = simpy.Environment()
    net = Network(env, P, spec)
    out = [None] * len(msgs)

    def proc(i, s, d, n):
        yield net.transfer(s, d, n)
        out[i] = env.now

    for i, (s, d, n) in enumerate(msgs):
        env.process(proc(i, s, d, n))
    env.run()
    return out, net


# ---------------------------------------------------------------- ASTRA-sim exact values
ASTRA = dict(link_latency_s=500e-9, link_bandwidth_Bps=50 * GIB, quantum_s=1e-9)


@pytest.mark.parametrize(
    "topology,P,src,dst,expected_ns",
    [
        ("direct", 2, 0, 1, 20_031),
        ("star", 2, 0, 1, 40_062),
        ("ring", 6, 0, 3, 60_093),
    ],
)
def test_astra_sim_exact_values(topology, P, src, dst, expected_ns):
    t = run_one(NetworkSpec(topology, **ASTRA), P, src, dst, MIB)
    assert round(t * 1e9) == expected_ns
    assert abs(t * 1e9 - expected_ns) < 1e-6


def test_astra_hop_times_truncate_like_astra():
    env = simpy.Environment()
    net = Network(env, 2, NetworkSpec("direct", **ASTRA))
    hold, delay = net.hop_times(MIB)
    # size/bw = 19531.25 ns -> link held 19531 ns; latency + size/bw = 20031.25 -> 20031 ns
    assert round(hold * 1e9) == 19_531 and abs(hold * 1e9 - 19_531) < 1e-6
    assert round(delay * 1e9) == 20_031 and abs(delay * 1e9 - 20_031) < 1e-6


def test_astra_many_hops_no_drift():
    # P = 64 ring, 32 hops: 32 * 20031 ns exactly on the ns grid
    t = run_one(NetworkSpec("ring", **ASTRA), 64, 0, 32, MIB)
    assert round(t * 1e9) == 32 * 20_031
    assert abs(t * 1e9 - 32 * 20_031) < 1e-6


# ---------------------------------------------------------------- alpha-beta identity
@pytest.mark.parametrize("topology", ["star", "direct"])
@pytest.mark.parametrize("alpha,beta", [(0.436e-3, 9e-9), (2e-6, 8e-11), (0.0, 1e-9), (1e-5, 3.7e-10)])
@pytest.mark.parametrize("n", [0, 1, 8, 1000, 4 * 25_600_000, 12_345_677])
def test_from_alpha_beta_uncontended(topology, alpha, beta, n):
    spec = NetworkSpec.from_alpha_beta(alpha, beta, topology)
    t = run_one(spec, 4, 1, 3, n)
    expected = alpha + n * beta
    if expected == 0:
        assert t == 0
    else:
        assert math.isclose(t, expected, rel_tol=1e-12, abs_tol=0)
    a, b = spec.end_to_end_alpha_beta()
    assert math.isclose(a, alpha, rel_tol=1e-12) and math.isclose(b, beta, rel_tol=1e-12)


def test_from_alpha_beta_ring_per_hop():
    alpha, beta, n = 1e-5, 1e-9, 4096
    spec = NetworkSpec.from_alpha_beta(alpha, beta, "ring")
    assert spec.end_to_end_alpha_beta() == (alpha, pytest.approx(beta, rel=1e-15))
    for dst, hops in [(1, 1), (2, 2), (3, 3), (4, 3), (5, 2), (6, 1)]:
        t = run_one(spec, 7, 0, dst, n)
        assert math.isclose(t, hops * (alpha + n * beta), rel_tol=1e-12)


def test_from_alpha_beta_star_link_parameters():
    spec = NetworkSpec.from_alpha_beta(0.436e-3, 9e-9, "star")
    assert spec.link_latency_s == 0.218e-3
    assert math.isclose(spec.link_bandwidth_Bps, 2 / 9e-9, rel_tol=1e-15)


def test_self_transfer_costs_nothing_and_zero_bytes_costs_latency():
    spec = NetworkSpec.from_alpha_beta(1e-3, 1e-9, "star")
    assert run_one(spec, 3, 2, 2, 10**6) == 0
    assert math.isclose(run_one(spec, 3, 0, 2, 0), 1e-3, rel_tol=1e-12)


# ---------------------------------------------------------------- contention and duplex
def test_fifo_contention_on_shared_downlink():
    alpha, beta, n = 1e-4, 1e-8, 10_000
    spec = NetworkSpec.from_alpha_beta(alpha, beta, "star")
    (t1, t2), net = run_many(spec, 3, [(0, 2, n), (1, 2, n)])
    ser_downlink = n / spec.link_bandwidth_Bps  # = n beta / 2
    assert math.isclose(t1, alpha + n * beta, rel_tol=1e-12)
    assert math.isclose(t2 - t1, ser_downlink, rel_tol=1e-12)
    assert math.isclose(t2, alpha + n * beta + n * beta / 2, rel_tol=1e-12)
    # busy accounting: downlink to 2 serialised both messages
    assert math.isclose(net.link_busy_s[("switch", 2)], 2 * ser_downlink, rel_tol=1e-12)
    assert net.link_busy_s[("switch", 0)] == 0.0
    assert list(net.bytes_sent) == [n, n, 0] and list(net.messages_sent) == [1, 1, 0]


def test_fifo_contention_direct_same_link_queues():
    alpha, beta, n = 1e-4, 1e-8, 10_000
    spec = NetworkSpec.from_alpha_beta(alpha, beta, "direct")
    times, _ = run_many(spec, 2, [(0, 1, n)] * 3)
    for i, t in enumerate(times):
        assert math.isclose(t, alpha + (i + 1) * n * beta, rel_tol=1e-12)


def test_fifo_contention_exact_ns_with_quantum():
    # two 1 MiB messages into one star downlink, ASTRA parameters: second waits 19531 ns
    (t1, t2), _ = run_many(NetworkSpec("star", **ASTRA), 3, [(0, 2, MIB), (1, 2, MIB)])
    assert round(t1 * 1e9) == 40_062 and abs(t1 * 1e9 - 40_062) < 1e-6
    assert round(t2 * 1e9) == 40_062 + 19_531 and abs(t2 * 1e9 - 59_593) < 1e-6


@pytest.mark.parametrize("topology", ["star", "direct", "ring"])
def test_full_duplex(topology):
    alpha, beta, n = 1e-4, 1e-8, 10_000
    spec = NetworkSpec.from_alpha_beta(alpha, beta, topology)
    (t1, t2), _ = run_many(spec, 4, [(0, 1, n), (1, 0, n)])
    assert math.isclose(t1, alpha + n * beta, rel_tol=1e-12)
    assert math.isclose(t2, alpha + n * beta, rel_tol=1e-12)


def test_star_switch_is_non_blocking():
    # disjoint pairs never contend: everyone finishes at alpha + n beta
    alpha, beta, n = 1e-4, 1e-8, 10_000
    spec = NetworkSpec.from_alpha_beta(alpha, beta, "star")
    P = 16
    times, _ = run_many(spec, P, [(p, (p + 1) % P, n) for p in range(P)])
    for t in times:
        assert math.isclose(t, alpha + n * beta, rel_tol=1e-12)


# ---------------------------------------------------------------- ring routes
@pytest.mark.parametrize(
    "P,expected",
    [
        (5, {1: (1, +1), 2: (2, +1), 3: (2, -1), 4: (1, -1)}),
        (6, {1: (1, +1), 2: (2, +1), 3: (3, +1), 4: (2, -1), 5: (1, -1)}),
    ],
)
def test_ring_shortest_path_hops(P, expected):
    net = Network(simpy.Environment(), P, NetworkSpec("ring", 1e-6, 1e9))
    for src in range(P):
        for off, (hops, step) in expected.items():
            dst = (src + off) % P
            path = net.route(src, dst)
            assert len(path) == hops
            node = src
            for a, b in path:
                assert a == node and b == (node + step) % P
                node = b
            assert node == dst
        assert net.route(src, src) == []


def test_ring_hop_counts_in_time():
    spec = NetworkSpec("ring", 1e-6, 1e9)
    hop = 1e-6 + 1000 / 1e9
    for P, dst, hops in [(5, 2, 2), (5, 3, 2), (6, 3, 3), (6, 4, 2)]:
        assert math.isclose(run_one(spec, P, 0, dst, 1000), hops * hop, rel_tol=1e-12)


def test_ring_tie_goes_clockwise_links_used():
    (_,), net = run_many(NetworkSpec("ring", 1e-6, 1e9), 6, [(0, 3, 100)])
    used = [k for k, v in net.link_busy_s.items() if v > 0]
    assert used == [(0, 1), (1, 2), (2, 3)]


# ---------------------------------------------------------------- FIFO equivalence to simpy.Resource
def _reference_resource_times(spec, P, msgs):
    """Reference model: each directed link a simpy.Resource(capacity=1) (float time, no quantum)."""
    env = simpy.Environment()
    probe = Network(simpy.Environment(), P, spec)
    links = {}
    out = [None] * len(msgs)
    ser_of = lambda n: n / spec.link_bandwidth_Bps  # noqa: E731

    def proc(i, s, d, n, t0):
        yield env.timeout(t0)
        for key in probe.route(s, d):
            res = links.setdefault(key, simpy.Resource(env, capacity=1))
            with res.request() as req:
                yield req
                start = env.now
                yield env.timeout(ser_of(n))
            yield env.timeout(start + ser_of(n) + spec.link_latency_s - env.now)
        out[i] = env.now

    for i, m in enumerate(msgs):
        env.process(proc(i, *m))
    env.run()
    return out


@pytest.mark.parametrize("topology", ["star", "ring", "direct"])
def test_matches_simpy_resource_reference(topology):
    rng = np.random.default_rng(7)
    P = 7
    spec = NetworkSpec(topology, 3e-6, 1e9)
    msgs = []
    for _ in range(200):
        s, d = (int(x) for x in rng.integers(0, P, 2))
        msgs.append((s, d, int(rng.integers(0, 20_000)), float(rng.integers(0, 50)) * 1e-6))
    env = simpy.Environment()
    net = Network(env, P, spec)
    out = [None] * len(msgs)

    def proc(i, s, d, n, t0):
        yield env.timeout(t0)
        yield net.transfer(s, d, n)
        out[i] = env.now

    for i, m in enumerate(msgs):
        env.process(proc(i, *m))
    env.run()
    ref = _reference_resource_times(spec, P, msgs)
    for a, b in zip(out, ref):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


def test_deterministic_and_fast_at_p1024():
    import time

    def once():
        env = simpy.Environment()
        net = Network(env, 1024, PRESETS["10GbE"])
        fin = []

        def rank(p):
            for i in range(10):
                yield net.transfer(p, (p + 1 + i) % 1024, 40_000)
            fin.append((p, env.now))

        for p in range(1024):
            env.process(rank(p))
        env.run()
        return fin, net.bytes_sent.copy()

    t0 = time.perf_counter()
    a = once()
    wall = time.perf_counter() - t0
    b = once()
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
    assert int(a[1].sum()) == 1024 * 10 * 40_000
    assert wall < 5.0  # typically ~0.15 s; generous bound for slow CI machines


# ---------------------------------------------------------------- presets and busbw
def test_presets():
    assert set(PRESETS) == {"1GbE", "10GbE", "IB100"}
    a, b = get_preset("1GbE").end_to_end_alpha_beta()
    assert math.isclose(a, 0.436e-3, rel_tol=1e-12) and math.isclose(b, 9e-9, rel_tol=1e-12)
    a, b = get_preset("IB100").end_to_end_alpha_beta()
    assert math.isclose(a, 2e-6, rel_tol=1e-12) and math.isclose(b, 8e-11, rel_tol=1e-12)
    for spec in PRESETS.values():
        assert spec.topology == "star"


@pytest.mark.parametrize("P", range(2, 17))
def test_busbw_ring_allreduce_equals_link_bandwidth(P):
    beta, n, alpha = 8e-11, 4 * 25_000_000, 0.0
    seconds = 2 * (P - 1) * alpha + 2 * n * (P - 1) / P * beta
    assert math.isclose(busbw("allreduce", n, P, seconds), 1 / beta, rel_tol=1e-12)
    # allgather / reduce-scatter ring: (P-1) alpha + n (P-1)/P beta
    seconds = n * (P - 1) / P * beta
    assert math.isclose(busbw("allgather", n, P, seconds), 1 / beta, rel_tol=1e-12)
    assert math.isclose(busbw("reduce_scatter", n, P, seconds), 1 / beta, rel_tol=1e-12)
    assert math.isclose(busbw("broadcast", n, P, n * beta), 1 / beta, rel_tol=1e-12)


def test_busbw_rejects_unknown_collective_and_bad_seconds():
    with pytest.raises(SparsimError, match="'alltoall'"):
        busbw("alltoall", 100, 4, 1.0)
    with pytest.raises(SparsimError, match="seconds = 0"):
        busbw("allreduce", 100, 4, 0)


# ---------------------------------------------------------------- compute model
def test_compute_determinism_independent_of_call_order():
    kw = dict(forward_backward_s=0.1, jitter="lognormal", jitter_scale=0.3,
              straggler_prob=0.2, straggler_factor=3.0, seed=42)
    m1, m2 = ComputeModel(**kw), ComputeModel(**kw)
    keys = [(r, it) for r in range(8) for it in range(5)]
    fwd = {k: m1.seconds("forward_backward", 32, *k) for k in keys}
    rev = {k: m2.seconds("forward_backward", 32, *k) for k in reversed(keys)}
    assert fwd == rev
    assert len(set(fwd.values())) == len(keys)  # actually random
    assert ComputeModel(**{**kw, "seed": 43}).seconds("forward_backward", 32, 0, 0) != fwd[(0, 0)]
    # stragglers fixed by (seed, rank, iteration) whatever the jitter kind
    plain = ComputeModel(forward_backward_s=0.1, straggler_prob=0.2, straggler_factor=3.0, seed=42)
    slow = {k for k in keys if plain.seconds("forward_backward", 32, *k) == pytest.approx(0.3)}
    assert 0 < len(slow) < len(keys)
    for k in keys:
        assert plain.seconds("forward_backward", 32, *k) in (pytest.approx(0.1), pytest.approx(0.3))


def test_compute_no_jitter_is_exact():
    m = ComputeModel(forward_backward_s=0.25)
    assert all(m.seconds("forward_backward", 64, r, i) == 0.25 for r in range(4) for i in range(4))


def test_compute_jitter_means():
    m = ComputeModel(forward_backward_s=1.0, jitter="exponential", jitter_scale=0.5)
    xs = np.array([m.seconds("forward_backward", 1, r, 0) for r in range(4000)])
    assert xs.min() >= 1.0 and abs(xs.mean() - 1.5) < 0.05
    m = ComputeModel(forward_backward_s=1.0, jitter="lognormal", jitter_scale=0.2)
    xs = np.array([m.seconds("forward_backward", 1, r, 0) for r in range(4000)])
    assert abs(xs.mean() - 1.0) < 0.02


def test_compute_select_and_linear_kinds():
    m = ComputeModel(merge_coeff_s=1e-9, reduce_coeff_s=2e-9, update_coeff_s=3e-9)
    x = 25_600_000
    assert math.isclose(m.seconds("select", x, 0, 0), 2.19e-10 * x * math.log2(x), rel_tol=1e-15)
    assert math.isclose(m.seconds("select", 1024, 3, 7), 2.19e-10 * 1024 * 10, rel_tol=1e-15)
    assert m.seconds("select", 1, 0, 0) == 0.0 and m.seconds("select", 0, 0, 0) == 0.0
    assert m.seconds("merge", 1000, 0, 0) == pytest.approx(1e-6)
    assert m.seconds("reduce", 1000, 0, 0) == pytest.approx(2e-6)
    assert m.seconds("update", 1000, 0, 0) == pytest.approx(3e-6)
    with pytest.raises(SparsimError, match="'sort'.*forward_backward"):
        m.seconds("sort", 10, 0, 0)
    with pytest.raises(SparsimError, match="work = -1"):
        m.seconds("select", -1, 0, 0)


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: NetworkSpec("star", 1e-6, -5.0), r"link_bandwidth_Bps = -5\.0"),
        (lambda: NetworkSpec("star", 1e-6, 0), r"link_bandwidth_Bps = 0 .*0 < link_bandwidth_Bps"),
        (lambda: NetworkSpec("star", 1e-6, float("inf")), r"link_bandwidth_Bps = inf"),
        (lambda: NetworkSpec("star", -1e-6, 1e9), r"link_latency_s = -1e-06"),
        (lambda: NetworkSpec("star", 1e-6, 1e9, -1.0), r"quantum_s = -1\.0"),
        (lambda: NetworkSpec("torus", 1e-6, 1e9), r"'torus'.*star, ring, direct"),
        (lambda: NetworkSpec.from_alpha_beta(1e-6, 0.0), r"beta_s_per_byte = 0\.0"),
        (lambda: NetworkSpec.from_alpha_beta(1e-6, 1e-9, "mesh"), r"'mesh'"),
        (lambda: get_preset("25GbE"), r"'25GbE'.*1GbE, 10GbE, IB100"),
        (lambda: Network(simpy.Environment(), 0, PRESETS["1GbE"]), r"P = 0 .*1 <= P"),
        (lambda: ComputeModel(straggler_prob=1.5), r"straggler_prob = 1\.5 .*0 <= straggler_prob <= 1"),
        (lambda: ComputeModel(straggler_factor=0.5), r"straggler_factor = 0\.5"),
        (lambda: ComputeModel(forward_backward_s=-0.1), r"forward_backward_s = -0\.1"),
        (lambda: ComputeModel(jitter="gamma"), r"'gamma'"),
        (lambda: ComputeModel(seed=-1), r"seed = -1"),
    ],
)
def test_bad_inputs_raise_with_value(make, match):
    with pytest.raises(SparsimError, match=match) as info:
        make()
    assert "\n" not in str(info.value)  # one-line message


def test_config_values_raise_config_error():
    with pytest.raises(ConfigError):
        NetworkSpec("star", 1e-6, 0)
    with pytest.raises(ConfigError):
        get_preset("nope")
    with pytest.raises(ConfigError):
        ComputeModel(straggler_prob=1.5)


def test_bad_transfer_arguments():
    net = Network(simpy.Environment(), 4, PRESETS["1GbE"])
    with pytest.raises(SparsimError, match=r"src = 4 .*0 <= src <= 3"):
        net.transfer(4, 0, 10)
    with pytest.raises(SparsimError, match=r"dst = -1"):
        net.transfer(0, -1, 10)
    with pytest.raises(SparsimError, match=r"nbytes = -3"):
        net.transfer(0, 1, -3)
    with pytest.raises(SparsimError, match=r"nbytes = 2\.5"):
        net.transfer(0, 1, 2.5)
    with pytest.raises(SparsimError, match=r"P = 2\.0"):
        Network(simpy.Environment(), 2.0, PRESETS["1GbE"])
    # numpy integers are accepted
    net.transfer(np.int64(0), np.int32(1), np.int64(10))

"""The fast engine gives the message-level engine's simulated times, and reaches P in the tens of thousands."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.comm import costs
from sim.algorithms import AlgorithmSpec
from sim.machine.compute import ComputeModel
from sim.base.errors import ConfigError
from sim.engine.fastsim import FastCluster, _fifo
from sim.engine.timing import simulate_timing_fast
from sim.machine.network import NetworkSpec, get_preset
from sim.engine.timing import resolve_engine, simulate_timing
from sim.machine.topology import ClusterSpec, get_cluster_preset

JITTER = ComputeModel(forward_backward_s=0.01, jitter="lognormal", jitter_scale=0.3, straggler_prob=0.2,
                      straggler_factor=3.0, merge_coeff_s=1e-9, reduce_coeff_s=1e-9, update_coeff_s=1e-10, seed=3)


def _specs(G, k=20):
    out = [AlgorithmSpec("dense", collective="ring"), AlgorithmSpec("dense", collective="recursive_doubling"),
           AlgorithmSpec("topk", k=k), AlgorithmSpec("randk", k=k), AlgorithmSpec("gtopk", k=k, collective="tree"),
           AlgorithmSpec("gtopk", k=k, collective="recursive_doubling"),
           AlgorithmSpec("gtopk", k=k, collective="tree", mask="reference", value_bytes=8, index_bytes=8)]
    out += [AlgorithmSpec(n, k=None if n == "dense" else k, collective="hierarchical", gpus_per_node=G)
            for n in ("dense", "topk", "gtopk")]
    return out


def _networks(P, G):
    flat = {"star": NetworkSpec.from_alpha_beta(1e-4, 1e-9), "direct": NetworkSpec.from_alpha_beta(1e-4, 1e-9, "direct"),
            "ring": NetworkSpec.from_alpha_beta(1e-4, 1e-9, "ring")}
    N = P // G
    hier = {"rail": ClusterSpec(N, G, "nvswitch", 5e-6, 100e9, 5e-5, 3e9, nics_per_node=G),
            "shared-nic": ClusterSpec(N, G, "nvswitch", 5e-6, 100e9, 5e-5, 3e9, nics_per_node=1),
            "pcie": ClusterSpec(N, G, "pcie", 1e-5, 1e9, 4e-4, 1.25e8, nics_per_node=1),
            }
    if N > 2:  # leaves of 2 nodes
        hier["fat-tree"] = ClusterSpec(N, G, "nvswitch", 5e-6, 100e9, 5e-5, 3e9, nics_per_node=G, nodes_per_leaf=2,
                                       oversubscription=2.0, spine_alpha_s=2e-6)
    return {**(flat if G == 1 else {}), **hier}


CASES = [(P, G) for P in (1, 2, 3, 5, 8, 12, 16, 24, 33, 64) for G in (1, 2, 3, 4, 8) if P % G == 0 and P // G >= 1]


@pytest.mark.parametrize("P, G", CASES)
@pytest.mark.parametrize("jitter", [False, True])
def test_fast_engine_equals_message_level_engine(P, G, jitter):
    """Same simulated iteration times (1e-9 relative; observed bit-identical), messages and bytes, on star,
    ring, direct and hierarchical clusters, contended (shared NICs, PCIe, fat tree, ring) or not, with and
    without jitter and stragglers, for every collective."""
    cm = JITTER if jitter else None
    d = 999 if P < 64 else 640
    for name, net in _networks(P, G).items():
        for spec in _specs(G):
            if spec.collective == "hierarchical" and not isinstance(net, ClusterSpec):
                continue
            a = simulate_timing(spec, P, d, network=net, compute=cm, iterations=2, engine="message")
            b = simulate_timing(spec, P, d, network=net, compute=cm, iterations=2, engine="fast")
            what = f"{name} {spec.name}/{spec.collective} P={P} G={G}"
            np.testing.assert_allclose(b.iter_s, a.iter_s, rtol=1e-9, atol=0, err_msg=what)
            assert (b.messages, b.bytes) == (a.messages, a.bytes), what
            assert b.comm_s == pytest.approx(a.comm_s, rel=1e-9, abs=1e-15), what
            assert b.compute_s == pytest.approx(a.compute_s, rel=1e-9, abs=1e-15), what


def test_contended_rounds_are_replayed_event_by_event_and_stay_exact():
    """Recursive doubling on 3-GPU nodes sharing a NIC: a round's head reaches the NIC no later than one of
    the previous round's, so the step is replayed message by message in time order (the fallback that keeps
    the engine exact), and the result is still the message-level engine's."""
    from sim.engine.fastsim import fast_iteration

    net = ClusterSpec(8, 3, "nvswitch", 5e-6, 100e9, 5e-5, 3e9, nics_per_node=1)
    spec = AlgorithmSpec("dense", collective="recursive_doubling")
    want = simulate_timing(spec, 24, 999, network=net, engine="message").iter_s[0]
    fast = FastCluster(24, net)
    fast.step(lambda e: fast_iteration(e, spec, 999, 1, 1))
    assert fast.event_replays == 1
    assert fast.ready.max() == pytest.approx(want, rel=1e-12)
    replay = FastCluster(24, net)  # the event replay alone, from recorded rounds
    replay._ops = []
    fast_iteration(replay, spec, 999, 1, 1)
    ops, replay._ops = replay._ops, None
    again = FastCluster(24, net)
    again._event_replay(ops)
    assert again.ready.max() == pytest.approx(want, rel=1e-12)
    assert (again.messages, again.bytes) == (fast.messages, fast.bytes)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(1, 5), st.integers(0, 25)),
                min_size=1, max_size=40))
def test_fifo_scan_equals_the_sequential_lindley_recursion(msgs):
    links = np.array([m[0] for m in msgs])
    head = np.array([float(m[1]) for m in msgs])
    hold = np.array([float(m[2]) for m in msgs])
    tail = np.array([float(m[3]) if m[3] > 10 else -np.inf for m in msgs])
    free = np.array([0.0, 5.0, 2.0, 30.0])
    order = np.arange(len(msgs))
    start, end, _ = _fifo(links, head, hold, tail, free.copy(), order, np.full(4, -np.inf))
    f = free.copy()
    for i in sorted(range(len(msgs)), key=lambda i: (links[i], head[i], i)):
        s = max(head[i], f[links[i]])
        e = max(s + hold[i], tail[i])
        f[links[i]] = e
        assert (start[i], end[i]) == (s, e)


@pytest.mark.parametrize("P", [4096, 16384, 65536])
def test_logarithmic_collectives_at_scale_equal_their_closed_forms(P):
    net = get_preset("1GbE")
    alpha, beta = net.end_to_end_alpha_beta()
    d, k = 25_000_000, 25_000
    for spec, closed in ((AlgorithmSpec("topk", k=k), costs.topk_allgather_time(P, k, alpha, beta)),
                         (AlgorithmSpec("gtopk", k=k), costs.gtopk_tree_time(P, k, alpha, beta)),
                         (AlgorithmSpec("gtopk", k=k, collective="recursive_doubling"),
                          costs.gtopk_rd_time(P, k, alpha, beta))):
        t = simulate_timing_fast(spec, P, d, network=net).iter_s[0]
        assert t == pytest.approx(closed, rel=1e-9)
    if P <= 16384:
        dgx = get_cluster_preset("dgx-h100", P)
        spec = AlgorithmSpec("gtopk", k=k, collective="hierarchical", gpus_per_node=8)
        t = simulate_timing_fast(spec, P, d, network=dgx).iter_s[0]
        assert t == pytest.approx(costs.hier_gtopk_time(P // 8, 8, k, *dgx.intra_alpha_beta(),
                                                        *dgx.inter_alpha_beta()), rel=1e-9)


def test_dense_ring_at_4096_equals_its_closed_form():
    net = get_preset("1GbE")
    alpha, beta = net.end_to_end_alpha_beta()
    t = simulate_timing_fast(AlgorithmSpec("dense"), 4096, 25_000_000, network=net).iter_s[0]
    assert t == pytest.approx(costs.ring_allreduce_time(4096, 25_000_000, alpha, beta), rel=1e-9)


def test_engine_choice():
    star = get_preset("1GbE")
    quantised = NetworkSpec("star", 1e-6, 1e9, 1e-9)
    assert resolve_engine("auto", star) == "fast"
    assert resolve_engine("auto", quantised) == "message"
    assert resolve_engine("message", star) == "message"
    with pytest.raises(ConfigError, match="engine = fast: quantum_s = 1e-09 is not modelled by the fast engine"):
        resolve_engine("fast", quantised)
    # same-instant heads at shared links cascade differently in the two engines: refused, auto takes message
    tied = ClusterSpec(6, 2, "nvswitch", 5e-6, 100e9, 5e-5, 3e9, nics_per_node=2, nodes_per_leaf=2)  # spine 0 s
    assert resolve_engine("auto", tied) == "message"
    with pytest.raises(ConfigError, match="positive latency on shared links"):
        resolve_engine("fast", tied)
    assert resolve_engine("auto", NetworkSpec.from_alpha_beta(0.0, 1e-9, "ring")) == "message"
    assert resolve_engine("auto", NetworkSpec.from_alpha_beta(0.0, 1e-9, "star")) == "fast"  # nothing shared
    assert resolve_engine("auto", ClusterSpec(6, 2, "nvswitch", 0.0, 100e9, 0.0, 3e9, nics_per_node=2)) == "fast"
    with pytest.raises(ConfigError, match="engine = 'warp' is unknown: valid engines are auto, message, fast"):
        resolve_engine("warp", star)
    with pytest.raises(ConfigError, match="P = 8 but the cluster has 2 x 8 = 16 ranks"):
        FastCluster(8, get_cluster_preset("dgx-h100", 16))


def test_hierarchical_collective_must_use_the_cluster_nodes():
    """One source of G: a hierarchical collective whose gpus_per_node is not the cluster's (or a flat network)
    is refused by both engines instead of silently grouping ranks differently."""
    cs = ClusterSpec(2, 4, nics_per_node=4)
    for engine in ("message", "fast"):
        with pytest.raises(ConfigError, match="gpus_per_node = 1 of the dense hierarchical collective differs"):
            simulate_timing(AlgorithmSpec("dense", collective="hierarchical"), 8, 100, network=cs, engine=engine)
        with pytest.raises(ConfigError, match="needs a hierarchical cluster"):
            simulate_timing(AlgorithmSpec("gtopk", k=4, collective="hierarchical", gpus_per_node=4), 8, 100,
                            network=get_preset("1GbE"), engine=engine)


def test_comm_time_is_never_negative_at_p1():
    r = simulate_timing_fast(AlgorithmSpec("dense"), 1, 1000, network=get_preset("1GbE"), compute=JITTER, iterations=3)
    assert r.comm_s == 0.0

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


def _every_column(G, k):
    """Every (algorithm, collective) sparsim predict times on a cluster, as specs (hierarchical ones with G)."""
    from sim.algorithms import REGISTRY, predict_columns

    return [AlgorithmSpec(name, k=k if REGISTRY[name].sparse else None, collective=coll,
                          **({"gpus_per_node": G} if coll == "hierarchical" else {}))
            for name, coll in dict.fromkeys(predict_columns(True).values())]


@pytest.mark.parametrize("P, G", [(16, 4), (24, 3), (12, 1)])
def test_every_collective_on_clusters_equals_the_message_level_engine(P, G, monkeypatch):
    """Every registered collective (Ok-Topk's P - 1 shifted rounds, SparCML's pairwise split rounds, the rings
    of dense, CLT-k and PowerSGD, hierarchical ones) on unshared clusters (rail-optimised NICs: the per-class
    path costs and the rotation gathers; G = 3: nodes found by //, not a shift; G = 1 with PCIe: four latencies
    per path) and shared ones (a fat tree of 2-node leaves, PCIe staging through a shared NIC), with merge and
    reduce costs: the fast engine gives the message-level engine's times at 1e-9, also with the sliced tables
    of read-only size arrays forced on at every P (_SLICE_MIN = 1)."""
    import sim.engine.fastsim as fs

    monkeypatch.setattr(fs, "_SLICE_MIN", 1)
    N = P // G
    nets = {"rail": ClusterSpec(N, G, "nvswitch", 5e-6, 100e9, 5e-5, 3e9, nics_per_node=G),
            "fat-tree": ClusterSpec(N, G, "nvswitch", 5e-6, 100e9, 5e-5, 3e9, nics_per_node=G, nodes_per_leaf=2,
                                    oversubscription=2.0, spine_alpha_s=2e-6),
            "pcie": ClusterSpec(N, G, "pcie", 1e-5, 1e9, 4e-4, 1.25e8, nics_per_node=1)}
    d = 999
    for name, net in nets.items():
        assert bool(net.shared_levels()) == (name != "rail" and not (name == "pcie" and G == 1)), name
        for spec in _every_column(G, 20):
            a = simulate_timing(spec, P, d, network=net, compute=JITTER, iterations=2, engine="message")
            b = simulate_timing(spec, P, d, network=net, compute=JITTER, iterations=2, engine="fast")
            what = f"{name} {spec.name}/{spec.collective} P={P} G={G}"
            np.testing.assert_allclose(b.iter_s, a.iter_s, rtol=1e-9, atol=0, err_msg=what)
            assert (b.messages, b.bytes) == (a.messages, a.bytes), what


@pytest.mark.parametrize("net", [ClusterSpec(6, 8, "nvswitch", 3e-6, 450e9, 5e-6, 50e9, nics_per_node=8),
                                 ClusterSpec(8, 3, "nvswitch", 5e-6, 100e9, 5e-5, 3e9, nics_per_node=3),
                                 ClusterSpec(40, 1, "pcie", 1e-5, 1e9, 4e-4, 1.25e8),
                                 ClusterSpec(40, 1, "nvswitch", 1e-5, 1e9, 4e-4, 1.25e8)])
def test_path_costs_by_class_are_the_per_link_sums_bit_for_bit(net):
    """On an unshared cluster the fast engine looks a message's (summed latency, 1 / slowest bandwidth) up by its
    class (self, same node, other node) instead of summing its route's links: the same floats, bit for bit, as the
    per-link expression on the full routes, for random matchings of every size, rotations (r -> r + c, the
    periodic shortcut) and a uniform round (scalars)."""
    P = net.P
    eng = FastCluster(P, net)
    assert eng._classes is not None
    rng = np.random.default_rng(5)
    cases = [(np.arange(P), (np.arange(P) + c) % P, c) for c in range(P)]
    for m in (1, 2, 7, P // 2, P):
        s = rng.choice(P, m, replace=False)
        cases.append((s, rng.permutation(P)[:m], None))
    for s, d, rot in cases:
        L, inv = eng._path_sums(net.routes(s, d))
        route = eng._route(s, d, rot)
        assert route[0] == "sum"
        got_L, got_inv = np.broadcast_to(route[1], L.shape), np.broadcast_to(route[2], L.shape)
        assert np.array_equal(got_L, L) and np.array_equal(got_inv, inv), (s, d, rot)
        if route[3] is not None:  # per-class tables: the scalar-size look-up is the same L + n inv
            n = 12345
            assert np.array_equal(np.take(route[4] + n * route[5], route[3]), L + n * inv)


def test_sliced_tables_at_scale_are_bit_identical_to_direct_evaluation(monkeypatch):
    """At P = 4096 on dgx-h100 (the rings' sizes are slices of read-only tables, so costs and reduce seconds are
    sliced from tables built once) the times equal, bit for bit, those with the tables turned off."""
    import sim.engine.fastsim as fs

    net = get_cluster_preset("dgx-h100", 4096)
    cm = ComputeModel(forward_backward_s=0.0, select_coeff_s=0.0, merge_coeff_s=3e-10, reduce_coeff_s=1e-10)
    d = 25_557_032
    specs = [AlgorithmSpec("dense"), AlgorithmSpec("dense", collective="hierarchical", gpus_per_node=8)]
    on = [simulate_timing_fast(s, 4096, d, network=net, compute=cm).iter_s[0] for s in specs]
    monkeypatch.setattr(fs, "_SLICE_MIN", 1 << 62)
    off = [simulate_timing_fast(s, 4096, d, network=net, compute=cm).iter_s[0] for s in specs]
    assert on == off
    assert on[0] == pytest.approx(costs.ring_allreduce_time(4096, d, 5e-6, 1 / 50e9), rel=0.2)  # sanity: the ring


def test_a_round_that_is_not_a_matching_is_refused():
    """A rotation whose receives are not its inverse, and a general round with a wrong receiver, are pattern bugs."""
    eng = FastCluster(8, ClusterSpec(2, 4, nics_per_node=4))
    R = np.arange(8)
    with pytest.raises(RuntimeError, match="do not match"):
        eng.exchange((R + 1) % 8, (R + 1) % 8, 10)
    with pytest.raises(RuntimeError, match="do not match"):
        eng.exchange(R ^ 1, R ^ 2, 10)
    dst = np.full(8, -1)
    dst[0] = 3
    src = np.full(8, -1)
    src[3] = 1
    with pytest.raises(RuntimeError, match="do not match"):
        eng.exchange(dst, src, 10)
    eng.exchange((R + 1) % 8, (R - 1) % 8, 10)  # a real ring round goes through
    assert eng.messages == 8


@pytest.mark.parametrize("P, G", [(1, 1), (2, 1), (7, 1), (12, 3), (16, 4), (10, 5)])
def test_shifted_ring_rounds_are_the_ring_schedules_rounds(P, G):
    """The ring's rounds read once on position 0 with sizes sliced from a doubled chunk table
    (sim.comm.rounds.shifted_ring_rounds) equal, array by array, ring_rounds on every position's schedule: the flat
    ring of ring_allreduce_rounds and the inter-node ring of hier_allreduce_rounds (chunk sizes per local index)."""
    from sim.comm import collectives as C
    from sim.comm import rounds as V

    def same(a, b):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert type(x) is type(y)
            if isinstance(x, V.Round):
                assert np.array_equal(x.dst, y.dst) and np.array_equal(x.src, y.src)
                assert np.array_equal(np.broadcast_to(x.nbytes, (P,)), np.broadcast_to(y.nbytes, (P,)))
            else:
                assert x.kind == y.kind and np.array_equal(x.work, y.work)

    R = np.arange(P, dtype=np.int64)
    for n in (1, P - 1 if P > 1 else 1, 3 * P + 2, 1001):
        same(list(V.ring_allreduce_rounds(R, P, n, 4)),
             list(V.ring_rounds(C.ring_schedule(R, P), V.mapper(1, 0), lambda c: V.chunk_size(n, P, c), 4)))
        local, node, N = R % G, R // G, P // G
        own = V.chunk_size(n, G, (local + 1) % G)
        old = list(V.ring_rounds(C.ring_schedule(node, N), V.mapper(G, local), lambda c: V.chunk_size(own, N, c), 8))
        own_l = V.chunk_size(n, G, (np.arange(G) + 1) % G)
        same(list(V.shifted_ring_rounds(node, N, G, V.chunk_size(own_l[None, :], N, np.arange(N)[:, None]), 8)), old)


def test_rotation_routes_shared_across_engines_give_the_same_bits():
    """Ok-Topk's P - 1 rotations on a shared fabric (gtopk-icdcs: 4 GPUs share a NIC and PCIe) build their routes
    once per cluster (sim.engine.fastsim.ROTATION_ROUTES) and every later engine reuses them: its times equal the
    first engine's bit for bit and the message-level engine's at 1e-9."""
    from sim.engine import fastsim as fs
    from sim.engine.timing import simulate_timing
    from sim.machine.topology import get_cluster_preset

    P = 16
    net = get_cluster_preset("gtopk-icdcs", P)
    cm = ComputeModel(forward_backward_s=0.0, select_coeff_s=0.0, reduce_coeff_s=1e-9, merge_coeff_s=1e-9)
    spec = AlgorithmSpec("oktopk", k=40)
    fs.ROTATION_ROUTES.clear()
    first = simulate_timing(spec, P, 2000, network=net, compute=cm, iterations=2, engine="fast").iter_s
    assert len(fs.ROTATION_ROUTES.entries) == P - 1  # every rotation r -> r + c, c = 1..P-1
    again = simulate_timing(spec, P, 2000, network=net, compute=cm, iterations=2, engine="fast").iter_s
    assert np.array_equal(first, again)
    msg = simulate_timing(spec, P, 2000, network=net, compute=cm, iterations=2, engine="message").iter_s
    np.testing.assert_allclose(first, msg, rtol=1e-9, atol=0)

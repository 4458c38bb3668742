"""Hierarchical clusters: closed forms, the contention hand check, exact error feedback, presets, bad input."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.comm import collectives as C
from sim.comm import costs
from sim.engine.cluster import SimCluster
from sim.comm.compression import Sparse, topk
from sim.engine.drivers import run_lockstep
from sim.base.errors import ConfigError, SparsimError
from sim.engine.fastsim import FastCluster
from sim.base.ops import Recv, Send
from sim.machine.topology import CLUSTER_PRESETS, ClusterSpec, get_cluster_preset

REL = 1e-12


def _rail(N, G):
    """A contention-free hierarchical cluster: one NIC per GPU, NVSwitch inside."""
    return ClusterSpec(N, G, "nvswitch", 5e-6, 100e9, 50e-6, 3e9, nics_per_node=G)


def _ab(cs):
    return (*cs.intra_alpha_beta(), *cs.inter_alpha_beta())


@pytest.mark.parametrize("N", range(1, 10))
@pytest.mark.parametrize("G", range(1, 9))
def test_hierarchical_collectives_equal_their_closed_forms(N, G):
    cs = _rail(N, G)
    P = cs.P
    rng = np.random.default_rng(N * 10 + G)
    d = 12 * G * N
    xs = rng.standard_normal((P, d))
    res, fin = SimCluster(P, cs).run_programs([C.hier_allreduce(r, P, G, xs[r]) for r in range(P)])
    assert fin.max() == pytest.approx(costs.hier_allreduce_time(N, G, d, *_ab(cs)), rel=REL)
    if N > 1 and G > 1:  # docs/costs.md's form with n = 4 d bytes
        ai, bi, ae, be = _ab(cs)
        n = 4 * d
        assert fin.max() == pytest.approx(2 * (G - 1) * (ai + n / G * bi) + 2 * (N - 1) * (ae + n / (G * N) * be),
                                          rel=REL)
    assert all(np.array_equal(res[0], x) for x in res)
    np.testing.assert_allclose(res[0], xs.sum(axis=0), rtol=1e-12, atol=1e-12)
    k, dd = 16, 400
    sels = [topk(rng.standard_normal(dd), k) for _ in range(P)]
    _, fin = SimCluster(P, cs).run_programs([C.hier_topk_allgather_sum(r, P, G, sels[r]) for r in range(P)])
    assert fin.max() == pytest.approx(costs.hier_topk_time(N, G, k, *_ab(cs)), rel=REL)
    for exact in (True, False):
        _, fin = SimCluster(P, cs).run_programs([C.hier_gtopk(r, P, G, sels[r], k, exact=exact) for r in range(P)])
        assert fin.max() == pytest.approx(costs.hier_gtopk_time(N, G, k, *_ab(cs), exact=exact), rel=REL)


def test_hierarchical_closed_forms_reduce_to_the_flat_ones():
    a, b = 0.436e-3, 9e-9
    for P in (1, 2, 3, 7, 8, 33):
        assert costs.hier_gtopk_time(P, 1, 25, a, b, a, b) == costs.gtopk_rd_time(P, 25, a, b)
        assert costs.hier_allreduce_time(P, 1, 24 * P, a, b, a, b) == pytest.approx(
            costs.ring_allreduce_time(P, 24 * P, a, b), rel=REL)
        assert costs.hier_allreduce_time(1, P, 24 * P, a, b, a, b) == pytest.approx(
            costs.ring_allreduce_time(P, 24 * P, a, b), rel=REL)


# ------------------------------------------------------------------------------------------ contention by hand

def _off_node_burst(cs, G, m):
    """Ranks 0..G-1 (node 0) each send m bytes to rank G + r (node 1) at once; finish times of the receivers."""
    P = cs.P

    def prog(r):
        if r < G:
            yield Send(r + G, None, m)
        else:
            yield Recv(r - G)

    return SimCluster(P, cs).run_programs([prog(r) for r in range(P)])[1][G:]


@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_shared_nic_serialises_and_rails_do_not(G):
    """docs/costs.md hand check: G ranks of one node sending m bytes off-node at once through one shared NIC: the
    last finishes at alpha_e + G m beta_e; with one NIC per GPU all finish at alpha_e + m beta_e."""
    alpha, beta, m = 0.436e-3, 9e-9, 1_000_000  # 1 GbE
    shared = ClusterSpec(2, G, "nvswitch", 5e-6, 100e9, alpha, 1 / beta, nics_per_node=1)
    rail = ClusterSpec(2, G, "nvswitch", 5e-6, 100e9, alpha, 1 / beta, nics_per_node=G)
    one = alpha + m * beta
    fin = _off_node_burst(shared, G, m)
    assert fin.max() == pytest.approx(alpha + G * m * beta, rel=REL)
    assert np.sort(fin) == pytest.approx([alpha + (i + 1) * m * beta for i in range(G)], rel=REL)
    assert _off_node_burst(rail, G, m) == pytest.approx([one] * G, rel=REL)
    if G == 4:
        assert fin.max() - alpha == pytest.approx(4 * (one - alpha), rel=REL)  # 4 times as long as one
    for cs, want in ((shared, alpha + G * m * beta), (rail, one)):  # the fast engine, same round
        eng = FastCluster(cs.P, cs)
        r = np.arange(cs.P)
        eng.exchange(np.where(r < G, r + G, -1), np.where(r >= G, r - G, -1), m)
        assert eng.ready.max() == pytest.approx(want, rel=REL)


def test_pcie_inter_node_path_crosses_the_gpu_links_and_shares_them():
    cs = ClusterSpec(2, 2, "pcie", 10e-6, 1e9, 0.426e-3, 1 / 9e-9)
    a, b = cs.inter_alpha_beta()
    assert (a, b) == pytest.approx((0.436e-3, 9e-9), rel=REL)
    assert cs.route(0, 2) == [0, 2 * 4 + 0, 2 * 4 + 2 + 1, 4 + 2]  # gpu_up 0, nic_up node 0, nic_down node 1, gpu_down 2
    assert cs.route(0, 1) == [0, 4 + 1]
    assert cs.shared_levels() == (0, 1, 4, 5)


# ------------------------------------------------------------------------------------------ exact error feedback

@st.composite
def _case(draw):
    G = draw(st.integers(1, 4))
    N = draw(st.integers(1, 4))
    d = draw(st.integers(4, 40))
    k = draw(st.integers(1, d))
    vals = draw(st.lists(st.integers(-3, 3), min_size=N * G * d, max_size=N * G * d))  # ties and zeros
    return G, N, k, np.array(vals, dtype=np.float64).reshape(N * G, d)


@settings(max_examples=60, deadline=None)
@given(_case())
def test_hierarchical_sparse_collectives_conserve_mass_and_agree_on_every_rank(case):
    G, N, k, acc = case
    P, d = G * N, acc.shape[1]
    sels = [topk(a, k) for a in acc]
    for exact in (True, False):
        res = run_lockstep([C.hier_gtopk(r, P, G, sels[r], k, exact=exact) for r in range(P)])
        g = res[0].g
        assert all(np.array_equal(x.g.idx, g.idx) and np.array_equal(x.g.val, g.val) for x in res)
        assert len(g) <= k
        resid = acc.copy()
        for r in range(P):
            resid[r, sels[r].idx[res[r].applied]] = 0.0
        if exact:  # sum of accumulators = applied update + sum of residuals, exactly (integers)
            assert np.array_equal(acc.sum(axis=0), g.to_dense() + resid.sum(axis=0))
        else:  # the released rule applies an entry iff its index is in g
            for r in range(P):
                assert np.array_equal(res[r].applied, np.isin(sels[r].idx, g.idx))
    flat = run_lockstep([C.topk_allgather_sum(r, P, sels[r]) for r in range(P)])
    hier = run_lockstep([C.hier_topk_allgather_sum(r, P, G, sels[r]) for r in range(P)])
    assert all(np.array_equal(h, flat[0]) for h in hier)  # same additions in the same order
    dense = run_lockstep([C.hier_allreduce(r, P, G, acc[r]) for r in range(P)])
    assert all(np.array_equal(x, dense[0]) for x in dense)
    assert np.array_equal(dense[0], acc.sum(axis=0))


def test_hierarchical_gtopk_on_one_node_or_one_rank_per_node_is_the_flat_global_selection():
    rng = np.random.default_rng(0)
    P, k = 6, 5
    sels = [topk(rng.standard_normal(50), k) for _ in range(P)]
    want = run_lockstep([C.gtopk_rd(r, P, sels[r], k) for r in range(P)])[0].g
    for G in (1,):
        got = run_lockstep([C.hier_gtopk(r, P, G, sels[r], k) for r in range(P)])[0].g
        assert np.array_equal(got.idx, want.idx) and np.array_equal(got.val, want.val)
    tree = run_lockstep([C.gtopk_tree(r, P, sels[r], k) for r in range(P)])[0].g
    got = run_lockstep([C.hier_gtopk(r, P, P, sels[r], k) for r in range(P)])[0].g  # one node: the binomial tree
    assert np.array_equal(got.idx, tree.idx)


# ------------------------------------------------------------------------------------------ presets and bad input

def test_presets_and_their_numbers():
    icdcs = get_cluster_preset("gtopk-icdcs", 32)
    assert (icdcs.nodes, icdcs.gpus_per_node, icdcs.nics_per_node, icdcs.intra) == (8, 4, 1, "pcie")
    assert icdcs.inter_alpha_beta() == pytest.approx((0.436e-3, 9e-9), rel=REL)  # the released scripts' 1GbE fit
    v100 = get_cluster_preset("v100-25GbE", 128)
    assert (v100.nodes, v100.gpus_per_node, v100.nics_per_node) == (16, 8, 1)
    assert v100.inter_bandwidth_Bps == pytest.approx(0.9 * 25e9 / 8)
    dgx = get_cluster_preset("dgx-h100", 4096)
    assert (dgx.nodes, dgx.gpus_per_node, dgx.nics_per_node) == (512, 8, 8)
    assert dgx.inter_bandwidth_Bps == 50e9 and dgx.intra_bandwidth_Bps == 450e9
    assert set(CLUSTER_PRESETS) == {"gtopk-icdcs", "v100-25GbE", "dgx-h100"}


@pytest.mark.parametrize("make, needle", [
    (lambda: get_cluster_preset("dgx-h100", 12), "P = 12 is not a multiple of gpus_per_node = 8"),
    (lambda: ClusterSpec(0, 4), "nodes = 0 is out of range: valid 1 <= nodes"),
    (lambda: get_cluster_preset("dgx-a100"), "cluster preset = 'dgx-a100' is unknown: valid presets are"),
    (lambda: ClusterSpec(2, 4, intra_bandwidth_Bps=0.0), "intra_bandwidth_Bps = 0.0 is out of range: valid 0 < intra_bandwidth_Bps"),
    (lambda: ClusterSpec(2, 4, oversubscription=0.5), "oversubscription = 0.5 is out of range: valid 1 <= oversubscription"),
    (lambda: ClusterSpec(2, 4, nics_per_node=3), "nics_per_node = 3 does not divide gpus_per_node = 4"),
    (lambda: ClusterSpec(2, 4, intra="nvlink"), "intra = 'nvlink' is unknown"),
    (lambda: ClusterSpec(2, 4, nodes_per_leaf=5), "nodes_per_leaf = 5 leaves one leaf for nodes = 2"),
    (lambda: ClusterSpec(4, 4, spine_alpha_s=0.5), "describe a fat tree, which nodes_per_leaf = 0 turns off"),
    (lambda: ClusterSpec(4, 4, oversubscription=4.0), "describe a fat tree, which nodes_per_leaf = 0 turns off"),
    (lambda: ClusterSpec(2, 4, intra_alpha_s=1e308), "intra_alpha_s = 1e+308 is out of range: valid 0 <= intra_alpha_s <= 10"),
    (lambda: ClusterSpec(2, 4, inter_bandwidth_Bps=1e300), "inter_bandwidth_Bps = 1e+300 is out of range"),
])
def test_bad_cluster_values_name_the_value_and_the_range(make, needle):
    with pytest.raises(ConfigError, match=None) as err:
        make()
    assert needle in str(err.value)


def test_hierarchical_collective_needs_g_dividing_p():
    with pytest.raises(SparsimError, match="gpus_per_node = 4 does not divide P = 6"):
        run_lockstep([C.hier_gtopk(r, 6, 4, Sparse(np.array([0]), np.array([1.0]), 5), 1) for r in range(6)])


# ------------------------------------------------------------------------------------------ command line

def _cli(args):
    from click.testing import CliRunner

    from experiments.cli import main

    return CliRunner().invoke(main, args)


def test_readme_key_table_is_the_schema():
    """The README's key table is what ``sparsim scenario keys`` prints (units, ranges, the new cluster keys)."""
    from pathlib import Path

    r = _cli(["scenario", "keys"])
    assert r.exit_code == 0
    readme = (Path(__file__).resolve().parents[1] / "docs" / "scenarios.md").read_text()
    assert r.output.strip() in readme
    for key in ("cluster.gpus_per_node", "cluster.nics_per_node", "cluster.intra_bandwidth_Bps",
                "cluster.oversubscription", "cluster.engine", "compression.topk_collective"):
        assert f"`{key}`" in r.output


@pytest.mark.parametrize("sets, needle", [
    (["cluster.network=\"hierarchical\"", "cluster.gpus_per_node=3", "cluster.P=8"],
     "cluster.P = 8 is not a multiple of gpus_per_node = 3"),
    (["cluster.network=\"dgx-h100\"", "cluster.P=12"], "cluster.P = 12 is not a multiple of gpus_per_node = 8"),
    (["cluster.network=\"dgx-a100\""], "cluster.network = 'dgx-a100' is unknown: valid 1GbE"),
    (["cluster.network=\"hierarchical\"", "cluster.intra_bandwidth_Bps=0"], "cluster.intra_bandwidth_Bps = 0"),
    (["cluster.network=\"hierarchical\"", "cluster.oversubscription=0.5"], "cluster.oversubscription = 0.5"),
    (["cluster.network=\"hierarchical\"", "cluster.gpus_per_node=0"], "cluster.gpus_per_node = 0"),
    (["cluster.gpus_per_node=4"], "cluster.gpus_per_node: describes a hierarchical cluster, used only with network"),
    (["cluster.engine=\"fast\""], "cluster.engine = 'fast' simulates timing-only iterations"),
    (["cluster.network=\"dgx-h100\"", "cluster.quantum_s=1e-9"], "cluster.quantum_s = 1e-09 applies to flat networks"),
    (["cluster.network=\"dgx-h100\"", "cluster.alpha_s=1.0"], "cluster.alpha_s: used only with network = 'custom' or"),
    (["cluster.network=\"hierarchical\"", "cluster.topology=\"ring\""], "cluster.topology: used only with network = 'custom'"),
    (["cluster.network=\"hierarchical\"", "cluster.gpus_per_node=4", "cluster.intra_alpha_s=1e308"],
     "cluster.intra_alpha_s = 1e+308"),
    (["compression.gtopk_collective=\"hierarchical\""],
     "compression.gtopk_collective = 'hierarchical' needs a hierarchical cluster"),
])
def test_bad_cluster_scenarios_are_one_line_exit_2_and_leave_nothing(tmp_path, sets, needle):
    out = tmp_path / "run"
    r = _cli(["run", "--out", str(out), "--quiet", *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_run_on_a_cluster_preset_with_the_hierarchical_collectives(tmp_path):
    import json

    out = tmp_path / "run"
    r = _cli(["run", "--out", str(out), "--set", "cluster.network=\"gtopk-icdcs\"", "--set", "training.iterations=3",
              "--set", "compression.dense_collective=\"hierarchical\"", "--set", "compression.topk_collective=\"hierarchical\"",
              "--set", "compression.gtopk_collective=\"hierarchical\""])
    assert r.exit_code == 0, r.output
    assert "cluster gtopk-icdcs 2 x 4 (pcie, 1 NIC/node)" in r.output and "engine message" in r.output
    net = json.loads((out / "summary.json").read_text())["resolved"]["network"]
    assert (net["nodes"], net["gpus_per_node"], net["engine"]) == (2, 4, "message")
    assert net["alpha_s"] == pytest.approx(0.436e-3) and net["beta_s_per_byte"] == pytest.approx(9e-9)


def test_predict_simulate_on_the_dgx_preset_prints_simulated_and_closed_forms():
    r = _cli(["predict", "--simulate", "--network", "dgx-h100", "--P", "64,4096",
              "--collectives", "hier_dense,hier_gtopk,allgather"])
    assert r.exit_code == 0, r.output
    rows = [ln.split() for ln in r.output.splitlines() if ln.strip().split()[:1] in (["64"], ["4096"])]
    assert len(rows) == 6
    for row in rows:  # contention-free rail cluster: the hierarchical collectives equal their closed forms
        if row[1].startswith("hier_"):
            assert float(row[2]) == pytest.approx(float(row[3]), rel=1e-5)
    dgx = get_cluster_preset("dgx-h100", 4096)
    want = costs.hier_gtopk_time(512, 8, 25_000, *dgx.intra_alpha_beta(), *dgx.inter_alpha_beta())
    got = [float(r_[2]) for r_ in rows if r_[:2] == ["4096", "hier_gtopk"]][0]
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("args, needle", [
    (["--network", "dgx-h100", "--P", "12"], "P = 12 is not a multiple of gpus_per_node = 8"),
    (["--network", "nope"], "--network 'nope' is unknown"),
    (["--P", "70000"], "P = 70000 is out of range: valid 1 <= P <= 65536"),
    (["--collectives", "hier_gtopk"], "hier_gtopk needs a cluster preset"),
    (["--collectives", "warp"], "'warp' is unknown"),
    (["--collectives", " , "], "names none"),
    (["--engine", "fast"], "valid only with --simulate"),
    (["--d", "100000000000000000000"], "is out of range: valid 1 <= d <= 1000000000000"),
])
def test_predict_bad_input(args, needle):
    r = _cli(["predict", *args])
    assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_predict_defaults_to_p_that_fit_the_preset():
    r = _cli(["predict", "--network", "dgx-h100"])
    assert r.exit_code == 0, r.output
    Ps = [int(ln.split()[0]) for ln in r.output.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert Ps == [8, 16, 32, 64, 128, 256]


def test_cluster_links_carry_one_message_per_rank_and_direction():
    """The unshared links of a hierarchical cluster are uncontended because a rank has one message out and one
    in at a time (rendezvous); a direct incast through Network.transfer is refused rather than mis-timed, and
    the links' busy time is accounted."""
    import simpy

    from sim.machine.network import Network

    env = simpy.Environment()
    net = Network(env, 4, ClusterSpec(4, 1))
    net.transfer(1, 0, 1_000_000)
    with pytest.raises(SparsimError, match="one message at a time out of each rank and into each rank"):
        net.transfer(2, 0, 1_000_000)
    env.run()
    net.transfer(2, 0, 1_000_000)  # the first has arrived: fine
    env.run()
    up = 2 * 4 + 2  # nic_up of node 2
    assert net.link_busy_s[up] == pytest.approx(1_000_000 * 9e-9)


def test_a_scenario_survives_its_own_dump():
    """The torch ranks rebuild the scenario from model_dump(): every key is then set, at its default where the
    user gave none, which must not trip the 'key used only with network = ...' rule."""
    from experiments.scenario import Scenario, load_scenario

    for ov in ([], ["cluster.network=\"hierarchical\"", "cluster.gpus_per_node=4", "cluster.alpha_s=1e-5"],
               ["cluster.network=\"dgx-h100\"", "cluster.P=16"]):
        sc = load_scenario(None, ov)
        assert Scenario.model_validate(sc.model_dump()) == sc

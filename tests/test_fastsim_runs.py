"""Runs of named rounds (sim.comm.rounds.Round.pattern) evaluated whole by the fast engine give the bits of the
round-by-round evaluation: rings and folded rotations in compiled loops on unshared fabrics, and phases reused from
sim.engine.fastsim.PHASES on shared ones; and every producer's names keep their promise."""
import numpy as np
import pytest

from sim.algorithms import REGISTRY, AlgorithmSpec
from sim.base.errors import SparsimError
from sim.comm.rounds import SKIP_RING, RingTable, Round, Work
from sim.engine import fastsim as fs
from sim.engine.fastsim import FastCluster, fast_iteration
from sim.machine.compute import ComputeModel
from sim.machine.network import NetworkSpec
from sim.machine.topology import ClusterSpec, get_cluster_preset

FREE = ComputeModel(forward_backward_s=0.0, select_coeff_s=0.0)
COSTS = ComputeModel(forward_backward_s=1e-3, select_coeff_s=1e-11, reduce_coeff_s=4.1e-12, merge_coeff_s=1.7e-11,
                     update_coeff_s=4.1e-12)


def _timed(name: str, P: int, G: int):
    """Every timing-capable collective of algorithm ``name``: AlgorithmSpecs (k = 37 for sparse ones)."""
    a = REGISTRY[name]
    out = []
    for coll in a.collectives:
        spec = AlgorithmSpec(name, k=37 if a.sparse else None, collective=coll, gpus_per_node=G)
        try:
            list(a.fast_rounds(spec, P, 5003, 1, G))
        except SparsimError:  # a collective without a timing-only form (backend_allreduce) or not on this P
            continue
        out.append(spec)
    return out


def _iteration(net, P, spec, d, cm, whole: bool, monkeypatch):
    """(ready, busy, messages, bytes) of one fast iteration, with runs evaluated whole or round by round."""
    with monkeypatch.context() as m:
        if not whole:
            m.setattr(fs, "_RUN_MIN", 10**9)
        eng = FastCluster(P, net, cm)
        G = net.gpus_per_node if isinstance(net, ClusterSpec) else 1
        eng.step(lambda e: fast_iteration(e, spec, d, 32, 1, G))
        return eng.ready, eng.busy, eng.messages, eng.bytes


NETS = {
    "dgx-h100": lambda P: get_cluster_preset("dgx-h100", P),  # unshared: rings and folded rotations
    "v100-25GbE": lambda P: get_cluster_preset("v100-25GbE", P),  # a shared NIC per node: phases
    "gtopk-icdcs": lambda P: get_cluster_preset("gtopk-icdcs", P),  # shared NIC and PCIe: phases
    "star": lambda P: NetworkSpec.from_alpha_beta(1e-5, 1e-9),
    "ring": lambda P: NetworkSpec.from_alpha_beta(1e-5, 1e-9, "ring"),
}


@pytest.mark.parametrize("net_name", list(NETS))
@pytest.mark.parametrize("P", [64, 96])
@pytest.mark.parametrize("costly", [False, True])
def test_whole_runs_give_the_round_by_round_bits(net_name, P, costly, monkeypatch):
    """Every algorithm's every timing-capable collective, two sizes, with and without compute costs: the clocks,
    busy seconds, messages and bytes are equal (==) with runs evaluated whole and round by round; a second engine
    (a phase now reused from PHASES) gives them again."""
    net = NETS[net_name](P)
    G = net.gpus_per_node if isinstance(net, ClusterSpec) else 1
    cm = COSTS if costly else FREE
    fs.PHASES.clear()
    for name in REGISTRY:
        for spec in _timed(name, P, G):
            for d in (5003, 123_457):
                want = _iteration(net, P, spec, d, cm, False, monkeypatch)
                for _ in range(2):  # the second: from PHASES where a phase qualified
                    got = _iteration(net, P, spec, d, cm, True, monkeypatch)
                    assert np.array_equal(got[0], want[0]), (name, spec.collective, d)
                    assert np.array_equal(got[1], want[1]), (name, spec.collective, d)
                    assert got[2:] == want[2:], (name, spec.collective, d)


def test_phases_are_reused_and_kept_per_fabric():
    """On a shared fabric, Ok-Topk's P - 1 rotations from an untouched engine are simulated once per message size:
    a second k with the same ceil(k / P) adds no phase, a larger one adds one, another fabric starts afresh; and
    with compute before the rotations (the state is no longer untouched) nothing is stored."""
    P = 32
    net = get_cluster_preset("gtopk-icdcs", P)
    fs.PHASES.clear()

    def once(k, cm=FREE, network=net):
        eng = FastCluster(P, network, cm)
        eng.step(lambda e: fs.fast_collective(e, AlgorithmSpec("oktopk", k=k), 4000, 1, 4))
        return eng.ready

    a = once(10)
    assert len(fs.PHASES.entries) == 1
    b = once(20)  # ceil(20 / 32) = ceil(10 / 32) = 1 entry per message: the same phase
    assert len(fs.PHASES.entries) == 1
    assert np.array_equal(a, b)  # d is the same, only k moved within one message size
    once(100)  # 4 entries per message
    assert len(fs.PHASES.entries) == 2
    other = get_cluster_preset("v100-25GbE", P)
    once(10, network=other)
    assert fs.PHASES.fabric == other and len(fs.PHASES.entries) == 1
    fs.PHASES.clear()
    once(10, cm=COSTS)  # the reduces before the rotations move the clocks: not untouched
    assert len(fs.PHASES.entries) == 0


@pytest.mark.parametrize("P", [16, 24, 64, 96])
def test_round_names_keep_their_promise(P):
    """("rotation", c) rounds are the rotation r -> (r + c) % P with its inverse as sources; rounds with any other
    name have the same dst and src wherever the name recurs, across sizes d and k, in every registered algorithm's
    every timing-capable collective (on a cluster of nodes of 8, and flat)."""
    R = np.arange(P)
    for G in (1, 8):
        if P % G:
            continue
        seen: dict = {}
        for name in REGISTRY:
            for spec0 in _timed(name, P, G):
                for d, k in ((5003, 37), (123_457, 900)):
                    spec = AlgorithmSpec(name, k=k if REGISTRY[name].sparse else None, collective=spec0.collective,
                                         gpus_per_node=G)
                    for op in REGISTRY[name].fast_rounds(spec, P, d, 1, G):
                        if not isinstance(op, Round) or op.pattern is None:
                            continue
                        if op.pattern[0] == "rotation":
                            c = op.pattern[1]
                            assert 1 <= c < P
                            assert np.array_equal(op.dst, (R + c) % P) and np.array_equal(op.src, (R - c) % P)
                        key = (name, spec.collective, op.pattern)
                        if key in seen:
                            assert np.array_equal(seen[key][0], op.dst) and np.array_equal(seen[key][1], op.src)
                        else:
                            seen[key] = (op.dst.copy(), op.src.copy())
        assert any(k[2][0] == "rotation" for k in seen)  # rings and Ok-Topk name theirs


def _ring(P, c, dst_shift, rounds=20):
    """A ring of ``rounds`` rotations by ``dst_shift`` whose table names rotation c, with reduces: (its ops, table)."""
    R = np.arange(P)
    ext = np.tile(np.arange(P, dtype=np.int64) * 4 + 400, 2)  # laid out twice, as RingTable says
    el = np.tile(np.arange(P, dtype=np.int64) + 100, 2)
    ext.setflags(write=False)
    el.setflags(write=False)
    send = np.arange(rounds, dtype=np.int64) % P
    red = np.where(np.arange(rounds) < rounds // 2, (send + 1) % P, -1)
    t = RingTable(c, ext, el, send, red)
    ops = []
    for i in range(rounds):
        ops.append(Round((R + dst_shift) % P, (R - dst_shift) % P, ext[send[i]:send[i] + P], ("rotation", c),
                         t if i == 0 else None))
        if red[i] >= 0:
            ops.append(Work("reduce", el[red[i]:red[i] + P]))
    return ops, t


def test_a_misnamed_rotation_is_refused():
    """A ring table that names a rotation its rounds are not is a program bug: RuntimeError, not a wrong time."""
    P = 64
    eng = FastCluster(P, get_cluster_preset("dgx-h100", P))
    bad, _ = _ring(P, 1, 2)
    with pytest.raises(RuntimeError, match="not that rotation"):
        eng.run(bad, 1)


@pytest.mark.parametrize("feed", ["list", "delegating", "looping"])
def test_a_ring_from_its_table_gives_the_round_by_round_bits_however_fed(feed, monkeypatch):
    """A ring evaluated from its table then skipped in the program, fed as a list (pulled), as a generator that
    delegates (``yield from``: SKIP_RING reaches the ring) and as one that loops over it (the rest pulled), followed
    by another op: the same clocks, busy seconds, messages and bytes as round by round, and the op after the ring
    is not lost (its compute is charged)."""
    P = 64
    net = get_cluster_preset("dgx-h100", P)
    ops, _ = _ring(P, 1, 1)
    tail = Work("update", 1000)

    def program():
        if feed == "list":
            return ops + [tail]

        def inner():
            for op in ops:  # a list of ops has no send: wrap it as the generator shifted_ring_rounds would be
                pulled.append(op)
                if (yield op) is SKIP_RING and op.ring is not None:
                    return

        def outer():
            if feed == "delegating":
                yield from inner()
            else:
                for op in inner():
                    yield op
            yield tail
        return outer()

    def once(whole):
        with monkeypatch.context() as m:
            if not whole:
                m.setattr(fs, "_RUN_MIN", 10**9)
            eng = FastCluster(P, net, COSTS)
            eng.run(program(), 1)
            return eng.ready, eng.busy, eng.messages, eng.bytes

    pulled = []
    want = once(False)
    pulled.clear()
    got = once(True)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2:] == want[2:]
    assert want[2] == 20 * P and got[1][:, 0].max() > 0  # every round counted; the tail's update charged
    if feed != "list":  # delegating: SKIP_RING ended the ring's generator after its first op; looping: all pulled
        assert len(pulled) == (1 if feed == "delegating" else len(ops))


@pytest.mark.parametrize("P", [16, 64])
def test_ring_tables_are_the_rounds_that_follow(P):
    """Every ring table (sim.comm.rounds.RingTable) in every registered algorithm's every timing-capable collective
    is the ring it heads: its rounds' sizes are the table's slices and its reduces the table's, in order, and the
    rounds are the rotation it names (flat and on nodes of 8)."""
    R = np.arange(P)
    tables = 0
    for G in (1, 8):
        for name in REGISTRY:
            for spec in _timed(name, P, G):
                ops = list(REGISTRY[name].fast_rounds(spec, P, 123_457, 1, G))
                for j, op in enumerate(ops):
                    if not (isinstance(op, Round) and op.ring is not None):
                        continue
                    t = op.ring
                    tables += 1
                    i = j
                    for n in range(t.send_at.shape[0]):
                        r = ops[i]
                        assert isinstance(r, Round) and r.pattern == ("rotation", t.c)
                        assert np.array_equal(r.dst, (R + t.c) % P) and np.array_equal(r.src, (R - t.c) % P)
                        assert np.array_equal(r.nbytes, t.sizes_b[t.send_at[n]:t.send_at[n] + P])
                        i += 1
                        if t.reduce_at[n] >= 0:
                            w = ops[i]
                            assert isinstance(w, Work) and w.kind == "reduce"
                            assert np.array_equal(w.work, t.elems[t.reduce_at[n]:t.reduce_at[n] + P])
                            i += 1
    assert tables > 0


def test_a_run_cut_by_the_memory_bound_gives_the_same_bits(monkeypatch):
    """A program is read as it is generated: a run of named rounds whose own arrays pass the collection bound (here
    1 KB: SparCML's split rounds, each with its peer array) is cut into pieces that go round by round, with the
    bits of the uncut evaluation, on a shared fabric (first piece from an untouched engine) and an unshared one."""
    P = 64
    for net in (get_cluster_preset("gtopk-icdcs", P), get_cluster_preset("dgx-h100", P)):
        spec = AlgorithmSpec("sparcml", k=300, collective="ssar_split_allgather", gpus_per_node=net.gpus_per_node)
        fs.PHASES.clear()
        want = _iteration(net, P, spec, 50_000, FREE, False, monkeypatch)
        monkeypatch.setattr(fs, "_RUN_MAX_BYTES", 1024)
        fs.PHASES.clear()
        got = _iteration(net, P, spec, 50_000, FREE, True, monkeypatch)
        monkeypatch.undo()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2:] == want[2:]

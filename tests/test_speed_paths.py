"""The fast paths of issue #12's remaining goals give what the paths they replace give, bit for bit (real values,
no wall-time assertions):

- SimCluster's one event per message on star and direct networks (Network.uncontended_arrival) against every
  message run hop by hop as its own process (``SimCluster(..., fast=False)``, the code as it was): the same
  clock, results, finish times, busy seconds, counters, link busy seconds and link free times, for random
  traffic (SendRecv permutations with self-messages, Send/Recv pairs, random sizes including 0 bytes, jittered
  compute, start offsets) with and without a time quantum, and the same metrics rows for every registered
  algorithm and flat collective;
- save_figure without tight_layout's placeholder layout engine writes the same PNG and PDF bytes;
- the digits read without importing scikit-learn are load_digits' bits; the mini-batches a Workers keeps for the
  run's next algorithm are the fresh draws; the gTop-k survival lookup's binary search gives np.isin's booleans.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import sim.engine.runner as runner_mod
from sim.algorithms import REGISTRY, AlgorithmSpec
from sim.engine.cluster import SimCluster
from sim.machine.compute import ComputeModel
from sim.workloads.data import shard_indices
from sim.base.errors import SparsimError
from sim.machine.network import PRESETS, NetworkSpec
from sim.workloads.objectives import make_objective
from sim.base.ops import Compute, Recv, Send, SendRecv
from sim.engine.runner import Workers, run_algorithm

NETS = {
    "star-1GbE": PRESETS["1GbE"],
    "direct": NetworkSpec("direct", 3e-6, 1.5e9),
    "star-quantum": NetworkSpec("star", 500e-9, 50 * 2**30, quantum_s=1e-9),
    "direct-quantum": NetworkSpec("direct", 700e-9, 10 * 2**30, quantum_s=1e-9),
    "star-zero-latency": NetworkSpec("star", 0.0, 1e9),
}
JITTERY = ComputeModel(forward_backward_s=1e-3, jitter="lognormal", jitter_scale=0.5, straggler_prob=0.2,
                       straggler_factor=3.0, merge_coeff_s=1e-9, reduce_coeff_s=2e-9, update_coeff_s=1e-10, seed=4)


def _plan(P, rounds, seed):
    """Random rounds every rank agrees on: ("sr", perm, sizes) = rank r SendRecv to perm[r] from perm^-1[r]
    (fixed points send to themselves); ("pair", pairs, sizes) = a sends then receives, b receives then sends;
    ("compute", kinds, works)."""
    rng = np.random.default_rng(seed)
    kinds = ["forward_backward", "select", "merge", "reduce", "update"]
    plan = []
    for _ in range(rounds):
        c = int(rng.integers(3))
        sizes = [int(x) for x in rng.choice([0, 1, 7, 4096, 123_457, 2_000_000], size=P)]
        if c == 0:
            plan.append(("sr", [int(x) for x in rng.permutation(P)], sizes))
        elif c == 1:
            order = [int(x) for x in rng.permutation(P)]
            plan.append(("pair", [order[i:i + 2] for i in range(0, P - 1, 2)], sizes))
        else:
            plan.append(("compute", [kinds[int(x)] for x in rng.integers(len(kinds), size=P)],
                         [int(x) if i % 2 else float(x) for i, x in enumerate(rng.integers(0, 10_000, size=P))]))
    return plan


def _program(rank, P, plan):
    got = []
    for i, (what, a, sizes) in enumerate(plan):
        if what == "sr":
            dst = a[rank]
            src = a.index(rank)
            got.append((yield SendRecv(dst, (rank, i), sizes[rank], src)))
        elif what == "pair":
            for lo, hi in a:
                if rank == lo:
                    yield Send(hi, (rank, i), sizes[rank])
                    got.append((yield Recv(hi)))
                elif rank == hi:
                    got.append((yield Recv(lo)))
                    yield Send(lo, (rank, i), sizes[rank])
        else:
            yield Compute(a[rank], sizes[rank])
    return got


def _state(cl: SimCluster):
    return (cl.env.now, cl.busy.tolist(), cl.net.bytes_sent.tolist(), cl.net.messages_sent.tolist(),
            dict(cl.net.link_busy_s), dict(cl.net._free_at))


@pytest.mark.parametrize("net", list(NETS), ids=str)
@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
def test_one_event_per_message_equals_hop_by_hop(net, P):
    spec = NETS[net]
    for seed in range(3):
        clusters = [SimCluster(P, spec, JITTERY, fast=f) for f in (True, False)]
        assert clusters[0]._one_event and not clusters[1]._one_event
        outs = []
        for cl in clusters:
            rng = np.random.default_rng(seed)
            runs = []
            for it in range(3):  # one cluster, several program sets one after the other (as sim.engine.timing runs them)
                plan = _plan(P, 12, seed * 10 + it)
                offsets = rng.random(P) * 1e-3 if it == 1 else None
                res, finish = cl.run_programs([_program(r, P, plan) for r in range(P)], it + 1, offsets=offsets)
                runs.append((res, finish.tolist(), _state(cl)))
            outs.append(runs)
        assert outs[0] == outs[1], (net, P, seed)


def test_one_event_path_is_used_only_where_exact():
    assert SimCluster(4, PRESETS["1GbE"])._one_event
    assert SimCluster(4, NetworkSpec("direct", 1e-6, 1e9))._one_event
    assert not SimCluster(4, NetworkSpec("ring", 1e-6, 1e9))._one_event  # a hop carries other ranks' messages
    assert not SimCluster(4, PRESETS["1GbE"], fast=False)._one_event


def test_quantum_that_truncates_a_hop_raises_the_same_error_on_both_paths():
    spec = NetworkSpec("star", 0.0, 1e9, quantum_s=1e-6)  # a 10-byte hop is 5 ns: truncated to 0 quanta
    msgs = []
    for fast in (True, False):
        cl = SimCluster(2, spec, fast=fast)

        def prog(r):
            return (yield SendRecv(1 - r, r, 10, 1 - r))

        with pytest.raises(SparsimError, match="truncates") as err:
            cl.run_programs([prog(0), prog(1)])
        msgs.append(str(err.value))
    assert msgs[0] == msgs[1]


def test_a_second_message_on_a_held_link_is_refused_not_mistimed():
    """Two programs of one rank at once break the rendezvous guarantee: the one-event path refuses it."""
    cl = SimCluster(3, PRESETS["1GbE"])

    def sender(dst):
        yield Send(dst, None, 10**6)

    def receiver():
        yield Recv(0)

    env = cl.env
    env.process(cl.execute(0, sender(1)))
    env.process(cl.execute(0, sender(2)))  # rank 0's uplink is still busy with the first message
    env.process(cl.execute(1, receiver()))
    env.process(cl.execute(2, receiver()))
    with pytest.raises(SparsimError, match="still held"):
        env.run()


def _rows_equal(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            x, y = ra[key], rb[key]
            if isinstance(x, float) and isinstance(y, float) and math.isnan(x):
                assert math.isnan(y), key
            else:
                assert x == y, (key, x, y)


def _flat_specs(k):
    out = []
    for name, algo in REGISTRY.items():
        for coll in algo.collectives:
            if coll not in ("backend_allreduce", "hierarchical"):
                out.append(AlgorithmSpec(name, k=k if algo.sparse else None, collective=coll))
    return out


@pytest.mark.parametrize("P", [1, 3, 4])
def test_run_algorithm_rows_equal_with_and_without_the_one_event_path(P, monkeypatch):
    obj = make_objective("sines", d=40, n=48, seed=2)
    w = Workers(obj, shard_indices(obj.n, P, seed=2), 4, 2)
    x0 = obj.x0(2)
    compute = ComputeModel(forward_backward_s=2e-3, jitter="exponential", jitter_scale=0.3, merge_coeff_s=1e-8)
    for spec in _flat_specs(6):
        fast = run_algorithm(spec, w, T=5, lr=lambda t: 0.05, x0=x0, network=PRESETS["1GbE"], compute=compute)
        with monkeypatch.context() as m:
            m.setattr(runner_mod, "SimCluster", lambda *a, **kw: SimCluster(*a, fast=False, **kw))
            slow = run_algorithm(spec, w, T=5, lr=lambda t: 0.05, x0=x0, network=PRESETS["1GbE"], compute=compute)
        _rows_equal(fast, slow)


def test_save_figure_writes_the_bytes_savefig_writes_with_the_layout_placeholder(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from experiments.outdir import save_figure

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")  # the PDF's creation date

    def make():
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots(1, 2)
        ax[0].semilogy([1, 2, 3], [1, 10, 100], label="a")
        ax[1].bar([0, 1], [3, 4])
        ax[0].legend()
        fig.suptitle("t")
        fig.tight_layout()
        return fig

    ref = make()
    assert ref.get_layout_engine() is not None  # what tight_layout leaves behind
    ref.savefig(tmp_path / "ref.png", dpi=110)
    ref.savefig(tmp_path / "ref.pdf")
    save_figure(make(), tmp_path, "new")
    assert (tmp_path / "new.png").read_bytes() == (tmp_path / "ref.png").read_bytes()
    assert (tmp_path / "new.pdf").read_bytes() == (tmp_path / "ref.pdf").read_bytes()


def test_digits_read_without_sklearn_equal_load_digits_bit_for_bit():
    from sklearn.datasets import load_digits

    from sim.workloads.data import _digits_raw, load_dataset

    data, target = _digits_raw()
    ref = load_digits()
    assert data.dtype == ref.data.dtype and data.shape == ref.data.shape == (1797, 64)
    assert data.tobytes() == np.ascontiguousarray(ref.data).tobytes()
    assert target.dtype == ref.target.dtype and np.array_equal(target, ref.target)
    ds = load_dataset("digits")
    assert ds.X.tobytes() == (np.asarray(ref.data, dtype=np.float64) / 16.0).tobytes()


def test_loading_digits_imports_no_sklearn():
    import subprocess
    import sys

    code = "import sys; from sim.workloads.data import load_dataset; load_dataset('digits'); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_batch_indices_kept_for_the_next_algorithm_equal_fresh_draws(monkeypatch):
    from sim.workloads.data import minibatch

    obj = make_objective("sines", d=8, n=40, seed=1)
    shards = shard_indices(obj.n, 4, seed=1)

    def fresh(t):
        return np.stack([minibatch(s, 3, 5, r, t) for r, s in enumerate(shards)])

    w = Workers(obj, shards, 3, 5)
    first = [w.batch_indices(t) for t in range(1, 6)]
    again = [w.batch_indices(t) for t in range(1, 6)]
    for t, (a, b) in enumerate(zip(first, again), start=1):
        assert a is b and not a.flags.writeable and np.array_equal(a, fresh(t))
    monkeypatch.setattr(runner_mod, "BATCH_MEMO_BYTES", 2 * first[0].nbytes)  # room for two iterations
    w2 = Workers(obj, shards, 3, 5)
    got = [w2.batch_indices(t) for t in range(1, 6)]
    assert len(w2._batch_memo) == 2 and all(np.array_equal(g, fresh(t)) for t, g in enumerate(got, start=1))
    assert "_batch_memo" not in repr(w2)


def test_in_sorted_equals_isin_at_every_size():
    from sim.comm.collectives import in_sorted

    rng = np.random.default_rng(7)
    for _ in range(2000):
        n, m = (int(v) for v in rng.integers(0, 700, size=2))
        x = np.sort(rng.choice(1400, n, replace=False)).astype(np.int64)
        s = np.sort(rng.choice(1400, m, replace=False)).astype(np.int64)
        assert np.array_equal(in_sorted(x, s), np.isin(x, s, assume_unique=True))


def test_to_dense_is_built_once_read_only_and_equals_densify():
    import pickle

    from sim.comm.compression import densify, topk

    for dtype in (np.float32, np.float64):
        x = np.random.default_rng(3).standard_normal(1000).astype(dtype)
        s = topk(x, 17)
        a = s.to_dense()
        assert a is s.to_dense() and not a.flags.writeable and a.dtype == dtype
        b = densify(s)
        assert b.flags.writeable and b is not a and a.tobytes() == b.tobytes()
        with pytest.raises(ValueError):
            a[0] = 1.0
        t = pickle.loads(pickle.dumps(s))
        assert "_dense" not in t.__dict__ and t.to_dense().tobytes() == a.tobytes()
        assert repr(t) == repr(s)


def test_gtopk_tree_ranks_share_one_dense_result_with_the_bits_of_their_own():
    from sim.comm.collectives import gtopk_tree
    from sim.comm.compression import densify, topk

    P, k, d = 6, 9, 200
    rng = np.random.default_rng(5)
    sels = [topk(rng.standard_normal(d), k) for _ in range(P)]
    cl = SimCluster(P, PRESETS["1GbE"])
    res, _ = cl.run_programs([gtopk_tree(r, P, sels[r], k) for r in range(P)])
    dense = [r.g.to_dense() for r in res]
    assert all(x is dense[0] for x in dense)  # one result object, densified once
    assert all(densify(r.g).tobytes() == dense[0].tobytes() for r in res)

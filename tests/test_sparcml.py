"""SparCML's sparse allreduce (sim/algorithms/sparcml.py, sim/comm/collectives.py ssar_*; Renggli et al. SC 2019):
checked against the authors' C++/MPI code's recorded results (tests/fixtures/peers/sparcml.npz, written by
benchmarks/peers/sparcml_peer.py), against a dense reference summed in the order the merges produce, against its
switch-to-dense rule message by message, and its closed forms against the paper's worst-case cost and the
simulator."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.comm import collectives as C
from sim.comm import costs
from sim.algorithms import AlgorithmSpec, StepContext, check_options
from sim.algorithms.sparcml import PhantomStream, PhantomStreams
from sim.comm.compression import Sparse, topk
from sim.engine.drivers import run_lockstep
from sim.base.errors import ConfigError
from sim.machine.network import PRESETS
from sim.base.ops import Send, SendRecv
from sim.engine.timing import closed_form_comm_s, simulate_timing

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "peers" / "sparcml.npz"
COLLS = {"rd": C.ssar_recursive_doubling, "split": C.ssar_split_allgather}


def _run(coll, sels, n, dtype=np.float64, vb=4, ib=4, t=1.0, rule="union", record=None):
    """Run a SparCML collective on the selections (one per rank) in lock step; returns (final streams, g per
    rank). ``record``: a list that receives (rank, op) for every Send / SendRecv, in each rank's order."""
    P = len(sels)
    ops = [C.SparseStreams(n, dtype, vb, ib, t, rule) for _ in range(P)]

    def rec(r, prog):
        got = None
        try:
            while True:
                op = prog.send(got)
                if record is not None and isinstance(op, (Send, SendRecv)):
                    record.append((r, op))
                got = yield op
        except StopIteration as stop:
            return stop.value

    outs = run_lockstep([rec(r, COLLS[coll](r, P, sels[r], streams=ops[r])) for r in range(P)])
    return outs, [ops[r].finish(outs[r]) for r in range(P)]


def _dense(s: Sparse, dtype) -> np.ndarray:
    out = np.zeros(s.d, dtype=dtype)
    out[s.idx] = s.val
    return out


def _leaves(sels, dtype):
    """y_u of the pof2 survivors: a folded pair's sum (its even rank first), else the rank's own selection."""
    P = len(sels)
    pof2, rem = C.pof2_split(P)
    return [(_dense(sels[2 * u], dtype) + _dense(sels[2 * u + 1], dtype)) if u < rem else _dense(sels[u + rem], dtype)
            for u in range(pof2)]


def reference(coll, sels, dtype=np.float64) -> np.ndarray:
    """The dense sum in the order each collective's merges add: the butterfly's pairwise tree over the survivors
    (recursive doubling) or the newrank-sequential sum ((y_0 + y_1) + y_2) + ... (split allgather's region
    owners); absent entries are zeros, and x + 0.0 = x, so the bits are the sparse merges'."""
    y = _leaves(sels, dtype)
    if coll == "split":
        g = y[0]
        for v in y[1:]:
            g = g + v
        return g
    while len(y) > 1:
        y = [y[2 * i] + y[2 * i + 1] for i in range(len(y) // 2)]
    return y[0]


def _selections(rng, P, n, kmax, pool, integer=False, positive=False, dtype=np.float64):
    support = np.sort(rng.choice(n, size=pool, replace=False))
    out = []
    for _ in range(P):
        c = int(rng.integers(1, min(kmax, pool) + 1))
        idx = np.sort(rng.choice(support, size=c, replace=False)).astype(np.int64)
        if integer:
            val = rng.integers(1, 4, size=c).astype(float) * (1 if positive else rng.choice([-1, 1], size=c))
        else:
            val = rng.standard_normal(c)
            val = np.abs(val) + 0.1 if positive else np.where(val == 0, 1.0, val)
        out.append(Sparse(idx, val.astype(dtype), n))
    return out


# ------------------------------------------------------------------ the authors' code (recorded fixture)

@pytest.fixture(scope="module")
def fx():
    with np.load(FIXTURE) as z:
        return {k: z[k] for k in z.files}


def _fixture_cases(fx):
    cnt_at = out_at = 0
    for i in range(len(fx["P"])):
        P, n = int(fx["P"][i]), int(fx["n"][i])
        cnt = fx["cnt"][cnt_at:cnt_at + P]
        start = int(fx["cnt"][:cnt_at].sum())
        off = start + np.concatenate([[0], np.cumsum(cnt)])
        dtype = np.float32 if fx["layout"][i] == 0 else np.float64
        sels = [Sparse(fx["idx"][off[r]:off[r + 1]].astype(np.int64), fx["val"][off[r]:off[r + 1]].astype(dtype), n)
                for r in range(P)]
        yield i, P, n, dtype, sels, fx["out"][out_at:out_at + n]
        cnt_at += P
        out_at += n


def test_the_authors_sparse_allreduces_give_our_bits_and_representation(fx):
    """Their c_allreduce_recdoubling / c_allreduce_small (run by benchmarks/peers/sparcml_peer.py): rank 0's result
    equals ours bit for bit wherever their summation order is fixed (recursive doubling; the split variant with
    at most two survivors or exact dyadic values; their split variant adds received pieces in arrival order),
    within rounding otherwise; the result stream is dense or sparse, with the same entry count, as ours under their
    rule (dense_rule = "bound"); our "union" rule gives the same values."""
    assert fx["ranks_agree"].all()
    n_cases = bit = 0
    for i, P, n, dtype, sels, peer in _fixture_cases(fx):
        coll = ("rd", "split")[int(fx["alg"][i])]
        vb = ib = dtype(0).itemsize
        outs, gs = _run(coll, sels, n, dtype, vb, ib, 1.0, "bound")
        g = gs[0]
        assert all(np.array_equal(x, g) for x in gs), i
        dense = not isinstance(outs[0], Sparse)
        assert (dense, n if dense else len(outs[0])) == (bool(fx["dense"][i]), int(fx["nofitems"][i])), i
        fixed = coll == "rd" or P <= 3 or bool(fx["dyadic"][i])
        if fixed:
            assert np.array_equal(g.astype(np.float64), peer), i
            bit += 1
        else:
            np.testing.assert_allclose(g, peer.astype(dtype), rtol=1e-5 if dtype == np.float32 else 1e-13, atol=0)
        _, gu = _run(coll, sels, n, dtype, vb, ib, 1.0, "union")
        assert np.array_equal(gu[0], g), i
        assert np.array_equal(g, reference(coll, sels, dtype)), i
        n_cases += 1
    assert (n_cases, bit) == (240, 180)
    assert int(fx["dense"].sum()) > 40 and int((~fx["dense"].astype(bool)).sum()) > 40  # both representations


# ------------------------------------------------------------------ exact sums (hypothesis)

@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 9), n=st.integers(4, 120), seed=st.integers(0, 2**32 - 1), coll=st.sampled_from(["rd", "split"]),
       t=st.sampled_from([1.0, 0.75, 0.5, 0.2, 0.05]), rule=st.sampled_from(["union", "bound"]),
       vb_ib=st.sampled_from([(4, 4), (8, 4), (4, 0), (2, 4)]), integer=st.booleans(), f32=st.booleans())
def test_the_sparse_allreduce_is_the_exact_sum_of_the_selections(P, n, seed, coll, t, rule, vb_ib, integer, f32):
    """g equals, bit for bit and on every rank, the dense sum of the P selections in the merges' order (random
    supports and overlaps, any switch threshold); with integer values, the plain sum in any order."""
    rng = np.random.default_rng(seed)
    dtype = np.float32 if f32 else np.float64
    pool = int(rng.integers(1, n + 1))
    sels = _selections(rng, P, n, int(rng.integers(1, n + 1)), pool, integer=integer, dtype=dtype)
    _, gs = _run(coll, sels, n, dtype, *vb_ib, t, rule)
    ref = reference(coll, sels, dtype)
    for g in gs:
        assert g.dtype == dtype and np.array_equal(g, ref)
    if integer:
        assert np.array_equal(gs[0], sum(_dense(s, np.float64) for s in sels).astype(dtype))


def _block_ranks(P, u_lo, size):
    """Real ranks behind survivors u_lo .. u_lo + size - 1 (a folded survivor holds two)."""
    pof2, rem = C.pof2_split(P)
    out = []
    for u in range(u_lo, u_lo + size):
        out += [2 * u, 2 * u + 1] if u < rem else [u + rem]
    return out


@settings(max_examples=60, deadline=None)
@given(P=st.integers(1, 9), n=st.integers(4, 100), seed=st.integers(0, 2**32 - 1),
       t=st.sampled_from([1.0, 0.6, 0.3, 0.1]), vb_ib=st.sampled_from([(4, 4), (8, 4), (4, 0)]))
def test_recursive_doubling_streams_switch_exactly_when_the_rule_says(P, n, seed, t, vb_ib):
    """Every message of SSAR_Recursive_double (union rule): a stream is dense iff the union U of its contributors'
    supports has |U| (v + i) >= t n v; a sparse one carries exactly U; its bytes are |U| (v + i) or n v."""
    vb, ib = vb_ib
    rng = np.random.default_rng(seed)
    sels = _selections(rng, P, n, int(rng.integers(1, n + 1)), int(rng.integers(1, n + 1)))
    msgs: list = []
    _run("rd", sels, n, np.float64, vb, ib, t, "union", record=msgs)
    pof2, rem = C.pof2_split(P)
    per_rank = {r: [op for q, op in msgs if q == r] for r in range(P)}
    for r in range(P):
        expect = []
        if r < 2 * rem and r % 2 == 0:
            expect.append([r])  # the fold: its own selection
        else:
            u = r // 2 if r < 2 * rem else r - rem
            size = 1
            while size < pof2:
                expect.append(_block_ranks(P, (u // size) * size, size))
                size <<= 1
            if r < 2 * rem:
                expect.append(list(range(P)))  # the unfold: the result
        assert len(per_rank[r]) == len(expect)
        for op, ranks in zip(per_rank[r], expect):
            U = np.unique(np.concatenate([sels[q].idx for q in ranks]))
            want_dense = C.ssar_is_dense(len(U), n, vb, ib, t)
            if want_dense:
                assert isinstance(op.payload, np.ndarray) and op.payload.shape == (n,) and op.nbytes == n * vb
            else:
                assert isinstance(op.payload, Sparse) and np.array_equal(op.payload.idx, U)
                assert op.nbytes == len(U) * (vb + ib)


@settings(max_examples=40, deadline=None)
@given(P=st.integers(2, 9), n=st.integers(8, 100), seed=st.integers(0, 2**32 - 1),
       t=st.sampled_from([1.0, 0.5, 0.2]), rule=st.sampled_from(["union", "bound"]))
def test_split_allgather_pieces_and_allgather_streams_follow_the_rule(P, n, seed, t, rule):
    """SSAR_Split_allgather (positive values: no cancellation): a piece for region r is dense iff the sender's
    stream is or its entries e in r satisfy e (v + i) >= t |r| v; an allgather stream covering the regions of a
    block of survivors is dense iff the union of all supports in those regions satisfies the rule over n."""
    vb, ib = 4, 4
    rng = np.random.default_rng(seed)
    sels = _selections(rng, P, n, int(rng.integers(1, n + 1)), int(rng.integers(1, n + 1)), positive=True)
    msgs: list = []
    _run("split", sels, n, np.float64, vb, ib, t, rule, record=msgs)
    pof2, rem = C.pof2_split(P)
    bounds = C._chunk_bounds(n, pof2)
    allsup = np.unique(np.concatenate([s.idx for s in sels]))
    for r in range(P):
        ops = [op for q, op in msgs if q == r]
        if r < 2 * rem and r % 2 == 0:
            assert len(ops) == 1
            continue
        u = r // 2 if r < 2 * rem else r - rem
        mine = _block_ranks(P, u, 1)  # the survivor's stream: its selection, or a folded pair's sum
        own = np.unique(np.concatenate([sels[q].idx for q in mine]))
        stream_dense = C.ssar_is_dense(len(own) if rule == "union" else sum(len(sels[q]) for q in mine), n, vb, ib, t)
        for j in range(1, pof2):  # split phase: the piece of region u ^ j
            op, w = ops[j - 1], u ^ j
            lo, hi = int(bounds[w]), int(bounds[w + 1])
            e = int(((own >= lo) & (own < hi)).sum())
            if stream_dense or C.ssar_is_dense(e, hi - lo, vb, ib, t):
                assert isinstance(op.payload, np.ndarray) and op.nbytes == (hi - lo) * vb
            else:
                assert isinstance(op.payload, Sparse) and op.nbytes == e * (vb + ib)
        size = 1
        for op in ops[pof2 - 1:pof2 - 1 + int(math.log2(pof2))]:  # allgather rounds
            blk = (u // size) * size
            lo, hi = int(bounds[blk]), int(bounds[blk + size])
            U = int(((allsup >= lo) & (allsup < hi)).sum())
            assert isinstance(op.payload, np.ndarray) == C.ssar_is_dense(U, n, vb, ib, t)
            assert op.nbytes == (n * vb if isinstance(op.payload, np.ndarray) else U * (vb + ib))
            size <<= 1


def test_real_messages_are_at_most_the_timing_assumptions():
    """The timing-only mode assumes disjoint supports; real supports overlap, so every message of SSAR_Recursive_double
    carries at most the bytes of its timing-only counterpart (the same schedule on PhantomStreams)."""
    rng = np.random.default_rng(5)
    for P in (2, 3, 5, 8, 9):
        for n, k in ((200, 10), (60, 12), (1000, 40)):
            sels = [topk(rng.standard_normal(n) * (rng.random(n) < 0.3), k) for _ in range(P)]
            real: list = []
            _run("rd", sels, n, record=real)
            phantom: list = []
            ops = [PhantomStreams(n) for _ in range(P)]
            progs = [C.ssar_recursive_doubling(r, P, PhantomStream(k, False, n), streams=ops[r]) for r in range(P)]
            run_lockstep([_recorder(r, p, phantom) for r, p in enumerate(progs)])
            for r in range(P):
                a = [op.nbytes for q, op in real if q == r]
                b = [op.nbytes for q, op in phantom if q == r]
                assert len(a) == len(b) and all(x <= y for x, y in zip(a, b)), (P, n, k, r)


def _recorder(r, prog, out):
    got = None
    try:
        while True:
            op = prog.send(got)
            if isinstance(op, (Send, SendRecv)):
                out.append((r, op))
            got = yield op
    except StopIteration as stop:
        return stop.value


# ------------------------------------------------------------------ the algorithm

def test_exchange_sums_every_selection_and_keeps_the_rest_as_residual():
    rng = np.random.default_rng(2)
    P, d, k = 5, 300, 20
    accs = [rng.standard_normal(d) for _ in range(P)]
    for coll in ("ssar_recursive_doubling", "ssar_split_allgather"):
        spec = AlgorithmSpec("sparcml", k=k, collective=coll)
        outs = run_lockstep([spec.algorithm.exchange(spec, accs[p], k, StepContext(p, P, 1, d, 0, 0, d, {}))
                             for p in range(P)])
        sels = [topk(a, k) for a in accs]
        ref = reference("rd" if coll.endswith("doubling") else "split", sels)
        for p, o in enumerate(outs):
            assert np.array_equal(o.g, ref) and (o.n_selected, o.n_applied) == (k, k)
            expect = accs[p].copy()
            expect[sels[p].idx] = 0.0
            assert np.array_equal(o.residual, expect)


@pytest.mark.parametrize("key,value,needle", [
    ("dense_threshold", 0.0, "sparcml.dense_threshold = 0.0 is out of range"),
    ("dense_threshold", 1.5, "sparcml.dense_threshold = 1.5 is out of range"),
    ("dense_threshold", "x", "sparcml.dense_threshold = 'x' must be a number"),
    ("dense_rule", "max", "sparcml.dense_rule = 'max' is unknown: valid union, bound"),
    ("collective", "ring", "algorithm.sparcml.collective = 'ring' is unknown: valid ssar_recursive_doubling"),
])
def test_bad_options_are_one_line_errors(key, value, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")) as e:
        check_options("sparcml", {key: value})
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ closed forms

NET = PRESETS["1GbE"]
ALPHA, BETA = NET.end_to_end_alpha_beta()


@pytest.mark.parametrize("P", [2, 4, 8, 16, 32, 64])
def test_closed_forms_match_the_papers_worst_case_before_the_switch(P):
    """For P = 2^L and disjoint supports that never switch: SSAR_Recursive_double costs the paper's
    lg P alpha + (P - 1) k beta (beta per index-value pair), the same as Top-k's Bruck allgather; the split variant
    (P - 1 + lg P) alpha + ((P - 1) k / P + (P - 1) k) beta when P divides k."""
    k, n, s = 64 * 3, 10**7, 8
    L = int(math.log2(P))
    paper = L * ALPHA + (P - 1) * k * s * BETA
    assert costs.sparcml_rd_time(P, k, n, ALPHA, BETA) == pytest.approx(paper, rel=1e-12)
    assert costs.sparcml_rd_time(P, k, n, ALPHA, BETA) == pytest.approx(costs.topk_allgather_time(P, k, ALPHA, BETA),
                                                                       rel=1e-12)
    split = (P - 1 + L) * ALPHA + ((P - 1) * k // P + (P - 1) * k) * s * BETA
    assert costs.sparcml_split_time(P, k, n, ALPHA, BETA) == pytest.approx(split, rel=1e-12)


def test_after_the_switch_every_round_costs_the_dense_vector():
    """n = 1000, k = 100, 4 + 4 bytes: streams of 2^j k entries switch when 2^j k >= n / 2, i.e. from 500 entries
    (j = 3): rounds 1..3 carry 100, 200, 400 entries, rounds 4.. the dense 4000 bytes."""
    n, k = 1000, 100
    for P in (8, 16, 64):
        L = int(math.log2(P))
        want = 3 * ALPHA + (100 + 200 + 400) * 8 * BETA + (L - 3) * (ALPHA + 4 * n * BETA)
        assert costs.sparcml_rd_time(P, k, n, ALPHA, BETA) == pytest.approx(want, rel=1e-12)
    # dense from the start: k (v + i) >= n v
    assert costs.sparcml_rd_time(4, 600, 1000, ALPHA, BETA) == pytest.approx(2 * (ALPHA + 4000 * BETA), rel=1e-12)


@pytest.mark.parametrize("coll", ["ssar_recursive_doubling", "ssar_split_allgather"])
@pytest.mark.parametrize("P", [1, 2, 3, 5, 6, 7, 8, 12, 17])
def test_timing_only_equals_the_closed_form_at_any_threshold_and_sizes(coll, P):
    """Beyond the registry's default check: thresholds, value / index bytes and the switch at several rounds; the
    fast engine agrees with the message engine."""
    for d, k, t, vb, ib in ((97, 5, 1.0, 4, 4), (97, 9, 0.4, 8, 4), (500, 40, 0.7, 4, 8), (64, 33, 1.0, 2, 0),
                            (1000, 3, 0.05, 4, 4)):
        spec = AlgorithmSpec("sparcml", k=k, collective=coll, value_bytes=vb, index_bytes=ib,
                             options=(("dense_threshold", t),))
        msg = simulate_timing(spec, P, d, network=NET, engine="message")
        fast = simulate_timing(spec, P, d, network=NET, engine="fast")
        cf = closed_form_comm_s(spec, P, d, ALPHA, BETA)
        assert msg.iter_s[0] == pytest.approx(cf, rel=1e-12, abs=1e-15), (d, k, t)
        assert fast.iter_s[0] == pytest.approx(msg.iter_s[0], rel=1e-9, abs=1e-15)
        assert (fast.messages, fast.bytes) == (msg.messages, msg.bytes)


def test_labels_name_the_variant_and_options():
    assert AlgorithmSpec("sparcml", k=3).label == "sparcml"
    spec = AlgorithmSpec("sparcml", k=3, collective="ssar_split_allgather",
                         options=(("dense_threshold", 0.5), ("dense_rule", "bound")))
    assert spec.label == "sparcml[split,t=0.5,bound]"

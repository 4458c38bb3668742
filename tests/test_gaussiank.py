"""Gaussian-k (sim/algorithms/gaussiank.py): against the authors' compressor (a fixture recorded by
benchmarks/peers/gaussiank_peer.py from hclhkbu/GaussianK-SGD), the selection rule as a hypothesis property,
error feedback's mass, the count reported per step, and the timing-only mode's exactly-k assumption."""
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sim.algorithms import AlgorithmSpec, StepContext, get
from sim.algorithms.gaussiank import gaussian_threshold, gaussiank_select
from sim.workloads.data import shard_indices
from sim.engine.drivers import run_lockstep
from sim.base.errors import ConfigError
from sim.machine.network import PRESETS
from sim.workloads.objectives import make_objective
from sim.base.ops import Send, SendRecv
from sim.engine.runner import Workers, run_algorithm
from sim.engine.timing import closed_form_comm_s, simulate_timing

FIXTURE = Path(__file__).parent / "fixtures" / "peers" / "gaussiank.npz"


def _fixture():
    z = np.load(FIXTURE)
    meta = json.loads(str(z["meta"]))
    return meta, z["masks"], {n[2:]: z[n] for n in z.files if n.startswith("x_")}


def test_the_threshold_and_the_selection_equal_the_authors_compressor():
    """Every recorded case (6 inputs x float64/float32 x 5 densities x the 3- and 5-loop compressors): fed the
    peer's mean and std, every evaluated threshold is bit-equal and the index set is the peer's less its exact
    zeros; with our own statistics the index set is the same and the threshold within the statistics' last bits."""
    meta, masks, inputs = _fixture()
    assert meta["ppf_is_ndtri"] and len(meta["cases"]) == 120
    zeros_dropped = 0
    for case, packed in zip(meta["cases"], masks):
        x = inputs[case["input"]].astype(case["dtype"])
        d, k = x.shape[0], case["k"]
        assert case["peer_k"] == k
        peer = np.flatnonzero(np.unpackbits(packed)[:d])
        peer_nz = peer[x[peer] != 0]
        zeros_dropped += peer.shape[0] - peer_nz.shape[0]
        mean, std = float.fromhex(case["mean"]), float.fromhex(case["std"])
        thresholds = [float.fromhex(t) for t in case["thresholds"]]
        assert gaussian_threshold(mean, std, case["ratio"]) == thresholds[0], case
        a = gaussiank_select(x, k, case["loops"], stats=(mean, std))
        assert list(a.thresholds) == thresholds, case
        np.testing.assert_array_equal(a.sel.idx, peer_nz, err_msg=str(case))
        np.testing.assert_array_equal(a.sel.val, x[peer_nz])
        b = gaussiank_select(x, k, case["loops"])
        np.testing.assert_array_equal(b.sel.idx, peer_nz, err_msg=str(case))
        tol = 1e-6 if case["dtype"] == "float32" else 1e-13
        assert b.threshold == pytest.approx(thresholds[-1], rel=tol), case
    assert zeros_dropped == 3088  # the negative-threshold input: the peer sends its exact zeros, we do not


finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def vectors(draw):
    dtype = draw(st.sampled_from([np.float64, np.float32]))
    n = draw(st.integers(1, 60))
    x = draw(hnp.arrays(dtype, n, elements=finite))
    if draw(st.booleans()):  # many exact zeros (and negative zeros)
        x[draw(hnp.arrays(np.bool_, n))] = draw(st.sampled_from([0.0, -0.0]))
    return x, draw(st.integers(1, n)), draw(st.integers(1, 6))


@settings(max_examples=300, deadline=None)
@given(vectors())
def test_the_selection_is_every_nonzero_entry_above_the_threshold(case):
    """sel = {i : |x_i| > t in x's dtype, x_i != 0}; each evaluation's count and the code's adjustment rule
    (count < 2k/3: t / 2; count > 4k/3: 1.5 t; else stop) hold; never an exact zero."""
    x, k, loops = case
    r = gaussiank_select(x, k, loops)
    assert x.shape[0] == 1 or r.thresholds[0] == r.initial == gaussian_threshold(r.mean, r.std, k / x.shape[0])
    with np.errstate(over="ignore"):
        above = np.abs(x) > x.dtype.type(r.threshold)
    np.testing.assert_array_equal(r.sel.idx, np.flatnonzero(above & (x != 0)))
    assert np.all(r.sel.val != 0) and np.array_equal(r.sel.val, x[r.sel.idx])
    if x.shape[0] == 1:
        return
    assert r.threshold == r.thresholds[-1] and 1 <= len(r.thresholds) <= loops
    for i, (t, c) in enumerate(zip(r.thresholds, r.counts)):
        with np.errstate(over="ignore"):
            assert c == np.count_nonzero(np.abs(x) > x.dtype.type(t))
        if i + 1 < len(r.thresholds):
            assert r.thresholds[i + 1] == t * (0.5 if c < 2 * k / 3 else 1.5) and not 2 * k / 3 <= c <= 4 * k / 3
    if len(r.thresholds) < loops:
        assert 2 * k / 3 <= r.counts[-1] <= 4 * k / 3


def _tap(gen, log):
    """Forward a sans-I/O program, logging its operations."""
    val = None
    while True:
        try:
            op = gen.send(val)
        except StopIteration as stop:
            return stop.value
        log.append(op)
        val = yield op


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 40), st.data())
def test_error_feedback_conserves_mass_and_the_real_count_is_sent(P, n, data):
    """One exchange on P workers: sum_p acc_p = g + sum_p eps_p (to rounding), g identical on every rank,
    n_selected = the entries each rank selected and its messages carry exactly those (8 bytes each)."""
    k = data.draw(st.integers(1, n))
    accs = [data.draw(hnp.arrays(np.float64, n, elements=st.floats(-100, 100))) for _ in range(P)]
    spec = AlgorithmSpec("gaussiank", k=k)
    logs = [[] for _ in range(P)]
    algo = get("gaussiank")
    outs = run_lockstep([_tap(algo.exchange(spec, a, k, StepContext(p, P, 1, n, 0, 0, n)), logs[p])
                         for p, a in enumerate(accs)])
    for p, o in enumerate(outs):
        sel = gaussiank_select(accs[p], k)
        assert o.n_selected == o.n_applied == len(sel.sel)
        np.testing.assert_array_equal(o.g, outs[0].g)
        assert np.all(o.residual[sel.sel.idx] == 0)
        rest = np.ones(n, bool)
        rest[sel.sel.idx] = False
        np.testing.assert_array_equal(o.residual[rest], accs[p][rest])
    np.testing.assert_allclose(sum(accs), outs[0].g + sum(o.residual for o in outs), rtol=0, atol=1e-12)
    if P > 1:  # rank 0's first Bruck message is its own selection
        first = next(op for op in logs[0] if isinstance(op, (Send, SendRecv)))
        assert first.nbytes == 8 * outs[0].n_selected


def test_the_count_is_reported_per_step_and_varies():
    obj = make_objective("sines", d=200, n=64, seed=1)
    w = Workers(obj, shard_indices(obj.n, 3, seed=1), 4, 1)
    seen = []
    run_algorithm(AlgorithmSpec("gaussiank", k=20), w, T=8, lr=lambda t: 0.05, x0=obj.x0(1), driver="lockstep",
                  on_step=lambda t, outs: seen.append([o.n_selected for o in outs]))
    counts = {c for step in seen for c in step}
    assert len(counts) > 1 and all(c > 0 for c in counts), seen


def test_timing_only_mode_assumes_exactly_k():
    """Timing-only mode, fast engine and closed form: Top-k's allgather of exactly k entries per rank."""
    net = PRESETS["1GbE"]
    alpha, beta = net.end_to_end_alpha_beta()
    for P in (1, 2, 5, 8):
        g = AlgorithmSpec("gaussiank", k=37)
        t = AlgorithmSpec("topk", k=37)
        rg, rt = simulate_timing(g, P, 10_007, network=net), simulate_timing(t, P, 10_007, network=net)
        assert (rg.iter_s[0], rg.messages, rg.bytes) == (rt.iter_s[0], rt.messages, rt.bytes)
        assert closed_form_comm_s(g, P, 10_007, alpha, beta) == closed_form_comm_s(t, P, 10_007, alpha, beta)


def test_one_element_segments_and_bad_options():
    assert list(gaussiank_select(np.array([-2.5]), 1).sel.idx) == [0]
    assert len(gaussiank_select(np.array([0.0]), 1).sel) == 0
    assert AlgorithmSpec("gaussiank", k=3, options={"loops": 5}).opt("loops") == 5
    with pytest.raises(ConfigError, match=r"gaussiank.loops = 0 is out of range.*1 <= gaussiank.loops <= 100"):
        AlgorithmSpec("gaussiank", k=3, options={"loops": 0})

"""Trace replay (sim.engine.replay): measured local time in, network-model time out, with exact closed forms.

A replay with zero-length local segments is the bare network model, so each rank's predicted
communication time equals the collective's closed form (sim.comm.costs). A rank that starts delta seconds
late makes its exchange partner wait exactly delta more. Local segments are accounted to their
categories unchanged. A trace that does not fit the program is an error, not a silent mis-replay.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from sim.algorithms import AlgorithmSpec, sgd_step
from sim.comm.costs import ring_allreduce_time, topk_allgather_time
from sim.workloads.data import shard_indices
from sim.engine.drivers import run_lockstep
from sim.base.errors import SparsimError
from sim.machine.network import NetworkSpec
from sim.workloads.objectives import make_objective
from sim.base.ops import signature
from sim.engine.replay import StepTrace, replay
from sim.engine.runner import Workers

ALPHA, BETA = 3e-4, 2e-9
NET = NetworkSpec.from_alpha_beta(ALPHA, BETA, "star")


def lr(t):
    return 0.1


def _setup(P, d=60):  # d divisible by every P tested: equal ring chunks
    obj = make_objective("sines", d=d, n=8 * P, seed=1)
    return Workers(obj, shard_indices(obj.n, P, seed=1), 4, 1), obj.x0(1)


def _recording(gen, log):
    """Pass a program's operations through unchanged, logging their signatures (and the end)."""
    value = None
    while True:
        try:
            op = gen.send(value)
        except StopIteration as stop:
            log.append(signature(None))
            return stop.value
        log.append(signature(op))
        value = yield op


def _op_sigs(spec, w, x0, P, T):
    """sigs[r][t-1]: the signatures of rank r's operations at iteration t, then ("end",) (lock-step run)."""
    sigs = [[None] * T for _ in range(P)]
    vs, res = [x0.copy() for _ in range(P)], [np.zeros_like(x0) for _ in range(P)]
    for t in range(1, T + 1):
        logs = [[] for _ in range(P)]
        progs = [_recording(sgd_step(spec, r, P, vs[r], res[r], w.grad_fn(r, t), w.b, lr(t), t), logs[r])
                 for r in range(P)]
        outs = run_lockstep(progs)
        vs, res = [o.v for o in outs], [o.residual for o in outs]
        for r in range(P):
            sigs[r][t - 1] = logs[r]
    return sigs


def _traces(sigs, seg=lambda r, t, i: (0, 0.0), start=lambda r, t: 0.0):
    """StepTraces for the given signatures; seg(r, t, i) -> (category, seconds) of segment i."""
    return [[StepTrace(start(r, t), tuple((*seg(r, t, i), sig) for i, sig in enumerate(step)), (0.0, 0.0, 0.0))
             for t, step in enumerate(row, start=1)] for r, row in enumerate(sigs)]


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_zero_local_time_gives_the_closed_form(P):
    w, x0 = _setup(P)
    d, k, T = x0.shape[0], 4, 3
    for spec, closed in [
        (AlgorithmSpec("dense", collective="ring", value_bytes=8), ring_allreduce_time(P, d, ALPHA, BETA, 8)),
        (AlgorithmSpec("topk", k=k, value_bytes=8, index_bytes=8), topk_allgather_time(P, k, ALPHA, BETA, 8, 8)),
    ]:
        r = replay(spec, w, x0=x0, lr=lr, network=NET, traces=_traces(_op_sigs(spec, w, x0, P, T)))
        assert r.predicted_busy_s.shape == (T, P, 3)
        np.testing.assert_allclose(r.predicted_busy_s[:, :, 2], closed, rtol=1e-12)
        np.testing.assert_allclose(r.predicted_span_s, closed, rtol=1e-12)
        assert np.all(r.predicted_busy_s[:, :, :2] == 0)


def test_a_late_rank_makes_its_partner_wait_exactly_that_long():
    P, T, delta = 2, 2, 0.0123
    w, x0 = _setup(P)
    spec = AlgorithmSpec("dense", collective="ring", value_bytes=8)
    closed = ring_allreduce_time(P, x0.shape[0], ALPHA, BETA, 8)
    traces = _traces(_op_sigs(spec, w, x0, P, T), start=lambda r, t: 100.0 + (delta if r == 1 else 0.0))
    r = replay(spec, w, x0=x0, lr=lr, network=NET, traces=traces)
    np.testing.assert_allclose(r.predicted_busy_s[:, 0, 2], closed + delta, rtol=1e-12)
    np.testing.assert_allclose(r.predicted_busy_s[:, 1, 2], closed, rtol=1e-12)
    np.testing.assert_allclose(r.predicted_span_s, closed + delta, rtol=1e-12)


def test_local_segments_are_spent_and_accounted_to_their_category():
    P, T = 3, 2
    w, x0 = _setup(P)
    spec = AlgorithmSpec("gtopk", k=3, collective="tree", value_bytes=8, index_bytes=8)
    sigs = _op_sigs(spec, w, x0, P, T)
    counts = [[len(step) - 1 for step in row] for row in sigs]
    # segment i of rank r at step t lasts (1 + r + i) ms, categories cycling compute/compress/comm
    seg = lambda r, t, i: (i % 3, 1e-3 * (1 + r + i))  # noqa: E731
    r = replay(spec, w, x0=x0, lr=lr, network=NET, traces=_traces(sigs, seg=seg))
    for rank in range(P):
        for t in range(T):
            n = counts[rank][t] + 1
            for cat in (0, 1):
                want = sum(1e-3 * (1 + rank + i) for i in range(n) if i % 3 == cat)
                assert math.isclose(r.predicted_busy_s[t, rank, cat], want, rel_tol=1e-12)
            local_comm = sum(1e-3 * (1 + rank + i) for i in range(n) if i % 3 == 2)
            assert r.predicted_busy_s[t, rank, 2] >= local_comm  # plus the modelled blocking
    # each iteration lasts at least the slowest rank's local time
    for t in range(T):
        slowest = max(sum(1e-3 * (1 + rank + i) for i in range(counts[rank][t] + 1)) for rank in range(P))
        assert r.predicted_span_s[t] >= slowest


@pytest.mark.parametrize("change,needle", [(-1, "is \\('Compute', 'update'\\) in the program but \\('end',\\)"),
                                           (+1, "fewer operations")])
def test_a_trace_that_does_not_fit_the_program_is_an_error(change, needle):
    P, T = 2, 1
    w, x0 = _setup(P)
    spec = AlgorithmSpec("topk", k=3)
    sigs = _op_sigs(spec, w, x0, P, T)
    step = sigs[1][0]
    sigs[1][0] = step[:-2] + step[-1:] if change < 0 else step[:-1] + [step[-2], step[-1]]
    with pytest.raises(SparsimError, match=f"replay of rank 1.*{needle}.*not the same step"):
        replay(spec, w, x0=x0, lr=lr, network=NET, traces=_traces(sigs))


def test_ragged_or_misfitting_traces_are_rejected():
    w, x0 = _setup(2)
    spec = AlgorithmSpec("topk", k=3)
    tr = _traces(_op_sigs(spec, w, x0, 2, 2))
    with pytest.raises(SparsimError, match="same number"):
        replay(spec, w, x0=x0, lr=lr, network=NET, traces=[tr[0], tr[1][:1]])
    with pytest.raises(SparsimError, match="P = 1 ranks but workers has 2"):
        replay(spec, w, x0=x0, lr=lr, network=NET, traces=[tr[0]])


def test_a_trace_of_another_algorithm_or_k_is_rejected_by_its_signatures():
    P, T = 2, 2
    w, x0 = _setup(P)
    topk3 = AlgorithmSpec("topk", k=3, value_bytes=8, index_bytes=8)
    traces = _traces(_op_sigs(topk3, w, x0, P, T))
    r = replay(topk3, w, x0=x0, lr=lr, network=NET, traces=traces)  # its own program: fine
    np.testing.assert_allclose(r.predicted_busy_s[:, :, 2], topk_allgather_time(P, 3, ALPHA, BETA, 8, 8), rtol=1e-12)
    for other in (AlgorithmSpec("topk", k=30, value_bytes=8, index_bytes=8),
                  AlgorithmSpec("gtopk", k=3, collective="recursive_doubling", value_bytes=8, index_bytes=8),
                  AlgorithmSpec("dense", collective="ring", value_bytes=8)):
        with pytest.raises(SparsimError, match="not the same step"):
            replay(other, w, x0=x0, lr=lr, network=NET, traces=traces)


@pytest.mark.parametrize("bad,needle", [
    ((0, 0.0), "valid \\(category, seconds, signature\\)"),
    ((-1, 0.0, None), "category -1"),
    ((7, 0.0, None), "category 7"),
    ((0, -1e-3, None), "seconds -0.001"),
    ((0, float("nan"), None), "seconds nan"),
])
def test_malformed_segments_are_errors_naming_the_value(bad, needle):
    w, x0 = _setup(2)
    spec = AlgorithmSpec("topk", k=3)
    tr = _traces(_op_sigs(spec, w, x0, 2, 1))
    first = tr[0][0]
    sig = first.segments[0][2]
    seg = bad if len(bad) == 2 else (bad[0], bad[1], sig)
    tr[0][0] = StepTrace(first.start_s, (seg,) + first.segments[1:], first.busy_s)
    with pytest.raises(SparsimError, match=needle):
        replay(spec, w, x0=x0, lr=lr, network=NET, traces=tr)


def test_signatures_survive_a_json_round_trip():
    import json

    w, x0 = _setup(2)
    spec = AlgorithmSpec("gtopk", k=3, value_bytes=8, index_bytes=8)
    tr = _traces(_op_sigs(spec, w, x0, 2, 2))
    back = [[StepTrace(s["start_s"], tuple(tuple(x) for x in s["segments"]), tuple(s["busy_s"]))
             for s in json.loads(json.dumps([[st.__dict__ for st in row] for row in tr]))[r]] for r in range(2)]
    a = replay(spec, w, x0=x0, lr=lr, network=NET, traces=tr)
    b = replay(spec, w, x0=x0, lr=lr, network=NET, traces=back)
    assert np.array_equal(a.predicted_busy_s, b.predicted_busy_s)

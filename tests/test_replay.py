"""Trace replay (sim.replay): measured local time in, network-model time out, with exact closed forms.

A replay with zero-length local segments is the bare network model, so each rank's predicted
communication time equals the collective's closed form (sim.costs). A rank that starts delta seconds
late makes its exchange partner wait exactly delta more. Local segments are accounted to their
categories unchanged. A trace that does not fit the program is an error, not a silent mis-replay.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from sim.algorithms import AlgorithmSpec, sgd_step
from sim.costs import ring_allreduce_time, topk_allgather_time
from sim.data import shard_indices
from sim.drivers import run_lockstep
from sim.errors import SparsimError
from sim.network import NetworkSpec
from sim.objectives import make_objective
from sim.replay import StepTrace, replay
from sim.runner import Workers

ALPHA, BETA = 3e-4, 2e-9
NET = NetworkSpec.from_alpha_beta(ALPHA, BETA, "star")


def lr(t):
    return 0.1


def _setup(P, d=60):  # d divisible by every P tested: equal ring chunks
    obj = make_objective("sines", d=d, n=8 * P, seed=1)
    return Workers(obj, shard_indices(obj.n, P, seed=1), 4, 1), obj.x0(1)


def _counting(gen, counter):
    """Pass a program's operations through unchanged, counting them."""
    value = None
    while True:
        try:
            op = gen.send(value)
        except StopIteration as stop:
            return stop.value
        counter[0] += 1
        value = yield op


def _op_counts(spec, w, x0, P, T):
    """counts[r][t-1]: how many operations rank r's program yields at iteration t (lock-step run)."""
    counts = [[0] * T for _ in range(P)]
    vs, res = [x0.copy() for _ in range(P)], [np.zeros_like(x0) for _ in range(P)]
    for t in range(1, T + 1):
        cs = [[0] for _ in range(P)]
        progs = [_counting(sgd_step(spec, r, P, vs[r], res[r], w.grad_fn(r, t), w.b, lr(t), t), cs[r])
                 for r in range(P)]
        outs = run_lockstep(progs)
        vs, res = [o.v for o in outs], [o.residual for o in outs]
        for r in range(P):
            counts[r][t - 1] = cs[r][0]
    return counts


def _traces(counts, seg=lambda r, t, i: (0, 0.0), start=lambda r, t: 0.0):
    return [[StepTrace(start(r, t), tuple(seg(r, t, i) for i in range(n + 1)), (0.0, 0.0, 0.0))
             for t, n in enumerate(row, start=1)] for r, row in enumerate(counts)]


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_zero_local_time_gives_the_closed_form(P):
    w, x0 = _setup(P)
    d, k, T = x0.shape[0], 4, 3
    for spec, closed in [
        (AlgorithmSpec("dense", collective="ring", value_bytes=8), ring_allreduce_time(P, d, ALPHA, BETA, 8)),
        (AlgorithmSpec("topk", k=k, value_bytes=8, index_bytes=8), topk_allgather_time(P, k, ALPHA, BETA, 8, 8)),
    ]:
        r = replay(spec, w, x0=x0, lr=lr, network=NET, traces=_traces(_op_counts(spec, w, x0, P, T)))
        assert r.predicted_busy_s.shape == (T, P, 3)
        np.testing.assert_allclose(r.predicted_busy_s[:, :, 2], closed, rtol=1e-12)
        np.testing.assert_allclose(r.predicted_span_s, closed, rtol=1e-12)
        assert np.all(r.predicted_busy_s[:, :, :2] == 0)


def test_a_late_rank_makes_its_partner_wait_exactly_that_long():
    P, T, delta = 2, 2, 0.0123
    w, x0 = _setup(P)
    spec = AlgorithmSpec("dense", collective="ring", value_bytes=8)
    closed = ring_allreduce_time(P, x0.shape[0], ALPHA, BETA, 8)
    traces = _traces(_op_counts(spec, w, x0, P, T), start=lambda r, t: 100.0 + (delta if r == 1 else 0.0))
    r = replay(spec, w, x0=x0, lr=lr, network=NET, traces=traces)
    np.testing.assert_allclose(r.predicted_busy_s[:, 0, 2], closed + delta, rtol=1e-12)
    np.testing.assert_allclose(r.predicted_busy_s[:, 1, 2], closed, rtol=1e-12)
    np.testing.assert_allclose(r.predicted_span_s, closed + delta, rtol=1e-12)


def test_local_segments_are_spent_and_accounted_to_their_category():
    P, T = 3, 2
    w, x0 = _setup(P)
    spec = AlgorithmSpec("gtopk", k=3, collective="tree", value_bytes=8, index_bytes=8)
    counts = _op_counts(spec, w, x0, P, T)
    # segment i of rank r at step t lasts (1 + r + i) ms, categories cycling compute/compress/comm
    seg = lambda r, t, i: (i % 3, 1e-3 * (1 + r + i))  # noqa: E731
    r = replay(spec, w, x0=x0, lr=lr, network=NET, traces=_traces(counts, seg=seg))
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


@pytest.mark.parametrize("change,needle", [(-1, "more"), (+1, "fewer")])
def test_a_trace_that_does_not_fit_the_program_is_an_error(change, needle):
    P, T = 2, 1
    w, x0 = _setup(P)
    spec = AlgorithmSpec("topk", k=3)
    counts = _op_counts(spec, w, x0, P, T)
    counts[1][0] += change
    with pytest.raises(SparsimError, match=f"replay of rank 1 holds .* {needle} operations"):
        replay(spec, w, x0=x0, lr=lr, network=NET, traces=_traces(counts))


def test_ragged_or_misfitting_traces_are_rejected():
    w, x0 = _setup(2)
    spec = AlgorithmSpec("topk", k=3)
    counts = _op_counts(spec, w, x0, 2, 2)
    tr = _traces(counts)
    with pytest.raises(SparsimError, match="same number"):
        replay(spec, w, x0=x0, lr=lr, network=NET, traces=[tr[0], tr[1][:1]])
    with pytest.raises(SparsimError, match="P = 1 ranks but workers has 2"):
        replay(spec, w, x0=x0, lr=lr, network=NET, traces=[tr[0]])


def _signed_traces(spec, w, x0, P, T):
    """Zero-time traces carrying each operation's signature, as the torch backend records them."""
    from sim.ops import signature

    sigs = [[None] * T for _ in range(P)]
    vs, res = [x0.copy() for _ in range(P)], [np.zeros_like(x0) for _ in range(P)]
    for t in range(1, T + 1):
        logs = [[] for _ in range(P)]

        def rec(gen, log):
            value = None
            while True:
                try:
                    op = gen.send(value)
                except StopIteration as stop:
                    log.append(signature(None))
                    return stop.value
                log.append(signature(op))
                value = yield op

        outs = run_lockstep([rec(sgd_step(spec, r, P, vs[r], res[r], w.grad_fn(r, t), w.b, lr(t), t), logs[r])
                             for r in range(P)])
        vs, res = [o.v for o in outs], [o.residual for o in outs]
        for r in range(P):
            sigs[r][t - 1] = logs[r]
    return [[StepTrace(0.0, tuple((0, 0.0, s) for s in sigs[r][t]), (0.0, 0.0, 0.0)) for t in range(T)]
            for r in range(P)]


def test_a_trace_of_another_algorithm_or_k_is_rejected_by_its_signatures():
    P, T = 2, 2
    w, x0 = _setup(P)
    topk3 = AlgorithmSpec("topk", k=3, value_bytes=8, index_bytes=8)
    traces = _signed_traces(topk3, w, x0, P, T)
    r = replay(topk3, w, x0=x0, lr=lr, network=NET, traces=traces)  # its own program: fine
    np.testing.assert_allclose(r.predicted_busy_s[:, :, 2], topk_allgather_time(P, 3, ALPHA, BETA, 8, 8), rtol=1e-12)
    for other in (AlgorithmSpec("topk", k=30, value_bytes=8, index_bytes=8),
                  AlgorithmSpec("gtopk", k=3, collective="recursive_doubling", value_bytes=8, index_bytes=8),
                  AlgorithmSpec("dense", collective="ring", value_bytes=8)):
        with pytest.raises(SparsimError, match="not the same step"):
            replay(other, w, x0=x0, lr=lr, network=NET, traces=traces)
